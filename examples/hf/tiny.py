"""What the Hugging Face examples share, built offline (no hub): a tiny GPT-2 and
a counting task (Trainer, accelerate), a word-level tokenizer with a chat
template, a tiny Llama-style chat model and a small chat set of sums (TRL), and
the probe the tests use to check that a saved model reloads with equal outputs."""

from __future__ import annotations

import json
import random

import torch
from torch.utils.data import Dataset


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2,
                                      n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


class Counting(Dataset):
    """Sequences that count up from a random start (mod vocab): learnable in a few
    steps, deterministic."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        start = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(0))
        self.x = (start + torch.arange(seq)) % vocab

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def with_node_size(ds: dict, node_size) -> dict:
    """zeropp's own config section: ranks per node (2x2 emulated on one machine)."""
    if not node_size:
        return ds
    return {**ds, "zeropp": {**ds.get("zeropp", {}), "node_size": node_size}}


PROBE = [[1, 2, 3, 4, 5, 6, 7, 8]]


def finish(trainer, out: str, series: str) -> None:
    """After `trainer.train()`: save the model (`out/final`), write the probe the
    tests check the reload against, and print the logged `series` ("loss" or
    "reward") as `losses [...]` / `rewards [...]`."""
    trainer.save_model(out + "/final")
    write_probe(trainer.model, out + "/final/probe.json", trainer.is_world_process_zero())
    if trainer.is_world_process_zero():
        values = [h[series] for h in trainer.state.log_history if series in h]
        print(series + ("es" if series.endswith("s") else "s"), json.dumps(values), flush=True)


@torch.no_grad()
def write_probe(model, path: str, is_main: bool) -> None:
    """The trained model's logits on PROBE, written by rank 0 (every rank runs the
    forward: the model is sharded)."""
    was = model.training
    model.eval()
    logits = model(input_ids=torch.tensor(PROBE)).logits.float()
    model.train(was)
    if is_main:
        with open(path, "w") as f:
            json.dump(logits.reshape(-1).tolist(), f)

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
