"""The engine's checkpoints under DeepSpeed's names: `save_checkpoint` /
`load_checkpoint` (zeropp's sharded, pickle-free format in `save_dir/<tag>/`, with
DeepSpeed's `latest` file and per-rank client state), `save_16bit_model` and the
consolidated 16-bit state dict."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from ..checkpoint import full_state_dict, load_checkpoint, save_checkpoint
from ..checkpoint_files import CheckpointError
from ..guards import agree, all_gather_bytes
from ..shard import get_state
from .errors import EngineAssertionError


class EngineCheckpoints:
    """Mixed into DeepSpeedEngine (engine.py)."""

    # ---- checkpoints --------------------------------------------------------------------
    def save_checkpoint(self, save_dir: os.PathLike, tag: Any = None,
                        client_state: Optional[dict] = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Save to `save_dir/<tag>` (tag: "global_step<N>" by default), every rank
        its shards; rank 0 writes `save_dir/latest` = tag. `client_state`: JSON
        values, tensors, Generators, objects with state_dict(); each rank's own,
        as DeepSpeed ZeRO-3 keeps it, returned to that rank by load_checkpoint."""
        if not save_dir:
            raise ValueError("zeropp engine.save_checkpoint: save_dir is empty")
        tag = self._agreed_tag(str(tag if tag is not None else f"global_step{self.global_steps}"))
        client_state = dict(client_state or {})
        extras: dict[str, Any] = {
            "ds_engine": {"global_steps": self.global_steps, "global_samples": self.global_samples,
                          "skipped_steps": self.skipped_steps, "micro_steps": self.micro_steps,
                          "loss_scaler": (self.loss_scaler.state_dict()
                                          if self.loss_scaler is not None else None)},
            "ds_client_keys": list(client_state)}
        extras.update({f"client:{k}": v for k, v in client_state.items()})
        if self.lr_scheduler is not None:
            extras["ds_lr_scheduler"] = self.lr_scheduler
        save_checkpoint(Path(save_dir) / tag, self.module, self.optimizer, **extras)
        if save_latest:
            err = None
            if self.global_rank == 0:
                try:
                    tmp = Path(save_dir) / ".latest.partial"
                    tmp.write_text(tag)  # as DeepSpeed writes it: the tag, no newline
                    os.replace(tmp, Path(save_dir) / "latest")
                except OSError as e:
                    err = f"writing {Path(save_dir) / 'latest'}: {e}"
            agree(err, CheckpointError, "checkpoint")  # every rank raises it, none waits forever
        return True

    def _agreed_tag(self, tag: str) -> str:
        """Collective: the tag every rank saves under. Ranks passing different tags is
        `checkpoint.tag_validation`'s case: Fail raises on every rank, Warn warns, and
        both Warn and Ignore save under rank 0's tag (a checkpoint is one directory)."""
        tags = [t.decode() for t in all_gather_bytes(tag.encode(), "checkpoint")]
        if len(set(tags)) == 1:
            return tag
        msg = ("zeropp engine.save_checkpoint: the ranks pass different tags ("
               + ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags)) + ")")
        if self._config.tag_validation == "fail":
            raise EngineAssertionError(msg + "; checkpoint.tag_validation is Fail")
        if self._config.tag_validation == "warn":
            warnings.warn(msg + f"; saving under rank 0's, {tags[0]!r}", stacklevel=3)
        return tags[0]

    def load_checkpoint(self, load_dir: os.PathLike, tag: Any = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Any = None) -> tuple[Optional[str], Optional[dict]]:
        """Load `load_dir/<tag>` (tag: the `latest` file's); returns (path,
        client_state), or (None, None) with a warning when there is no `latest`."""
        if custom_load_fn is not None:
            raise ValueError("zeropp engine.load_checkpoint: custom_load_fn is not supported")
        if tag is None:
            latest = Path(load_dir) / "latest"
            if not latest.is_file():
                warnings.warn(f"zeropp engine.load_checkpoint: no 'latest' file in {load_dir}; "
                              "nothing loaded", stacklevel=2)
                return None, None
            tag = latest.read_text().strip()
        path = Path(load_dir) / str(tag)
        full = not load_module_only
        restore = {}
        if self.lr_scheduler is not None and load_lr_scheduler_states and full:
            restore["ds_lr_scheduler"] = self.lr_scheduler
        opt = self.optimizer if load_optimizer_states and full else None
        extra = load_checkpoint(path, self.module, opt, **restore)
        if full:
            e = extra.get("ds_engine", {})
            self.global_steps = e.get("global_steps", 0)
            self.global_samples = e.get("global_samples",
                                        self.global_steps * self._config.train_batch_size)
            self.skipped_steps = e.get("skipped_steps", 0)  # micro_steps restart at 0, as DeepSpeed
            if self.loss_scaler is not None and e.get("loss_scaler"):
                self.loss_scaler.load_state_dict(e["loss_scaler"])
        # At another world size per-rank tensors and Generators do not map (rank 0
        # warned); the rest is rank 0's.
        return str(path), {k: extra[f"client:{k}"] for k in extra.get("ds_client_keys", [])
                           if f"client:{k}" in extra}

    def save_16bit_model(self, save_dir: os.PathLike, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The consolidated weights in the compute dtype (bf16 / fp16 when enabled,
        else fp32) under the original names, written by rank 0: `torch.save` of a
        flat state dict (as DeepSpeed), or safetensors for a `.safetensors` name.
        Collective."""
        sd = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        err = None
        if self.global_rank == 0:
            try:
                self._write_16bit(sd, save_dir, save_filename)
            except (OSError, RuntimeError) as e:
                err = f"save_16bit_model to {save_dir}: {e}"
        agree(err, CheckpointError, "checkpoint")
        return True

    def _write_16bit(self, sd: dict, save_dir: os.PathLike, save_filename: str) -> None:
        os.makedirs(save_dir, exist_ok=True)
        path = Path(save_dir) / save_filename
        if save_filename.endswith(".safetensors"):
            from safetensors.torch import save_file

            from .zero_to_fp32 import unshared  # (here: `python -m` runs it, unloaded)
            save_file(unshared(sd), str(path))
        else:
            torch.save(sd, path)

    def _to_16bit(self, sd: dict, exclude_frozen_parameters: bool) -> dict:
        """`sd` in the compute dtype (bf16 / fp16 when enabled), frozen parameters
        left out when asked."""
        dtype = (torch.bfloat16 if self._config.bf16 else
                 torch.float16 if self._config.fp16 is not None else None)
        frozen = set()
        if exclude_frozen_parameters:
            frozen = {n for f in get_state(self.module).flats if not f.trainable
                      for i in f.infos for n in i.fqns}
        return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
                for k, v in sd.items() if k not in frozen}

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> Optional[dict]:
        """The consolidated state dict in the compute dtype under the original names
        on rank 0, None elsewhere (what DeepSpeed returns; Trainer and accelerate
        save it). Collective."""
        sd = full_state_dict(self.module)
        if self.global_rank != 0:
            return None
        sd = self._to_16bit(sd, exclude_frozen_parameters)
        # Tied names share one tensor, as in DeepSpeed's: transformers' and accelerate's
        # savers then write it once (apart, a tied lm_head.weight went to disk twice).
        for i in (i for f in get_state(self.module).flats for i in f.infos):
            sd.update({n: sd[i.fqns[0]] for n in i.fqns[1:] if n in sd})
        return sd

    save_fp16_model = save_16bit_model
