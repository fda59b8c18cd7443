"""TRL on zeropp through `zeropp.install_as_deepspeed()`: the SFT and GRPO examples in
examples/hf/, SFT at W=2 and GRPO at W=4 as 2x2, under `zeropp launch` (torchrun's launch
giving its bits: test_hf_deepspeed.py, test_deepspeed_api.py), with the ZeRO++ keys on: the
loss falls (GRPO: the reward rises), the saved model reloads with `from_pretrained`, and a
run resumed from the middle checkpoint continues exactly as the straight run."""

from __future__ import annotations

import shutil

import pytest
from hf_examples import STEPS, _global_step, _reloads, _series, _straight, _zeropp_launch


@pytest.mark.parametrize("world", [2])
def test_trl_sft_trains_saves_reloads_and_resumes_exactly(tmp_path, world):
    out = tmp_path / "run"
    full = _series(_zeropp_launch("trl_sft.py", world, out, "--steps", str(STEPS)), "losses")
    assert len(full) == STEPS and sum(full[-2:]) < 0.8 * sum(full[:2]), full
    _reloads(out / "final", _global_step(out / f"checkpoint-{STEPS}"))
    shutil.rmtree(out / f"checkpoint-{STEPS}")
    resumed = _series(_zeropp_launch("trl_sft.py", world, out, "--steps", str(STEPS),
                                     "--resume"), "losses")
    assert resumed == full


# GRPO after 20 SFT steps (the example's default 40): the rewards of 6 steps measured
# [0.375, 0.53, 0.56 | 0.59, 0.66, 0.88], the second half 1.45x the first (after 40: 1.86x)
GRPO_STEPS, SFT_STEPS = 6, 20


@pytest.mark.parametrize("world", [4])
def test_trl_grpo_reward_rises_saves_reloads_and_resumes_exactly(tmp_path, world):
    out, steps = tmp_path / "run", ("--steps", str(GRPO_STEPS))
    full = _series(_straight("trl_grpo.py", world, out, *steps, "--sft-steps", str(SFT_STEPS)),
                   "rewards")
    half = GRPO_STEPS // 2
    assert len(full) == GRPO_STEPS and sum(full[half:]) > sum(full[:half]), full  # it rises
    _reloads(out / "final", _global_step(out / f"checkpoint-{GRPO_STEPS}"))
    shutil.rmtree(out / f"checkpoint-{GRPO_STEPS}")
    resumed = _series(_zeropp_launch("trl_grpo.py", world, out, *steps, "--resume"), "rewards")
    assert resumed == full  # generation included: the restored RNG states sample the same
