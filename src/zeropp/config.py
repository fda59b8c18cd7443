"""Config: every knob of zeropp in one frozen, validated dataclass.

Names follow DeepSpeed's ZeRO++ keys where one exists (`zero_quantized_weights`
-> `quantized_weights`, ...), so a DeepSpeed user finds each switch at once.
A bad value raises `ValueError` naming the field, the value and what is allowed,
at construction time rather than deep inside a collective.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BITS = (4, 8)


@dataclass(frozen=True)
class Config:
    quantized_weights: bool = False
    """qwZ: all-gather weights as blockwise INT8 (DeepSpeed `zero_quantized_weights`)."""
    hpz_partition_size: int = 1
    """hpZ: secondary-partition group size; 1 = off (DeepSpeed `zero_hpz_partition_size`)."""
    quantized_gradients: bool = False
    """qgZ: hierarchical all-to-all INT4 gradient reduce-scatter (`zero_quantized_gradients`)."""
    quantized_nontrainable_weights: bool = False
    """Keep frozen parameters stored as INT8 (`zero_quantized_nontrainable_weights`)."""
    node_size: Optional[int] = None
    """Ranks per node; None reads LOCAL_WORLD_SIZE (torchrun sets it), else one node."""
    param_dtype: Optional[torch.dtype] = None
    """Compute dtype of gathered weights; None keeps each parameter's own dtype."""
    reduce_dtype: torch.dtype = torch.float32
    """Dtype gradients are summed in across ranks."""
    weight_bits: int = 8
    grad_bits: int = 4
    """qgZ bits per value on the inter-node hop (and the intra-node hop, unless set below)."""
    intra_node_grad_bits: Optional[int] = 8
    """qgZ bits on the intra-node hop; None = grad_bits. 8 (SDP4Bit's split) costs no
    inter-node byte: this hop never leaves the node."""
    gradient_rotation: bool = False
    """qgZ inter-node hop: randomized Hadamard rotation of each block before quantizing
    (spreads outliers, shrinks the INT4 step; blocks become powers of two)."""
    gradient_stochastic_rounding: bool = False
    """qgZ inter-node hop: stochastic rounding (unbiased) instead of round-to-nearest."""
    gradient_error_feedback: bool = False
    """qgZ inter-node hop: carry each sender's quantization residual into its next
    send (LoCo-style moving average); costs |g|/D fp32 per unit per rank * (N-1)/N."""
    error_feedback_dtype: torch.dtype = torch.float32
    """The residual's storage dtype (the average is taken in fp32, rounded once into
    it); bfloat16 halves error feedback's memory, as LoCo keeps its compensation in
    low bits (+0.12% loss over 3 seeds, worse than fp32 on each: RESULTS.md)."""
    hierarchical_gather: bool = False
    """Gather weights across nodes among same-local-index ranks first, then inside the
    node: (N-1)/N of the payload crosses per node instead of (W-1)/W."""
    weight_delta: bool = False
    """qWD (needs hpZ at the node size): secondaries persist across steps and are
    refreshed after each optimizer step by a quantized delta from each shard's owner."""
    weight_delta_bits: int = 4
    """Bits per value of the qWD deltas (moves of the copies' codes, or differences);
    3 (moves of up to 3 codes exact; INT8 copies only) sends a quarter fewer bytes."""
    weight_copy_bits: Optional[int] = 8
    """qWD: the copies are qwZ's INT8 blocks of the masters (the bytes of ZeRO++'s INT8
    secondary, which the node gathers), moved by integer code deltas (qwd.py); None
    keeps them exact at the compute dtype, refreshed by quantized value differences."""
    weight_delta_stochastic_rounding: bool = False
    """qWD: round the deltas stochastically (unbiased) instead of to nearest; with
    nearest, exact copies lag updates under half a step (carried in the error), and
    INT8 copies lag only in blocks whose codes moved by more than the delta's range."""
    weight_refresh_every: Optional[int] = None
    """qWD: a full (qwZ INT8 or exact) refresh every this many optimizer steps; None = only
    when needed (first step, after a load, after an edit outside the optimizer)."""
    block_size: int = 2048
    """Elements per quantization block (one fp32 scale each)."""
    prefetch: bool = True
    """Issue gathers asynchronously ahead of their use (False: gather on demand)."""
    prefetch_depth: int = 1
    """How many units ahead gathers are issued, forward and backward; each holds its
    unit's full weights until used."""
    async_reduce: bool = True
    """Reduce gradients on two communication threads while backward goes on (reduce.py);
    False runs each unit's reduction inside its gradient hook (bitwise the same)."""
    reduce_buckets: int = 1
    """Unit gradients handed to the reduce pipeline and not yet through its first
    stage, at most: the hook waits beyond this (bounds the memory of full gradients;
    with 1 a rank holds the unit being reduced and the one backward is filling)."""
    persistence_threshold: int = 0
    """Parameters of at most this many elements stay gathered between steps (DeepSpeed
    `stage3_param_persistence_threshold`): each unit's small ones (biases, norms) in one
    flat buffer, gathered once after every optimizer step instead of in every forward
    and backward, resident at the compute dtype. 0 = none."""
    model_persistence_threshold: Optional[int] = None
    """At most this many elements persistent in all, in model order (DeepSpeed
    `stage3_model_persistence_threshold`); None = no cap."""
    collective_timeout: Optional[float] = None
    """Seconds any one collective may take before it fails with an error naming
    the operation and the unit (a rank died or runs different code); None =
    the process group's timeout."""

    def __post_init__(self) -> None:
        for name in ("quantized_weights", "quantized_gradients",
                     "quantized_nontrainable_weights", "prefetch", "async_reduce",
                     "gradient_rotation",
                     "gradient_stochastic_rounding", "gradient_error_feedback",
                     "hierarchical_gather", "weight_delta",
                     "weight_delta_stochastic_rounding"):
            _check(name, getattr(self, name), isinstance(getattr(self, name), bool),
                   "True or False")
        _check_int("hpz_partition_size", self.hpz_partition_size, 1, "an integer >= 1")
        _check_int("prefetch_depth", self.prefetch_depth, 1, "an integer >= 1")
        _check_int("reduce_buckets", self.reduce_buckets, 1, "an integer >= 1")
        _check_int("persistence_threshold", self.persistence_threshold, 0, "an integer >= 0")
        if self.model_persistence_threshold is not None:
            _check_int("model_persistence_threshold", self.model_persistence_threshold, 0,
                       "None or an integer >= 0")
        if self.node_size is not None:
            _check_int("node_size", self.node_size, 1, "None or an integer >= 1")
        if self.param_dtype is not None:
            _check("param_dtype", self.param_dtype, self.param_dtype in _FLOAT_DTYPES,
                   "None, torch.float32, torch.bfloat16 or torch.float16")
        _check("reduce_dtype", self.reduce_dtype, self.reduce_dtype in _FLOAT_DTYPES,
               "torch.float32, torch.bfloat16 or torch.float16")
        # not float16: its range (65504) could overflow a residual and poison every send
        _check("error_feedback_dtype", self.error_feedback_dtype,
               self.error_feedback_dtype in (torch.float32, torch.bfloat16),
               "torch.float32 or torch.bfloat16")
        optional = ("intra_node_grad_bits", "weight_copy_bits")
        for name in ("weight_bits", "grad_bits", *optional):
            v = getattr(self, name)
            if v is not None or name not in optional:
                _check(name, v, _is_int(v) and v in _BITS,
                       "None, 4 or 8" if name in optional else "4 or 8")
        v = self.weight_delta_bits
        _check("weight_delta_bits", v, _is_int(v) and v in (3, 4, 8),
               "3 (moves of INT8 copies' codes only), 4 or 8")
        if v == 3 and self.weight_copy_bits != 8:
            raise ValueError("zeropp.Config: weight_delta_bits=3 moves the codes of INT8 "
                             "copies; it needs weight_copy_bits=8, got "
                             f"{self.weight_copy_bits!r}")
        _check("block_size", self.block_size,
               _is_int(self.block_size) and 8 <= self.block_size <= 1 << 20
               and self.block_size % 8 == 0,
               "a multiple of 8 in [8, 1048576] (keeps wire pieces 4-byte aligned)")
        if self.weight_refresh_every is not None:
            _check_int("weight_refresh_every", self.weight_refresh_every, 1,
                       "None or an integer >= 1")
        if self.weight_delta and self.hpz_partition_size == 1:
            raise ValueError("zeropp.Config: weight_delta=True needs hpZ (the secondary copies "
                             "it refreshes): set hpz_partition_size to the node size")
        if self.collective_timeout is not None:
            t = self.collective_timeout
            _check("collective_timeout", t, isinstance(t, (int, float))
                   and not isinstance(t, bool) and 0 < t < float("inf"),
                   "None or a positive number of seconds")

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (dtypes as names such as "bfloat16")."""
        return {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v)
                for k, v in dataclasses.asdict(self).items()}

    @property
    def quantized(self) -> bool:
        """Whether any technique quantizes (then shards are padded to whole blocks)."""
        return (self.quantized_weights or self.quantized_gradients
                or self.quantized_nontrainable_weights or self.weight_delta)

    @classmethod
    def preset(cls, name: str, node_size: Optional[int] = None, **overrides) -> Config:
        """A named configuration: "zero3", "zeropp" (the paper's three techniques, INT4
        on both gradient hops), "zeropp-plus" (everything beyond the paper at the
        measured defaults), the single techniques "qwz", "hpz", "qgz", and any of them
        with one switch flipped, e.g. "zeropp-plus~rotation" (see SWITCHES).
        hpZ is sized to `node_size` (None: LOCAL_WORLD_SIZE, else the world size,
        else 1); `overrides` are Config fields that win."""
        if node_size is None:
            node_size = _default_node_size()
        return named(name, node_size, **overrides)

    @classmethod
    def from_deepspeed(cls, ds_config: Union[dict, str, os.PathLike], **overrides) -> Config:
        """A Config from a DeepSpeed config (a dict or a JSON file's path).

        Reads `zero_optimization` (stage must be 3), its ZeRO++ keys and the
        persistence thresholds (DeepSpeed's default 1e5 when absent), the
        `bf16` / `fp16` sections for the compute dtype, and an optional `zeropp`
        section of zeropp's own: `{"preset": "zeropp-plus", "node_size": 2, ...}`
        (a named configuration and/or Config fields by name; they win over the
        ZeRO++ keys). Keys that do not apply to zeropp are listed in one warning;
        a bad value is an error naming the key. `overrides` are Config fields
        that win over the file.
        """
        return _DEEPSPEED[0](ds_config, **overrides)


# The DeepSpeed front door's parser of a ds_config.json's ZeRO section
# (zeropp/deepspeed/zero_config.py), registered when it is imported (`import
# zeropp` does): DeepSpeed JSON is read in one place, outside the core.
_DEEPSPEED: list = []


# The configurations that Config.preset, --compare, the benchmarks and `zeropp
# bench` name, as Config switches; "D" stands for the node size.
_ZEROPP = {"quantized_weights": True, "hpz_partition_size": "D", "quantized_gradients": True}
NAMED = {
    "zero3": {},
    "qwz": {"quantized_weights": True},
    "hpz": {"hpz_partition_size": "D"},
    "qgz": {"quantized_gradients": True, "intra_node_grad_bits": 4},
    "zeropp": {**_ZEROPP, "intra_node_grad_bits": 4},   # as published: INT4 on both hops
    # Beyond the paper; each switch's default chosen by the 3-seed measurement in
    # docs/notebook.md ("Beyond ZeRO++: accuracy over 3 seeds"), not by belief.
    "zeropp-plus": {**_ZEROPP, "intra_node_grad_bits": 8, "hierarchical_gather": True,
                    "weight_delta": True, "weight_copy_bits": 8, "gradient_rotation": False,
                    "gradient_stochastic_rounding": False, "gradient_error_feedback": True,
                    "weight_delta_stochastic_rounding": False},
}
# Short names of the switches "NAME~SWITCH" flips (ablations): booleans are
# negated, intra8 toggles the intra-node gradient hop between 8 and 4 bits, copy8
# qWD's copies between INT8 codes and exact ones at the compute dtype, delta3 qWD's
# moves between 4 and 3 bits, ef16 error feedback's residual between fp32 and bf16,
# deep and buckets the prefetch depth and the reduce pipeline's full gradients
# between 1 and 2.
SWITCHES = {"hier": "hierarchical_gather", "qwd": "weight_delta", "rotation": "gradient_rotation",
            "sr": "gradient_stochastic_rounding", "ef": "gradient_error_feedback",
            "intra8": "intra_node_grad_bits", "qwz": "quantized_weights",
            "dsr": "weight_delta_stochastic_rounding", "copy8": "weight_copy_bits",
            "qgz": "quantized_gradients", "async": "async_reduce", "deep": "prefetch_depth",
            "buckets": "reduce_buckets", "delta3": "weight_delta_bits",
            "ef16": "error_feedback_dtype"}


def is_named(name: str) -> bool:
    base, *flips = name.split("~")
    return base in NAMED and all(f in SWITCHES for f in flips)


def named(name: str, node_size: int, **fields) -> Config:
    """The Config of a named configuration (see NAMED, and "~SWITCH" flips) on
    nodes of `node_size`."""
    base, *flips = name.split("~")
    if not is_named(name):
        raise ValueError(f"zeropp: unknown configuration {name!r}; choose from "
                         f"{', '.join(NAMED)}, optionally with ~SWITCH flips "
                         f"({', '.join(SWITCHES)})")
    if {"copy8", "delta3"} <= set(flips):
        raise ValueError(f"zeropp: configuration {name!r} flips both copy8 and delta3, which "
                         "do not combine: INT3 moves are moves of INT8 copies' codes, and "
                         "exact copies take INT4 value deltas")
    switches = {k: node_size if v == "D" else v for k, v in NAMED[base].items()}
    for flip in flips:
        field = SWITCHES[flip]
        now = switches.get(field, getattr(Config, field))
        if field == "intra_node_grad_bits":
            switches[field] = 4 if now == 8 else 8
        elif field == "weight_copy_bits":
            switches[field] = None if now == 8 else 8
        elif field == "weight_delta_bits":
            switches[field] = 3 if now == 4 else 4
        elif field == "error_feedback_dtype":
            switches[field] = torch.bfloat16 if now == torch.float32 else torch.float32
        elif field in ("prefetch_depth", "reduce_buckets"):
            switches[field] = 2 if now == 1 else 1
        else:
            switches[field] = not now
    if not switches.get("hpz_partition_size", 1) > 1:
        switches["weight_delta"] = False  # qWD refreshes hpZ secondaries: without hpZ, none
    return Config(node_size=node_size, **{**switches, **fields})


def _default_node_size() -> int:
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(name: str, value, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"zeropp.Config: {name}={value!r} is invalid; allowed: {allowed}")


def _check_int(name: str, value, minimum: int, allowed: str) -> None:
    _check(name, value, _is_int(value) and value >= minimum, allowed)
