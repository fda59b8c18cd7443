"""A DeepSpeed config (ds_config.json) for `zeropp.initialize`: batch sizes,
optimizer, scheduler, clipping, precision and loss scaling, with DeepSpeed's
semantics (its 0.19 defaults), and the ZeRO section as a zeropp Config.

[Note: batch sizes]
train_batch_size = micro_batch_per_gpu * gradient_accumulation_steps * W.
Any two determine the third (floor division, as DeepSpeed); one alone:
train_batch_size -> accumulation 1; micro -> accumulation 1. Then the three
must agree exactly, or a ValueError names them and W.

Unknown keys are listed in one warning; keys DeepSpeed has that zeropp does
not need are accepted silently (IGNORED); a wrong value is an error naming
the key.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from ..config import Config, _is_int
from .zero_config import ZERO_KEYS, load_ds, zero_config

# Top-level keys read here.
KNOWN = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
         "optimizer", "scheduler", "gradient_clipping", "fp16", "bf16", "bfloat16",
         "steps_per_print", "zero_optimization", "zeropp", "dataloader_drop_last",
         "zero_allow_untested_optimizer", "managed_gradient_accumulation", "checkpoint"}
# DeepSpeed keys that change nothing here (logging, timers, kernels zeropp does not use).
IGNORED = {"wall_clock_breakdown", "memory_breakdown", "prescale_gradients",
           "gradient_predivide_factor", "communication_data_type", "flops_profiler",
           "tensorboard", "wandb", "csv_monitor", "comms_logger", "log_level", "activation_checkpointing",
           "dump_state", "seed"}
ZERO_IGNORED = {"overlap_comm", "contiguous_gradients", "reduce_bucket_size",
                "stage3_prefetch_bucket_size",
                "stage3_max_live_parameters", "stage3_max_reuse_distance",
                "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                "sub_group_size", "allgather_bucket_size", "round_robin_gradients",
                "zero_quantized_nontrainable_weights_bits", "allgather_partitions",
                "reduce_scatter", "cpu_offload", "load_from_fp32_weights",
                "elastic_checkpoint", "ignore_unused_parameters", "legacy_stage1",
                "mics_shard_size", "mics_hierarchical_params_gather",
                # DeepSpeed's re-fetching F.linear for stage 3 (on by default there):
                # torch's F.linear computes the same here (deepspeed.runtime.zero.linear)
                "memory_efficient_linear"}
OFFLOAD_KEYS = ("offload_optimizer", "offload_param")
# Sections that turn on a DeepSpeed feature zeropp does not have: present (pipeline,
# moe), a size above 1 (tensor / sequence parallelism), or "enabled": true (the rest,
# which DeepSpeed leaves off by default).
UNSUPPORTED_SECTIONS = {"pipeline": "pipeline parallelism", "moe": "Mixture-of-Experts",
                        "tensor_parallel": "tensor parallelism",
                        "sequence_parallel_size": "sequence parallelism",
                        "amp": "apex AMP", "nebula": "Nebula checkpoints",
                        "autotuning": "the autotuner",
                        "data_efficiency": "data efficiency (curriculum / routing)",
                        "torch_autocast": "the engine's own torch.autocast with "
                                          "per-parameter communication dtypes",
                        "weight_quantization": "quantized weight initialization"}
FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
             "hysteresis", "consecutive_hysteresis", "min_loss_scale",
             "fp16_master_weights_and_grads"}
BF16_KEYS = {"enabled", "immediate_grad_update", "check_grad_overflow",
             "bf16_master_weights_and_grads", "bf16_optimizer_states"}


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config zeropp cannot run (DeepSpeed's name for it); a ValueError."""


TAG_VALIDATION = ("warn", "fail", "ignore")


@dataclass
class LossScaling:
    """fp16's loss scale: static (`loss_scale` > 0) or dynamic (DeepSpeed's rule)."""
    static: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0


@dataclass
class DSConfig:
    train_batch_size: int
    micro_batch: int
    grad_accum: int
    zero: Config
    optimizer: Optional[dict] = None       # {"type": ..., "params": {...}}
    scheduler: Optional[dict] = None
    gradient_clipping: float = 1.0          # DeepSpeed 0.19's default; 0 = off
    fp16: Optional[LossScaling] = None      # None: fp16 off
    bf16: bool = False
    skip_non_finite: bool = True            # bf16.check_grad_overflow (and always for fp16)
    steps_per_print: Optional[int] = None
    drop_last: bool = False
    managed_accumulation: bool = True       # False: every step() is a boundary (the caller's)
    tag_validation: str = "warn"            # checkpoint.tag_validation, lower case
    leaf_module: dict = field(default_factory=dict)  # zero_optimization.leaf_module, as lists
    raw: dict = field(default_factory=dict)


def _err(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"DeepSpeed config: {key}={value!r} is invalid; allowed: {allowed}")


def _pos_int(key: str, value: Any) -> int:
    if not (_is_int(value) and value > 0):
        raise _err(key, value, "a positive integer")
    return value


def batch_sizes(ds: dict, world: int) -> tuple[int, int, int]:
    """(train_batch_size, micro_batch_per_gpu, gradient_accumulation_steps) by
    DeepSpeed's rule (see the note)."""
    tb, mb, gas = (ds.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                        "gradient_accumulation_steps"))
    for k, v in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb),
                 ("gradient_accumulation_steps", gas)):
        if v is not None:
            _pos_int(k, v)
    if tb is None and mb is None:
        raise ValueError("DeepSpeed config: set train_batch_size or "
                         "train_micro_batch_size_per_gpu (or both)")
    if tb is not None and mb is not None and gas is None:
        gas = tb // mb // world
    elif tb is not None and gas is not None and mb is None:
        mb = tb // world // gas
    elif mb is not None and gas is not None and tb is None:
        tb = mb * gas * world
    elif tb is not None and mb is None:
        gas, mb = 1, tb // world
    elif mb is not None and tb is None:
        gas, tb = 1, mb * world
    if not mb or not gas or tb != mb * gas * world:
        # HF Trainer and accelerate fill the batch size in for the world they see: on a
        # machine without a GPU, one process unless told to run on the CPU.
        hint = ("; it was written for a world of 1: on a machine without a GPU, HF Trainer "
                "and accelerate see one process unless given TrainingArguments(use_cpu=True)"
                " or PartialState(cpu=True)"
                if world > 1 and tb is not None and mb and gas and tb == mb * gas
                and not torch.cuda.is_available() else "")
        raise ValueError(
            f"DeepSpeed config: train_batch_size ({tb}) must equal "
            f"train_micro_batch_size_per_gpu ({mb}) x gradient_accumulation_steps ({gas}) x "
            f"the world size ({world}); given: "
            + ", ".join(f"{k}={ds[k]}" for k in ("train_batch_size",
                                                 "train_micro_batch_size_per_gpu",
                                                 "gradient_accumulation_steps") if k in ds)
            + hint)
    return tb, mb, gas


def _section(ds: dict, key: str) -> Optional[dict]:
    sec = ds.get(key)
    if sec is None:
        return None
    if not isinstance(sec, dict):
        raise _err(key, sec, "a JSON object")
    return sec


def _typed(key: str, sec: Optional[dict]) -> Optional[dict]:
    if sec is None:
        return None
    t, params = sec.get("type"), sec.get("params", {})
    if not isinstance(t, str):
        raise _err(f"{key}.type", t, "a name such as \"AdamW\"" if key == "optimizer"
                   else "a name such as \"WarmupLR\"")
    if not isinstance(params, dict):
        raise _err(f"{key}.params", params, "a JSON object")
    return {"type": t, "params": dict(params)}


def _fp16(sec: Optional[dict]) -> Optional[LossScaling]:
    if not sec or not sec.get("enabled", False):
        return None
    ls = LossScaling()
    v = sec.get("loss_scale", 0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise _err("fp16.loss_scale", v, "0 (dynamic) or a positive number (static)")
    ls.static = float(v)
    for k in ("initial_scale_power", "loss_scale_window", "hysteresis"):
        if k == "initial_scale_power" and _is_int(sec.get(k)) and sec[k] == 0:
            ls.initial_scale_power = 0  # a scale of 1, as DeepSpeed allows
        elif k in sec:
            setattr(ls, k, _pos_int(f"fp16.{k}", sec[k]))
    if "min_loss_scale" in sec:
        m = sec["min_loss_scale"]
        if isinstance(m, bool) or not isinstance(m, (int, float)) or m <= 0:
            raise _err("fp16.min_loss_scale", m, "a positive number")
        ls.min_loss_scale = float(m)
    c = sec.get("consecutive_hysteresis", False)
    if not isinstance(c, bool):
        raise _err("fp16.consecutive_hysteresis", c, "true or false")
    ls.consecutive_hysteresis = c
    return ls


def _refuse_unsupported(ds: dict) -> None:
    """DeepSpeed features zeropp does not have: one line naming the key."""
    zo = ds.get("zero_optimization")
    if isinstance(zo, dict) and zo.get("mics_shard_size", -1) not in (-1, 0, None):
        raise ValueError(f"DeepSpeed config: zero_optimization.mics_shard_size="
                         f"{zo['mics_shard_size']!r} is not supported (MiCS is not part of "
                         "zeropp; its hierarchical gather and hpZ cover the same ground); "
                         "allowed: -1")
    if isinstance(zo, dict) and zo.get("cpu_offload") not in (None, False):
        raise ValueError("DeepSpeed config: zero_optimization.cpu_offload=true is not supported "
                         "(zeropp has no ZeRO-Offload); allowed: false")
    for key in OFFLOAD_KEYS:
        sec = zo.get(key) if isinstance(zo, dict) else None
        device = sec.get("device", "none") if isinstance(sec, dict) else sec
        if sec is not None and device not in ("none", None):
            raise ValueError(f"DeepSpeed config: zero_optimization.{key}.device={device!r} is "
                             "not supported (zeropp has no ZeRO-Offload); allowed: \"none\"")
    for key, what in UNSUPPORTED_SECTIONS.items():
        sec = ds.get(key)
        if key == "tensor_parallel" and isinstance(sec, dict):
            on = sec.get("autotp_size", sec.get("tp_size", 1)) not in (0, 1)
        elif key == "sequence_parallel_size":
            on = sec not in (None, 0, 1)
        elif key in ("pipeline", "moe", "weight_quantization"):
            on = bool(sec) and (not isinstance(sec, dict) or sec.get("enabled", True) is True)
        else:
            on = isinstance(sec, dict) and sec.get("enabled", False) is True
        if on:
            raise ValueError(f"DeepSpeed config: {key} is not supported ({what} is not part of "
                             "zeropp); remove the section")


# Sections where DeepSpeed itself drops an unfilled "auto" (its defaults apply).
AUTO_DEFAULTS = ("zero_optimization", "fp16", "bf16", "bfloat16")


def _drop_auto(tree: Any, keep: tuple = ()) -> Any:
    if isinstance(tree, dict):
        return {k: _drop_auto(v) for k, v in tree.items() if v != "auto" or k in keep}
    return tree


def _auto_values(ds: dict) -> dict:
    """Hugging Face fills "auto" values (Trainer, accelerate). Left unfilled, they
    mean DeepSpeed's default inside zero_optimization / fp16 / bf16 (as DeepSpeed
    drops them there; `stage` must still be given); anywhere else DeepSpeed fails on
    them, and so does this, naming the key, rather than train at a default."""
    def find(tree: Any, path: str) -> Optional[str]:
        if tree == "auto":
            return path
        if isinstance(tree, dict):
            return next((p for k, v in tree.items() if (p := find(v, f"{path}.{k}"))), None)
        return None
    for key, value in ds.items():
        if key not in AUTO_DEFAULTS and (where := find(value, key)):
            raise ValueError(f'DeepSpeed config: {where}="auto" was not filled ("auto" is '
                             "for Hugging Face's Trainer / accelerate to fill); set a value")
    return {k: _drop_auto(v, keep=("stage",)) if k in AUTO_DEFAULTS else v
            for k, v in ds.items()}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def with_override(ds: dict) -> dict:
    """`ZEROPP_DS_CONFIG` (a JSON object, inline or a file path) merged over the
    script's config: how the ZeRO++ keys (or stage 3) reach a script that builds its
    config in code, without editing it."""
    text = os.environ.get("ZEROPP_DS_CONFIG", "").strip()
    if not text:
        return ds
    try:
        over = json.loads(text) if text.startswith("{") else json.loads(Path(text).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"ZEROPP_DS_CONFIG: not a JSON object or a readable JSON file: {e}") \
            from None
    if not isinstance(over, dict):
        raise ValueError("ZEROPP_DS_CONFIG: must be a JSON object")
    return _merge(ds, over)


def _warn_stage_under_alias(given: dict) -> None:
    """Under install_as_deepspeed, transformers / accelerate / TRL take their ZeRO-3
    paths (gathers for generation, the consolidated save) from the stage in the config
    they hold; zeropp runs stage 3 whatever that says (a missing section, or stage 3
    from ZEROPP_DS_CONFIG), so a config not saying 3 itself leaves them on the wrong
    paths."""
    zo = given.get("zero_optimization")
    stage = zo.get("stage") if isinstance(zo, dict) else None
    if stage != 3:
        warnings.warn(f"zeropp: the config says zero_optimization.stage={stage!r}; zeropp runs "
                      "ZeRO-3, but Hugging Face libraries read the stage from their config: set "
                      "\"zero_optimization\": {\"stage\": 3} in it", stacklevel=4)


# DeepSpeed's defaults for zero_optimization.leaf_module
# (deepspeed/runtime/zero/leaf_module_config.py, also answered by the alias): Hugging
# Face's sparse MoE blocks are leaves wherever a model has them, unless the config
# gives its own "classes".
DEFAULT_LEAF_MODULE_CLASSES: list[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []


def _leaf_module(sec: Any) -> dict:
    """zero_optimization.leaf_module: {"classes", "names", "name_suffixes"}, each a
    string or a list of strings; a list not given is DeepSpeed's default (above)."""
    out = {"classes": list(DEFAULT_LEAF_MODULE_CLASSES),
           "names": list(DEFAULT_LEAF_MODULE_NAMES),
           "name_suffixes": list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES)}
    if sec is None:
        return out
    if not isinstance(sec, dict) or set(sec) - set(out):
        raise _err("zero_optimization.leaf_module", sec,
                   'a JSON object with "classes", "names" and / or "name_suffixes"')
    for k, v in sec.items():
        v = [v] if isinstance(v, str) else v
        if not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise _err(f"zero_optimization.leaf_module.{k}", v, "a string or a list of strings")
        out[k] = list(dict.fromkeys(v))
    return out


def _read_by_config(key: str) -> bool:
    """zero_optimization keys that zero_config reads (or refuses)."""
    return key.startswith("zero_") or key in ZERO_KEYS


def parse(config: Any, world: int, alias_installed: bool = False) -> DSConfig:
    """A DeepSpeed config (dict or JSON path) for a world of `world` ranks, with
    `ZEROPP_DS_CONFIG` merged over it."""
    given = load_ds(config)
    if alias_installed:
        _warn_stage_under_alias(given)
    ds = _auto_values(with_override(given))
    # TRL writes tuning knobs as flat dotted keys ("zero_optimization.reduce_bucket_size");
    # DeepSpeed ignores them, and so do we when they name a knob zeropp ignores.
    ds = {k: v for k, v in ds.items()
          if not (k.startswith("zero_optimization.") and k.split(".", 1)[1] in ZERO_IGNORED)}
    tb, mb, gas = batch_sizes(ds, world)
    if "bfloat16" in ds and "bf16" not in ds:
        ds = {**ds, "bf16": ds["bfloat16"]}
    fp16, bf16 = _section(ds, "fp16"), _section(ds, "bf16")
    unknown = sorted(k for k in ds if k not in KNOWN | IGNORED)
    for name, sec, keys in (("fp16", fp16, FP16_KEYS), ("bf16", bf16, BF16_KEYS)):
        unknown += [f"{name}.{k}" for k in (sec or {}) if k not in keys]
    _refuse_unsupported(ds)
    zo = ds.get("zero_optimization")
    if zo is None:
        zo = {"stage": 3}  # zeropp is ZeRO-3: a script without the section gets it
    leaf = _leaf_module(zo.get("leaf_module") if isinstance(zo, dict) else None)
    if isinstance(zo, dict):
        zo = {k: v for k, v in zo.items() if k not in OFFLOAD_KEYS and k != "leaf_module"}
        unknown += [f"zero_optimization.{k}" for k in zo
                    if k not in ZERO_IGNORED and k != "stage" and not _read_by_config(k)]
    # The Config sees only what it reads (its own warning would repeat ours).
    sub = {"zero_optimization": ({k: v for k, v in zo.items() if k not in ZERO_IGNORED
                                  and (k == "stage" or _read_by_config(k))}
                                 if isinstance(zo, dict) else zo),
           "fp16": {"enabled": bool(fp16 and fp16.get("enabled"))},
           "bf16": {"enabled": bool(bf16 and bf16.get("enabled"))}}
    if "zeropp" in ds:
        sub["zeropp"] = ds["zeropp"]
    zero = zero_config(sub, warn=False)
    clip = ds.get("gradient_clipping", 1.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise _err("gradient_clipping", clip, "a number >= 0 (0 = off)")
    spp = ds.get("steps_per_print")
    if isinstance(spp, float) and spp == math.inf:
        spp = None  # accelerate writes inf: never print
    elif spp is not None:
        if not (_is_int(spp) and spp > 0):
            raise _err("steps_per_print", spp, "a positive integer, or inf (never)")
    drop = ds.get("dataloader_drop_last", False)
    if not isinstance(drop, bool):
        raise _err("dataloader_drop_last", drop, "true or false")
    skip = True
    if bf16 and "check_grad_overflow" in bf16:
        skip = bf16["check_grad_overflow"]
        if not isinstance(skip, bool):
            raise _err("bf16.check_grad_overflow", skip, "true or false")
    managed = ds.get("managed_gradient_accumulation", True)
    if not isinstance(managed, bool):
        raise _err("managed_gradient_accumulation", managed, "true or false")
    ck = _section(ds, "checkpoint") or {}
    tag = ck.get("tag_validation", "Warn")
    if not (isinstance(tag, str) and tag.lower() in TAG_VALIDATION):
        raise _err("checkpoint.tag_validation", tag, "Warn, Fail or Ignore")
    if unknown:
        warnings.warn("zeropp.initialize: unknown DeepSpeed config keys, ignored: "
                      + ", ".join(unknown), stacklevel=3)
    return DSConfig(train_batch_size=tb, micro_batch=mb, grad_accum=gas, zero=zero,
                    optimizer=_typed("optimizer", _section(ds, "optimizer")),
                    scheduler=_typed("scheduler", _section(ds, "scheduler")),
                    gradient_clipping=float(clip), fp16=_fp16(fp16),
                    bf16=bool(bf16 and bf16.get("enabled")), skip_non_finite=skip,
                    steps_per_print=spp, drop_last=drop, managed_accumulation=managed,
                    tag_validation=tag.lower(), leaf_module=leaf, raw=ds)
