"""The trainer library with DistributedDataParallel, one rank per process (gloo on CPU;
use "nccl" and move the model and batches to the rank's GPU on GPUs):

    torchrun --standalone --nproc-per-node 2 examples/trainer_ddp.py
"""

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainguard.trainer import ResumableSampler, Trainguard

logging.basicConfig(level=logging.INFO)  # shows the library's INFO lines ("trainguard.trainer")
dist.init_process_group("gloo")  # before Trainguard: it joins the process group
torch.manual_seed(0)  # the same data on every rank (each reads its own share)
ds = TensorDataset(torch.randn(1024, 16), torch.randint(0, 4, (1024,)))
net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
model = DistributedDataParallel(net)  # Trainguard saves the inner module's state
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
total_steps = 100

# num_replicas and rank come from the process group.
sampler = ResumableSampler(DistributedSampler(ds, shuffle=True, seed=0), batch_size=32)
loader = DataLoader(
    ds, batch_size=32, sampler=sampler, drop_last=True, generator=torch.Generator().manual_seed(0)
)
tg = Trainguard(
    model=model,
    optimizer=opt,
    scheduler=sched,
    sampler=sampler,
    ckpt_dir="ckpt/ddp",
    checkpoint_every=50,
    keep_last=3,
)
step = tg.resume(first_step=1)
batches = sampler.batches(loader)
while step <= total_steps:
    x, y = next(batches)
    with tg.compute():  # forward and loss only: DDP's backward
        loss = F.cross_entropy(model(x), y)  # holds the gradient all-reduce
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    action = tg.step(step, loss=loss, samples=len(x))  # samples: this rank's, this step
    if action.stop:
        break
    if action.rollback:
        step = action.next_step
        batches = sampler.batches(loader)
        continue
    step += 1
tg.close()
dist.destroy_process_group()
