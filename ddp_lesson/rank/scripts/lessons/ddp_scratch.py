"""Lesson 09: DDP built from scratch in four stages, each checked against torch's DDP.

    torchrun --standalone --nproc-per-node 2 ddp_scratch.py --stages a,b,c --steps 4
    torchrun ... ddp_scratch.py --stages d --bucketed bucketed_exercise.py   # your stage (d)

(a) broadcast the parameters once, then one all_reduce per parameter after backward;
(b) one all_reduce of all gradients flattened into one tensor;
(c) overlapped: each gradient's all_reduce starts (async) the moment backward has
    accumulated it, from register_post_accumulate_grad_hook; all are waited before step();
(d) bucketed: a class Bucketed from the file --bucketed (the exercise of section 7).
Each stage trains beside torch's DDP from the same (rank-dependent!) initial weights on the
same data: the weights must be allclose after every step. all_reduce calls per step are
counted with their sizes (and whether each was made during backward, how many gradients
backward had finished by then, and whether backward waited for it: async_op=False, or a
wait() during backward); DDP's buckets
are recorded by a comm hook (which parameters each held). Step times are measured in the
same run. Rank 0 writes scratch.json to the run dir.
"""
import argparse
import copy
import importlib.util
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lesson import data, metrics, models


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


# -- the harness: counting, checking against torch DDP, timing ------------------------
class Counter:
    """Counts all_reduce calls: ours call dist.all_reduce by name (wrapped below); torch's
    DDP calls it from C++, so it is counted by a communication hook (one call per bucket),
    which also notes the parameters (indices in module.parameters()) of every bucket."""
    def __init__(self, process_group=None, index=None):
        self.process_group, self.calls, self.in_backward, self.blocking_in_backward = process_group, 0, 0, 0
        self.index, self.buckets, self.numels = index, [], []
        self.grads_ready, self.launches = 0, []    # gradients finished so far; per call: (that, numel)


def in_backward():
    return torch._C._current_graph_task_id() != -1              # inside autograd's backward?


class Watched:
    """An async all_reduce's Work (and its future) that notes a wait() made during backward:
    async_op=True followed by .wait() in the hook blocks backward just like async_op=False."""
    def __init__(self, inner, count):
        self._inner, self._count = inner, count

    def wait(self, *args, **kwargs):
        self._count.blocking_in_backward += in_backward()
        return self._inner.wait(*args, **kwargs)

    def value(self, *args, **kwargs):
        self._count.blocking_in_backward += in_backward()
        return self._inner.value(*args, **kwargs)

    def get_future(self):
        return Watched(self._inner.get_future(), self._count)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def counting(all_reduce, count):
    def counted_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        count.calls += 1
        count.numels.append(tensor.numel())                       # what went on the wire
        count.launches.append((count.grads_ready, tensor.numel()))  # and when, in backward
        during = in_backward()                                     # launched during backward?
        count.in_backward += during
        count.blocking_in_backward += during and not async_op     # backward waits for it
        work = all_reduce(tensor, op=op, group=group, async_op=async_op)
        return Watched(work, count) if async_op else work
    counted_all_reduce.count = count
    return counted_all_reduce


if not hasattr(dist.all_reduce, "count"):    # wrap once, even if this file is loaded twice
    dist.all_reduce = counting(dist.all_reduce, Counter())
COUNT = dist.all_reduce.count


def counting_hook(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    state.calls += 1
    state.buckets.append(sorted(state.index[p.data_ptr()] for p in bucket.parameters()))
    return allreduce_hook(state.process_group, bucket)


def flat_weights(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_on_all_ranks(t):
    ref = t.clone()
    dist.broadcast(ref, src=0)
    ok = torch.tensor([float(torch.equal(ref, t))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)     # every rank must agree
    return bool(ok.item())


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


def check_stage(stage, base, batches, bucket_bytes, impl):
    """Our stage vs torch DDP, step by step, from this rank's own initial weights."""
    ours_model, ddp_model = copy.deepcopy(base), copy.deepcopy(base)
    differ_before = not same_on_all_ranks(flat_weights(ours_model))
    ours = make(stage, ours_model, bucket_bytes, impl)
    ddp = DDP(ddp_model, bucket_cap_mb=bucket_bytes / 2 ** 20)
    hook_state = Counter(index={p.data_ptr(): i for i, p in enumerate(ddp.module.parameters())})
    ddp.register_comm_hook(hook_state, counting_hook)
    ours_index = {id(p): i for i, p in enumerate(ours_model.parameters())}
    ready = []                             # the order backward finishes the gradients in

    def noting(i):
        def note(q):                       # registered after ours, so it runs after ours' hook
            ready.append(i)
            COUNT.grads_ready += 1         # counted_all_reduce stamps every call with this
        return note
    for i, q in enumerate(ours_model.parameters()):
        q.register_post_accumulate_grad_hook(noting(i))
    opt_ours = torch.optim.SGD(ours_model.parameters(), lr=0.05, momentum=0.9)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    steps = []
    for x, y in batches:
        before, before_bw, before_bl = COUNT.calls, COUNT.in_backward, COUNT.blocking_in_backward
        COUNT.numels, COUNT.launches, COUNT.grads_ready, first = [], [], 0, len(ready)
        error = ""
        try:                               # the learner's code: a bug becomes a checker message
            train_step(ours_model, opt_ours, x, y, ours)
        except Exception as e:             # noqa: BLE001 (any error of theirs, named below)
            error = f"{type(e).__name__}: {e}"
        numels, launches = sorted(COUNT.numels), list(COUNT.launches)
        calls, in_backward = COUNT.calls - before, COUNT.in_backward - before_bw
        blocking = COUNT.blocking_in_backward - before_bl
        failed = torch.tensor([float(bool(error))])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)   # every rank stops at the same step (not counted:
        if failed.item():                               # the counts above are taken)
            steps.append({"error": error or "another rank's Bucketed raised an error", "allclose": False})
            break
        ddp_before, hook_state.buckets = hook_state.calls, []
        train_step(ddp, opt_ddp, x, y)
        diff = (flat_weights(ours_model) - flat_weights(ddp.module)).abs().max().item()
        ok = torch.tensor([float(diff <= 1e-5)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # a mismatch on any rank fails the step
        steps.append({"allclose": bool(ok.item()), "max_abs_diff": diff,
                      "calls": calls, "calls_in_backward": in_backward,
                      "blocking_in_backward": blocking, "numels": numels,
                      "launches": launches, "ready_order": ready[first:],
                      "ddp_calls": hook_state.calls - ddp_before, "ddp_buckets": hook_state.buckets})
    buckets = ([sorted(ours_index[id(p)] for p in b) for b in ours.buckets]
               if hasattr(ours, "buckets") else None)     # parameter indices, bucket by bucket
    return {"stage": stage, "ranks_differed_before": differ_before, "bucket_bytes": bucket_bytes,
            "param_bytes": [q.numel() * q.element_size() for q in base.parameters()], "ready_order": ready[:len(ours_index)],
            "equal_after_broadcast": same_on_all_ranks(flat_weights(ours_model)),
            "allclose_every_step": all(s["allclose"] for s in steps), "steps": steps,
            "buckets": buckets}


def time_stage(stage, base, batches, bucket_bytes, impl, rounds=3):
    """ms per step, ours and torch DDP side by side (A B A B ..., medians)."""
    times = {"ours": [], "ddp": []}
    for _ in range(rounds):
        for who in ("ours", "ddp"):
            model = copy.deepcopy(base)
            ours = make(stage, model, bucket_bytes, impl) if who == "ours" else None
            net = model if who == "ours" else DDP(model, bucket_cap_mb=bucket_bytes / 2 ** 20)
            opt = torch.optim.SGD(net.parameters(), lr=0.05)
            train_step(net, opt, *batches[0], ours)          # warm-up (DDP rebuilds buckets)
            dist.barrier()
            t0 = time.perf_counter()
            for x, y in batches:
                train_step(net, opt, x, y, ours)
            times[who].append(1000 * (time.perf_counter() - t0) / len(batches))
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def load_bucketed(path):
    """The exercise: class Bucketed from another file (the learner's), same interface."""
    spec = importlib.util.spec_from_file_location("learner_bucketed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Bucketed


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
