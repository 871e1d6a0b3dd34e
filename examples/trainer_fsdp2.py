"""The trainer library with FSDP2 (`fully_shard`), one rank per process, on a CPU device mesh
with gloo (on GPUs: "nccl", `init_device_mesh("cuda", ...)`, batches on the rank's GPU):

    torchrun --standalone --nproc-per-node 2 examples/trainer_fsdp2.py
"""

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainguard.trainer import ResumableSampler, Trainguard

logging.basicConfig(level=logging.INFO)  # shows the library's INFO lines ("trainguard.trainer")
dist.init_process_group("gloo")  # before Trainguard: it joins the process group
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)  # the same data and initial weights on every rank
ds = TensorDataset(torch.randn(1024, 16), torch.randint(0, 4, (1024,)))
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)  # parameters are DTensors now: each rank holds its shard
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after fully_shard: over the shards
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))  # warm-up
total_steps = 100

# num_replicas and rank come from the process group.
sampler = ResumableSampler(DistributedSampler(ds, shuffle=True, seed=0), batch_size=32)
loader = DataLoader(
    ds, batch_size=32, sampler=sampler, drop_last=True, generator=torch.Generator().manual_seed(0)
)
tg = Trainguard(
    model=model,  # the sharded model: each rank saves its shards (DCP), a resume reshards
    optimizer=opt,
    scheduler=sched,
    sampler=sampler,
    ckpt_dir="ckpt/fsdp2",
    checkpoint_every=50,
    keep_last=3,
)
step = tg.resume(first_step=1)
batches = sampler.batches(loader)
while step <= total_steps:
    x, y = next(batches)
    loss = F.cross_entropy(model(x), y)  # forward and backward hold FSDP's collectives
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the norm over all shards
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
