"""Check (notebook 03b): DDP over N ranks trains exactly like one process on the global batch.

Writes equivalence.json into the run directory (check() does the work; notebook 03b runs it
with ddp_checks.py and find_unused.py in one launch, checks_03b.py):
- different seeds per rank -> different weights before DDP(...), equal after it;
- the course's step timer changes no number: the same steps with and without
  metrics.StepTimer give equal weights and BatchNorm buffers, bit for bit (torch.equal), and
  the timed model has no comm hook (DDP takes one; the timer leaves it free);
- weights allclose to the single-process reference after EVERY step (model without BN);
- step 1: a few gradient values each rank computed on its own shard, and DDP's after backward;
- DistributedSampler: without set_epoch every epoch repeats its shuffle, with it they differ.
"""
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from ddp_lesson.rank import data, metrics, models

STEPS, PER_RANK = 8, 8


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_on_all_ranks(t):
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return all(torch.equal(gathered[0], g) for g in gathered)


def train_steps(images, labels, timed, steps=3):
    """A few DDP steps of SmallCNN (with BatchNorm, so DDP broadcasts its buffers each forward)
    on this rank's share; with the course's StepTimer watching when `timed`."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(models.SmallCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    timer = metrics.StepTimer(model, opt) if timed else None
    for step in range(steps):
        mine = slice((step * dist.get_world_size() + rank) * PER_RANK, (step * dist.get_world_size() + rank + 1) * PER_RANK)
        opt.zero_grad()
        F.cross_entropy(model(images[mine]), labels[mine]).backward()
        opt.step()
        if timer:
            timer.lap()
    return model


def check():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1000 + rank)  # each rank starts from different weights
    model = models.SmallCNN(norm=False)  # no BatchNorm: BN statistics are per rank
    equal_before = same_on_all_ranks(flat(model))
    ddp = DDP(model)  # broadcasts rank 0's parameters and buffers
    equal_after = same_on_all_ranks(flat(ddp.module))

    reference = copy.deepcopy(ddp.module)  # one process that sees the whole global batch
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    images, labels = data.shapes(STEPS * PER_RANK * world, seed=7).tensors
    max_diff = []
    local = copy.deepcopy(ddp.module)  # no DDP: its gradient is this rank's own, not all-reduced
    for step in range(STEPS):
        batch = slice(step * PER_RANK * world, (step + 1) * PER_RANK * world)
        x, y = images[batch], labels[batch]
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)  # this rank's share
        opt.zero_grad()
        F.cross_entropy(ddp(x[mine]), y[mine]).backward()
        if step == 0:  # a few gradient values of the last layer: this rank's own, then DDP's
            F.cross_entropy(local(x[mine]), y[mine]).backward()
            own = local.classifier.bias.grad[:3].clone()
            after = ddp.module.classifier.bias.grad[:3].clone()
            grads = {"before": [torch.empty_like(own) for _ in range(world)],
                     "after": [torch.empty_like(after) for _ in range(world)]}
            dist.all_gather(grads["before"], own)
            dist.all_gather(grads["after"], after)
            grads = {k: [t.tolist() for t in v] for k, v in grads.items()}
        opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        # float32 rounding differs ((g0+g1)/2 vs one mean over the batch): ~1e-8 on weights
        # of ~0.1; atol 1e-6 still fails for any real difference (a missed all-reduce: ~1e-2)
        ok = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                 for a, b in zip(ddp.module.parameters(), reference.parameters()))
        max_diff.append({"step": step + 1, "allclose": ok,
                         "max_abs_diff": (flat(ddp.module) - flat(reference)).abs().max().item()})

    plain = train_steps(images, labels, timed=False)
    timed = train_steps(images, labels, timed=True)
    same = torch.tensor([float(all(torch.equal(a, b) for a, b in
                                   zip(plain.state_dict().values(), timed.state_dict().values())))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)  # equal on every rank

    dataset = list(range(16))
    shuffles = {}
    for use_set_epoch in (False, True):
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
        epochs = []
        for epoch in range(3):
            if use_set_epoch:
                sampler.set_epoch(epoch)
            epochs.append(list(sampler))
        shuffles["with_set_epoch" if use_set_epoch else "without_set_epoch"] = epochs
    shards = [None] * world
    dist.all_gather_object(shards, shuffles["with_set_epoch"][0])

    if rank == 0:
        verdict = {
            "world_size": world,
            "weights_equal_before_ddp": equal_before,
            "weights_equal_after_ddp": equal_after,
            # the same steps with and without the step timer: weights and buffers bit for bit
            "timer_changes_nothing": bool(same.item()),
            # the timed model's comm hook, as DDP's log names it (a private, prototype API)
            "timed_comm_hook": timed._get_ddp_logging_data().get("comm_hook"),
            "steps": max_diff,
            "allclose_every_step": all(s["allclose"] for s in max_diff),
            "rank0_shuffles": shuffles,
            "first_step_grads": grads,  # classifier.bias.grad[:3] per rank, own and after DDP
            "epochs_repeat_without_set_epoch": len({tuple(e) for e in shuffles["without_set_epoch"]}) == 1,
            "epochs_differ_with_set_epoch": len({tuple(e) for e in shuffles["with_set_epoch"]}) == 3,
            # every sample on some rank; two ranks share a sample only where it was padded in
            "padding": sampler.total_size - len(dataset),
            "shards_disjoint": set().union(*map(set, shards)) == set(dataset)
                               and sum(len(set(a) & set(b)) for i, a in enumerate(shards)
                                       for b in shards[i + 1:]) == sampler.total_size - len(dataset),
        }
        metrics.save_json("equivalence.json", verdict)


def main():
    dist.init_process_group("gloo")  # a check of the arithmetic: CPU is enough
    check()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
