"""A small transformer language model trained the DeepSpeed way, on synthetic
sequences (each counts up from a random start with a random stride, modulo the
vocabulary: the model must infer the stride). AdamW with no weight decay on
biases and norms (two param groups), a warmup-decay schedule, bf16 and the
ZeRO++ keys in ds_config_lm.json. The only line that differs from a DeepSpeed
script is the import.

    torchrun --nproc-per-node 4 examples/deepspeed/transformer_lm.py \
        --deepspeed --deepspeed_config examples/deepspeed/ds_config_lm.json
    zeropp launch --nproc 4 --node-size 2 examples/deepspeed/transformer_lm.py \
        --deepspeed_config examples/deepspeed/ds_config_lm.json
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import zeropp as deepspeed  # was: import deepspeed

VOCAB, SEQ = 64, 32


def get_args():
    parser = argparse.ArgumentParser(description="transformer LM")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save_dir", type=str, default=None)
    parser.add_argument("--save_every", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--export", type=str, default=None, help="save_16bit_model here at the end")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class CountingData(torch.utils.data.Dataset):
    def __init__(self, n=8192, seed=0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB

    def __len__(self):
        return len(self.seq)

    def __getitem__(self, i):
        return self.seq[i, :-1], self.seq[i, 1:]


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, d=64, layers=2, heads=4):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def main():
    args = get_args()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = TinyLM()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=groups, training_data=CountingData())
    start = 0
    if args.resume:
        _, client_state = engine.load_checkpoint(args.save_dir)
        start = client_state["micro_step"]
    gas, micro, total = engine.gradient_accumulation_steps(), 0, args.steps * engine.gradient_accumulation_steps()
    while micro < total:
        for x, y in loader:
            if micro < start:
                micro += 1
                continue
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            micro += 1
            if micro % gas == 0 and engine.global_rank == 0:
                print(f"step {engine.global_steps} loss {loss.item():.6f} "
                      f"lr {engine.get_lr()[0]:.6f} grad_norm {engine.get_global_grad_norm():.4f}",
                      flush=True)
            if args.save_dir and args.save_every and micro % (args.save_every * gas) == 0:
                engine.save_checkpoint(args.save_dir, client_state={"micro_step": micro})
            if micro >= total:
                break
    if args.export:
        engine.save_16bit_model(args.export)


if __name__ == "__main__":
    main()
