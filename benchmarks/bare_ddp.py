"""A bare 20-step DDP job on CPU (gloo): the yardstick for the built-in probe's wall time.

Run it as `python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bare_ddp.py`.
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(20):
    inputs, targets = torch.randn(4, 8), torch.randn(4, 1)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()
dist.barrier()  # as careful scripts do: no rank tears gloo down while another still talks
dist.destroy_process_group()
