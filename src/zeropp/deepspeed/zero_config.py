"""A DeepSpeed config's ZeRO section as a `zeropp.Config`: what
`zeropp.Config.from_deepspeed` (and `zeropp train --deepspeed_config`) read, and
the ZeRO part of `initialize`'s config (config.py). The one reader of DeepSpeed
JSON's ZeRO keys."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any, Optional, Union

import torch

from .. import config as _core
from ..config import NAMED, Config, _default_node_size, is_named, named


def zero_config(ds_config: Union[dict, str, os.PathLike], *, warn: bool = True,
                **overrides) -> Config:
    """See Config.from_deepspeed; `warn=False`: no warning for keys that do not apply
    (the caller lists unknown keys itself)."""
    ds = load_ds(ds_config)
    zo = ds.get("zero_optimization")
    if not isinstance(zo, dict):
        raise ValueError("DeepSpeed config: a 'zero_optimization' section (a JSON object) "
                         "is required")
    if zo.get("stage") != 3:
        raise ValueError(f"DeepSpeed config: zero_optimization.stage={zo.get('stage')!r} is "
                         "invalid; allowed: 3 (zeropp is ZeRO stage 3)")
    # DeepSpeed's default: parameters of up to 1e5 elements stay gathered.
    kwargs: dict[str, Any] = {"persistence_threshold": 100_000}
    ignored = [k for k in ds if k not in ("zero_optimization", "bf16", "fp16", "zeropp")]
    for key, value in zo.items():
        if key == "stage":
            continue
        if key not in ZERO_KEYS:
            ignored.append(f"zero_optimization.{key}")
            continue
        field = ZERO_KEYS[key]
        if isinstance(value, float) and value.is_integer() and field.endswith("threshold"):
            value = int(value)  # JSON's 1e5, as DeepSpeed reads it
        try:
            Config(**{field: value})
        except ValueError as e:
            raise ValueError(str(e).replace(f"zeropp.Config: {field}",
                                            f"DeepSpeed config: zero_optimization.{key}")
                             ) from None
        kwargs[field] = value
    enabled = []
    for section, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        sec = ds.get(section, {})
        if not isinstance(sec, dict):
            raise ValueError(f"DeepSpeed config: {section}={sec!r} is invalid; allowed: a JSON "
                             "object such as {\"enabled\": true}")
        on = sec.get("enabled", False)
        if not isinstance(on, bool):
            raise ValueError(f"DeepSpeed config: {section}.enabled={on!r} is invalid; "
                             "allowed: true or false")
        ignored += [f"{section}.{k}" for k in sec if k != "enabled"]
        if on:
            enabled.append(section)
            kwargs["param_dtype"] = getattr(torch, dtype)
    if len(enabled) > 1:
        raise ValueError("DeepSpeed config: bf16.enabled and fp16.enabled are both true; "
                         "allowed: at most one")
    preset = _zeropp_section(ds.get("zeropp", {}), kwargs)
    if ignored and warn:
        warnings.warn("zeropp: these DeepSpeed config keys do not apply and are ignored: "
                      + ", ".join(sorted(ignored)), stacklevel=3)
    kwargs.update(overrides)
    if preset is not None:
        node = kwargs.pop("node_size", None) or _default_node_size()
        return named(preset, node, **kwargs)
    return Config(**kwargs)


def _zeropp_section(zp: Any, kwargs: dict) -> Optional[str]:
    """The config's `zeropp` section into `kwargs`; returns its preset name (or None)."""
    if not isinstance(zp, dict):
        raise ValueError(f"DeepSpeed config: zeropp={zp!r} is invalid; allowed: a JSON object "
                         "such as {\"preset\": \"zeropp-plus\", \"node_size\": 2}")
    fields = {f.name for f in dataclasses.fields(Config)}
    preset = zp.get("preset")
    if preset is not None and (not isinstance(preset, str) or not is_named(preset)):
        raise ValueError(f"DeepSpeed config: zeropp.preset={preset!r} is invalid; allowed: "
                         f"{', '.join(NAMED)} (optionally with ~SWITCH flips)")
    for key, value in zp.items():
        if key == "preset":
            continue
        if key not in fields:
            raise ValueError(f"DeepSpeed config: zeropp.{key} is not a zeropp setting; allowed: "
                             f"preset, {', '.join(sorted(fields))}")
        if isinstance(value, str) and key in ("param_dtype", "reduce_dtype"):
            value = getattr(torch, value, value)  # JSON names a dtype: "bfloat16"
        try:
            Config(**{key: value})
        except (ValueError, TypeError) as e:
            raise ValueError(str(e).replace(f"zeropp.Config: {key}",
                                            f"DeepSpeed config: zeropp.{key}")) from None
        kwargs[key] = value
    return preset


ZERO_KEYS = {  # zero_optimization key -> Config field
    "zero_quantized_weights": "quantized_weights",
    "zero_quantized_nontrainable_weights": "quantized_nontrainable_weights",
    "zero_hpz_partition_size": "hpz_partition_size",
    "zero_quantized_gradients": "quantized_gradients",
    "stage3_param_persistence_threshold": "persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
}


def load_ds(ds_config: Union[dict, str, os.PathLike]) -> dict:
    if isinstance(ds_config, dict):
        return ds_config
    if not isinstance(ds_config, (str, os.PathLike)):
        raise TypeError(f"from_deepspeed: expected a dict or a path, got "
                        f"{type(ds_config).__name__}")
    try:
        with open(ds_config, encoding="utf-8") as f:
            ds = json.load(f)
    except OSError as e:
        raise ValueError(f"DeepSpeed config: cannot read {os.fspath(ds_config)!r}: "
                         f"{e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"DeepSpeed config: {os.fspath(ds_config)!r} is not valid JSON "
                         f"(line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(ds, dict):
        raise ValueError(f"DeepSpeed config: {os.fspath(ds_config)!r} must hold a JSON object")
    return ds


_core._DEEPSPEED[:] = [zero_config]
