"""Tokenizers of the main job: bytes always, BPE trained once per corpus and cached."""

from __future__ import annotations

import pytest
import torch

from zeropp.train.tokenizer import TokenizerError, encode

TEXT = "To be, or not to be, that is the question:\n" * 50


def test_bytes_are_the_utf8_bytes():
    ids, vocab = encode("héllo", "bytes", None)
    assert vocab == 256 and ids.tolist() == list("héllo".encode())


def test_bpe_is_trained_once_per_corpus_and_cached(tmp_path):
    pytest.importorskip("tokenizers")
    ids, vocab = encode(TEXT, "bpe", tmp_path)
    cached = list(tmp_path.glob("*/bpe-vocab.json"))
    assert len(cached) == 1 and 256 < vocab <= 4096
    assert len(ids) < len(TEXT.encode()) / 3  # merges compress the repeated line
    again, vocab2 = encode(TEXT, "bpe", tmp_path)
    assert torch.equal(ids, again) and vocab2 == vocab
    encode(TEXT + "Whether 'tis nobler", "bpe", tmp_path)
    assert len(list(tmp_path.glob("*/bpe-vocab.json"))) == 2  # another corpus, another cache


def test_unknown_tokenizer_is_rejected():
    with pytest.raises(TokenizerError, match="unknown tokenizer 'words'"):
        encode(TEXT, "words", None)
