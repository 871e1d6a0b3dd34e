"""The trainer library in one process: the loop README.md shows (tests keep them equal).

python examples/trainer_single.py   # run it again: it resumes from ckpt/single
"""

import logging

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainguard.trainer import ResumableSampler, Trainguard

logging.basicConfig(level=logging.INFO)  # shows the library's INFO lines ("trainguard.trainer")
torch.manual_seed(0)
ds = TensorDataset(torch.randn(1024, 16), torch.randint(0, 4, (1024,)))
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
total_steps = 200

# One process, no process group: tell DistributedSampler it is the only replica.
inner = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
sampler = ResumableSampler(inner, batch_size=32)
loader = DataLoader(
    ds, batch_size=32, sampler=sampler, drop_last=True, generator=torch.Generator().manual_seed(0)
)
tg = Trainguard(
    model=model,
    optimizer=opt,
    scheduler=sched,
    sampler=sampler,
    ckpt_dir="ckpt/single",
    checkpoint_every=50,
    keep_last=3,
)
step = tg.resume(first_step=1)  # newest verified checkpoint + 1, or first_step
batches = sampler.batches(loader)  # endless, resumes mid-epoch
while step <= total_steps:
    with tg.compute():  # this rank's own work: the straggler signal
        x, y = next(batches)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
    opt.step()
    sched.step()
    action = tg.step(step, loss=loss, samples=len(x))  # samples: this rank's, this step
    if action.stop:  # stop request, SIGTERM, NaN policy "stop"
        break
    if action.rollback:  # NaN policy "rollback": state restored
        step = action.next_step
        batches = sampler.batches(loader)  # the data position moved
        continue
    step += 1
tg.close()
