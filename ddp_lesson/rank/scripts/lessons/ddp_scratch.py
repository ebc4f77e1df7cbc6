"""Lesson 09: DDP built from scratch in four stages, each checked against torch's DDP.

    torchrun --standalone --nproc-per-node 2 ddp_scratch.py --stages a,b,c --steps 4
    torchrun ... ddp_scratch.py --stages d --bucketed bucketed_exercise.py   # your stage (d)

(a) broadcast the parameters once, then one all_reduce per parameter after backward;
(b) one all_reduce of all gradients flattened into one tensor;
(c) overlapped: each gradient's all_reduce starts (async) the moment backward has
    accumulated it, from register_post_accumulate_grad_hook; all are waited before step();
(d) bucketed: a class Bucketed from the file --bucketed (the exercise of section 7).
Each stage trains beside torch's DDP from the same (rank-dependent!) initial weights on the
same data: the weights must be allclose after every step. The harness,
ddp_lesson/rank/scratch_check.py, counts all_reduce calls per step with their sizes (and whether each was made during backward, how many gradients
backward had finished by then, and whether backward waited for it: async_op=False, or a
wait() during backward); DDP's buckets
are recorded by a comm hook (which parameters each held). Step times are measured in the
same run. Rank 0 writes scratch.json to the run dir.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_lesson.rank import data, metrics, models, scratch_check   # scratch_check: counting, comparing, timing
from ddp_lesson.rank.scratch_check import load_bucketed            # stage (d): class Bucketed from your file


def broadcast_parameters(model):
    """Every rank starts from rank 0's weights (DDP does this in its constructor)."""
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=0)


class PerParameter:                                                    # stage (a)
    def __init__(self, model):
        broadcast_parameters(model)
        self.params = [p for p in model.parameters() if p.requires_grad]

    def finish(self):                      # after backward, before optimizer.step()
        for p in self.params:
            dist.all_reduce(p.grad)        # sum over ranks ...
            p.grad /= dist.get_world_size()  # ... then the mean, as DDP does


class Flattened:                                                       # stage (b)
    def __init__(self, model):
        broadcast_parameters(model)
        self.params = [p for p in model.parameters() if p.requires_grad]

    def finish(self):
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])   # one message
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for p, g in zip(self.params, flat.split([p.numel() for p in self.params])):
            p.grad.copy_(g.view_as(p))


class Overlapped:                                                      # stage (c)
    def __init__(self, model):
        broadcast_parameters(model)
        self.pending = []
        for p in model.parameters():
            if p.requires_grad:            # runs once p.grad holds this backward's gradient
                p.register_post_accumulate_grad_hook(self.launch)

    def launch(self, p):                   # called by autograd, in the middle of backward
        self.pending.append((p, dist.all_reduce(p.grad, async_op=True)))

    def finish(self):
        for p, work in self.pending:
            work.wait()
            p.grad /= dist.get_world_size()
        self.pending = []


def make(stage, model, bucket_bytes, impl):
    if stage == "a":
        return PerParameter(model)
    if stage == "b":
        return Flattened(model)
    if stage == "c":
        return Overlapped(model)
    if impl is None:
        raise SystemExit("stage (d) is the exercise: pass --bucketed FILE (a file with a class Bucketed)")
    return impl(model, bucket_bytes)


def train_step(model, opt, x, y, ours=None):
    F.cross_entropy(model(x), y).backward()
    if ours is not None:
        ours.finish()                      # torch DDP has already averaged during backward
    opt.step()
    opt.zero_grad(set_to_none=False)


def check_stage(stage, base, batches, bucket_bytes, impl=None):
    """Stage `stage` beside torch's DDP, step by step (the counting: ddp_lesson/rank/scratch_check.py)."""
    build = lambda model: make(stage, model, bucket_bytes, impl)
    return scratch_check.check_stage(stage, build, train_step, base, batches, bucket_bytes)


def time_stage(stage, base, batches, bucket_bytes, impl=None):
    """ms per step, the stage and torch DDP side by side."""
    build = lambda model: make(stage, model, bucket_bytes, impl)
    return scratch_check.time_stage(build, train_step, base, batches, bucket_bytes)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stages", default="a,b,c")
    p.add_argument("--steps", type=int, default=4, help="steps checked against torch DDP")
    p.add_argument("--time-steps", type=int, default=4, help="steps per timing round; 0: no timing")
    p.add_argument("--bucket-kb", type=float, default=16)
    p.add_argument("--width", type=int, default=16, help="SmallCNN width (more: bigger gradients)")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--bucketed", default=None, help="file with a class Bucketed: stage (d)")
    p.add_argument("--out", default="scratch.json")
    a = p.parse_args()
    if "d" in a.stages.split(",") and not a.bucketed:
        p.error("stage d is the exercise: pass --bucketed FILE, a file with a class Bucketed")
    dist.init_process_group("gloo")       # CPU ranks; the comparison is about arithmetic, not speed
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)                # different initial weights on every rank, on purpose
    base = models.SmallCNN(norm=False, width=a.width)
    x, y = data.shapes(a.batch_size * max(a.steps, a.time_steps), seed=100 + rank).tensors  # this rank's data
    n = max(a.steps, a.time_steps)
    batches = list(zip(x.chunk(n), y.chunk(n)))
    impl = load_bucketed(a.bucketed) if a.bucketed else None
    bucket_bytes = int(a.bucket_kb * 1024)
    out = {"world_size": world, "bucket_bytes": bucket_bytes, "width": a.width,
           "parameters": len(list(base.parameters())),
           "param_bytes": [q.numel() * q.element_size() for q in base.parameters()],
           "gradient_bytes": sum(q.numel() * q.element_size() for q in base.parameters()), "stages": {}}
    for stage in a.stages.split(","):
        v = check_stage(stage, base, batches[:a.steps], bucket_bytes, impl)
        if a.time_steps:
            v["ms_per_step"] = time_stage(stage, base, batches[:a.time_steps], bucket_bytes, impl)
        out["stages"][stage] = v
    if rank == 0:
        metrics.save_json(a.out, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
