"""A plain `accelerate` training loop on zeropp, with a DeepSpeedPlugin (ZeRO-3
and the ZeRO++ keys): the same tiny GPT-2 and counting task as trainer_lm.py.
The one added line is `zeropp.install_as_deepspeed()`, before accelerate.

    torchrun --nproc-per-node 2 examples/hf/accelerate_lm.py --out runs/hf_accelerate
"""

import zeropp

zeropp.install_as_deepspeed()  # the one added line: accelerate's DeepSpeed path runs on zeropp

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
from accelerate import Accelerator, DeepSpeedPlugin, PartialState  # noqa: E402
from tiny import Counting, tiny_gpt2, with_node_size, write_probe  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                          "zero_hpz_partition_size": 2, "zero_quantized_gradients": True},
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/hf_accelerate")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--resume", action="store_true", help="load --out/state, train the rest")
    p.add_argument("--node-size", type=int, default=None, help="zeropp: ranks per node")
    a = p.parse_args()
    ds = with_node_size(DS_CONFIG, a.node_size)
    # Without a GPU, accelerate's DeepSpeed path would see one process per rank (every
    # rank its own "main process", the data unsharded): set up the CPU process group
    # first, as Trainer does for use_cpu.
    PartialState(cpu=not torch.cuda.is_available())
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds))
    torch.manual_seed(0)
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(Counting(256, 16, 64), batch_size=4, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    start = 0
    if a.resume:
        acc.load_state(os.path.join(a.out, "state"))
        start = a.steps // 2
    losses, batches = [], iter(loader)
    for _ in range(start):
        next(batches)  # the batches the first half saw
    model.train()
    for step in range(start, a.steps):
        batch = next(batches)
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step + 1 == a.steps // 2 and not a.resume:
            acc.save_state(os.path.join(a.out, "state"))
    acc.wait_for_everyone()
    acc.unwrap_model(model).save_pretrained(
        os.path.join(a.out, "final"), is_main_process=acc.is_main_process,
        save_function=acc.save, state_dict=acc.get_state_dict(model))
    write_probe(model, os.path.join(a.out, "final", "probe.json"), acc.is_main_process)
    if acc.is_main_process:
        print("losses", json.dumps(losses), flush=True)


if __name__ == "__main__":
    main()
