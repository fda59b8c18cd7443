"""Tokenizers for the main job: raw bytes (vocabulary 256, always available) or
a byte-level BPE (vocabulary 4096) trained on the corpus with `tokenizers`
(the `text` extra) and cached next to the run."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch


class TokenizerError(ValueError):
    pass


def encode(text: str, kind: str, cache_dir: Path) -> tuple[torch.Tensor, int]:
    """Token ids of `text` and the vocabulary size."""
    if kind == "bytes":
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long(), 256
    if kind != "bpe":
        raise TokenizerError(f"unknown tokenizer {kind!r}; choose bytes or bpe")
    try:
        from tokenizers import ByteLevelBPETokenizer
    except ImportError:
        raise TokenizerError("--tokenizer bpe needs the `tokenizers` package "
                             "(pip install 'zeropp[text]')") from None
    cache_dir = cache_dir / hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]  # per corpus
    cache_dir.mkdir(parents=True, exist_ok=True)
    vocab, merges = cache_dir / "bpe-vocab.json", cache_dir / "bpe-merges.txt"
    if vocab.exists() and merges.exists():
        tok = ByteLevelBPETokenizer(str(vocab), str(merges))
    else:
        tok = ByteLevelBPETokenizer()
        tok.train_from_iterator([text], vocab_size=4096, min_frequency=2, show_progress=False)
        tok.save_model(str(cache_dir), "bpe")
    return torch.tensor(tok.encode(text).ids, dtype=torch.long), tok.get_vocab_size()
