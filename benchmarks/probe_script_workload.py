"""The training the script-probe benchmark runs: a DDP MLP on per-rank synthetic data, with a
DistributedSampler and a DataLoader, so every hook of the probe is exercised on every step.

`--steps N` makes it stop by itself after N optimizer steps (the plain torchrun run); under the
probe, `distdoctor probe ... --steps N` stops it at the same point.
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--width", type=int, default=256)
args = parser.parse_args()

dist.init_process_group("gloo")
torch.manual_seed(0)
dataset = TensorDataset(torch.randn(4096, 64), torch.randn(4096, 1))
sampler = DistributedSampler(dataset)
loader = DataLoader(dataset, batch_size=32, sampler=sampler)
model = DDP(nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                          nn.Linear(args.width, 1)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
step, epoch, began = 0, 0, time.perf_counter()
while step < args.steps:
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        step += 1
        if step == args.steps:
            break
    epoch += 1
if dist.get_rank() == 0:
    print(f"{args.steps} steps in {time.perf_counter() - began:.2f} s")
dist.destroy_process_group()
