"""A CIFAR-10-style CNN trained the DeepSpeed way, on synthetic 32x32 images
(10 classes, each a fixed pattern under noise), in the style of DeepSpeed's
cifar10_deepspeed.py. The only line that differs from a DeepSpeed script is
the import.

    torchrun --nproc-per-node 4 examples/deepspeed/cifar_cnn.py \
        --deepspeed --deepspeed_config examples/deepspeed/ds_config_cnn.json
    zeropp launch --nproc 4 --node-size 2 examples/deepspeed/cifar_cnn.py \
        --deepspeed_config examples/deepspeed/ds_config_cnn.json --save_dir ck
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import zeropp as deepspeed  # was: import deepspeed


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps to train")
    parser.add_argument("--save_dir", type=str, default=None, help="checkpoint directory")
    parser.add_argument("--save_every", type=int, default=0, help="save every N steps")
    parser.add_argument("--resume", action="store_true", help="continue from save_dir/latest")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class SyntheticCIFAR(torch.utils.data.Dataset):
    def __init__(self, n=4096, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(10, 3, 32, 32, generator=g)
        self.labels = torch.randint(0, 10, (n,), generator=g)
        self.noise = torch.randn(n, 3, 32, 32, generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        y = self.labels[i]
        return self.patterns[y] + self.noise[i], y


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def main():
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(1234)
    net = Net()
    trainset = SyntheticCIFAR()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset)
    start = 0
    if args.resume:
        _, client_state = model_engine.load_checkpoint(args.save_dir)
        start = client_state["micro_step"]
    criterion = nn.CrossEntropyLoss()
    micro, total = 0, args.steps * model_engine.gradient_accumulation_steps()
    while micro < total:
        for inputs, labels in trainloader:  # the same order every pass, as in DeepSpeed
            if micro < start:  # resuming: skip what the checkpoint already saw
                micro += 1
                continue
            outputs = model_engine(inputs.to(model_engine.device))
            loss = criterion(outputs, labels.to(model_engine.device))
            model_engine.backward(loss)
            model_engine.step()
            micro += 1
            gas = model_engine.gradient_accumulation_steps()
            if micro % gas == 0 and model_engine.global_rank == 0:  # a step was just taken
                print(f"step {model_engine.global_steps} loss {loss.item():.6f} "
                      f"lr {model_engine.get_lr()[0]:.6f}", flush=True)
            if (args.save_dir and args.save_every
                    and micro % (args.save_every * gas) == 0):
                model_engine.save_checkpoint(args.save_dir,
                                             client_state={"micro_step": micro, "data": "synthetic"})
            if micro >= total:
                break


if __name__ == "__main__":
    main()
