"""What the Hugging Face examples share, built offline (no hub): a word-level
tokenizer with a chat template, a tiny Llama-style chat model, and a small chat
set of arithmetic questions whose answers a few steps can learn."""

from __future__ import annotations

import random

WORDS = [str(i) for i in range(20)] + ["what", "is", "plus", "?", "the", "answer"]
SPECIAL = ["<pad>", "<s>", "</s>", "<user>", "<assistant>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<' + m['role'] + '> ' + m['content'] + ' </s> ' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<assistant> ' }}{% endif %}")


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>", unk_token="<pad>")
    out.chat_template = CHAT_TEMPLATE
    return out


def chat_model(tok):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id))


def sums(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randrange(10), rng.randrange(10)) for _ in range(n)]


def chats(n: int):
    """{"messages": [...]} rows: "what is a plus b ?" -> "the answer is a+b"."""
    from datasets import Dataset
    return Dataset.from_list([{"messages": [
        {"role": "user", "content": f"what is {a} plus {b} ?"},
        {"role": "assistant", "content": f"the answer is {a + b}"}]} for a, b in sums(n)])


def prompts(n: int):
    """{"prompt": [...], "target": int} rows for GRPO."""
    from datasets import Dataset
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"what is {a} plus {b} ?"}],
                               "target": a + b} for a, b in sums(n, seed=1)])
