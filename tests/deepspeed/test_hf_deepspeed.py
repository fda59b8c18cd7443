"""Hugging Face on zeropp through `zeropp.install_as_deepspeed()`: the Trainer and plain
accelerate examples in examples/hf/ (TRL's two: test_hf_trl.py), each at one of W=2
(straight run under torchrun) and W=4 as 2x2 nodes (straight run under `zeropp
launch`), the two split across the four examples; resumed under `zeropp launch`,
with the ZeRO++ keys on:
the loss falls (GRPO: the reward rises), the saved model reloads with
`from_pretrained` (weights equal to the last checkpoint's, bit for bit, and its
logits those of the trained sharded model up to qwZ's INT8 rounding), and a run
resumed from the middle checkpoint continues exactly as the straight run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_examples import STEPS, _global_step, _reloads, _series, _straight, _zeropp_launch


@pytest.mark.parametrize("world", [4])
def test_trainer_trains_saves_reloads_and_resumes_exactly(tmp_path, world):
    out = tmp_path / "run"
    full = _series(_straight("trainer_lm.py", world, out, "--steps", str(STEPS)), "losses")
    assert len(full) == STEPS and sum(full[-2:]) < 0.9 * sum(full[:2]), full  # the loss falls
    _reloads(out / "final", _global_step(out / f"checkpoint-{STEPS}"))
    shutil.rmtree(out / f"checkpoint-{STEPS}")
    resumed = _series(_zeropp_launch("trainer_lm.py", world, out, "--steps", str(STEPS),
                                     "--resume"), "losses")
    assert resumed == full  # steps 1-4 from the restored log, 5-8 recomputed: same bits


def test_trainer_plain_zero3_with_torch_compile_trains_through_engine_compile_and_saves_the_trained_outputs(
        tmp_path):
    """A plain ZeRO-3 config (no zeropp block) and `TrainingArguments(torch_compile=True)`
    with `torch_compile_backend="aot_eager"`: dynamo and AOT autograd over zeropp's units
    as with inductor, without inductor's C++ build (inductor under zeropp:
    tests/engine/test_compile.py). The Trainer compiles through `engine.compile()` on
    both ranks, the loss falls, and the saved model's outputs are the trained ones
    exactly (no qwZ)."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}))
    out = tmp_path / "run"
    printed = _zeropp_launch("trainer_lm.py", 2, out, "--steps", "4", "--ds-config", str(cfg),
                             "--torch-compile", "aot_eager")
    assert printed.count("compiled True") == 2, printed[-2000:]
    losses = _series(printed, "losses")
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    _reloads(out / "final", _global_step(out / "checkpoint-4"), tol=0.0)


@pytest.mark.parametrize("world", [2])
def test_accelerate_loop_trains_saves_reloads_and_resumes_exactly(tmp_path, world):
    out = tmp_path / "run"
    full = _series(_straight("accelerate_lm.py", world, out, "--steps", str(STEPS)), "losses")
    assert len(full) == STEPS and sum(full[-2:]) < 0.9 * sum(full[:2]), full
    # accelerate's save_state at the middle: a zeropp checkpoint under DeepSpeed's tag.
    assert (out / "state" / "pytorch_model" / "manifest.json").is_file()
    rest = _series(_zeropp_launch("accelerate_lm.py", world, out, "--steps", str(STEPS),
                                  "--resume"), "losses")
    assert rest == full[STEPS // 2:]
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "final").eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])).logits.reshape(-1)
    probe = torch.tensor(json.loads((out / "final" / "probe.json").read_text()))
    assert (logits - probe).abs().max() <= 0.1 * probe.abs().max()
