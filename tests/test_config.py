"""Config validates every field at construction, naming field, value and range."""

from __future__ import annotations

import pytest
import torch

import zeropp

BAD = [
    ("quantized_weights", 1), ("quantized_weights", "yes"),
    ("quantized_gradients", None), ("quantized_nontrainable_weights", 0),
    ("prefetch", "no"),
    ("hpz_partition_size", 0), ("hpz_partition_size", -2), ("hpz_partition_size", 2.0),
    ("hpz_partition_size", True),
    ("node_size", 0), ("node_size", 1.5), ("node_size", "2"),
    ("param_dtype", torch.int8), ("param_dtype", "bf16"),
    ("reduce_dtype", None), ("reduce_dtype", torch.float64),
    ("weight_bits", 3), ("weight_bits", 16), ("grad_bits", 2), ("grad_bits", 8.0),
    ("block_size", 0), ("block_size", 7), ("block_size", 12), ("block_size", 1 << 21),
    ("block_size", 64.0), ("intra_node_grad_bits", 2),
    ("persistence_threshold", -1), ("persistence_threshold", 1.5),
    ("model_persistence_threshold", -1),
]


@pytest.mark.parametrize("field,value", BAD)
def test_invalid_field_raises_value_error_naming_field_value_and_range(field, value):
    with pytest.raises(ValueError) as e:
        zeropp.Config(**{field: value})
    msg = str(e.value)
    assert f"{field}={value!r}" in msg and "allowed" in msg


def test_defaults_are_plain_zero3():
    c = zeropp.Config()
    assert (c.quantized_weights, c.hpz_partition_size, c.quantized_gradients) == (False, 1, False)
    assert c.reduce_dtype == torch.float32 and c.param_dtype is None


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        zeropp.Config().node_size = 4


def test_valid_values_are_accepted():
    c = zeropp.Config(node_size=8, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                      weight_bits=4, grad_bits=8, block_size=256, hpz_partition_size=8)
    assert c.replace(node_size=2).node_size == 2


def test_weight_deltas_need_hpz_and_qwz_int8_copies():
    """qWD moves the codes of hpZ's INT8 secondaries (qwZ at 8 bits): without hpZ,
    without qwZ or with INT4 qwZ there are none to move."""
    c = zeropp.Config(weight_delta=True, hpz_partition_size=2, quantized_weights=True)
    assert c.weight_delta and c.weight_bits == 8
    with pytest.raises(ValueError, match="needs hpZ"):
        zeropp.Config(weight_delta=True, quantized_weights=True)
    with pytest.raises(ValueError, match="quantized_weights"):
        zeropp.Config(weight_delta=True, hpz_partition_size=2)
    with pytest.raises(ValueError, match="weight_bits=8"):
        zeropp.Config(weight_delta=True, hpz_partition_size=2, quantized_weights=True,
                      weight_bits=4)


@pytest.mark.parametrize("field,value", [
    ("gradient_rotation", True), ("gradient_stochastic_rounding", True),
    ("weight_delta_stochastic_rounding", True), ("weight_delta_bits", 3),
    ("weight_copy_bits", None), ("error_feedback_dtype", torch.bfloat16),
    ("weight_refresh_every", 10)])
def test_retired_fields_are_unexpected_keyword_arguments(field, value):
    """Rotation, stochastic rounding, INT3 deltas, exact copies, the bf16 residual and
    periodic refreshes are gone: naming them is an error, not silently ignored."""
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{field}'"):
        zeropp.Config(**{field: value})


def test_persistence_threshold_is_off_in_zeropp_and_deepspeeds_1e5_from_a_deepspeed_config():
    from zeropp.deepspeed.config import parse
    assert zeropp.Config().persistence_threshold == 0
    zo = {"stage": 3}
    assert zeropp.Config.from_deepspeed({"zero_optimization": zo}).persistence_threshold == 100_000
    assert parse({"train_batch_size": 1, "zero_optimization": zo}, 1).zero.persistence_threshold \
        == 100_000
    zo = {"stage": 3, "stage3_param_persistence_threshold": 1e3,
          "stage3_model_persistence_threshold": 5000}
    c = parse({"train_batch_size": 1, "zero_optimization": zo}, 1).zero
    assert (c.persistence_threshold, c.model_persistence_threshold) == (1000, 5000)
    with pytest.raises(ValueError, match="zero_optimization.stage3_param_persistence_threshold"):
        zeropp.Config.from_deepspeed({"zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": -5}})
