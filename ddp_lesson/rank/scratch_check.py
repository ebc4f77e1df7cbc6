"""Lesson 09's harness around ddp_scratch.py's stages: it counts every all_reduce call, checks
a stage against torch's DDP step by step, and times both. Plumbing, not the lesson: the
stages, make() and train_step() stay in the script, which passes them in.

Importing this module wraps torch.distributed.all_reduce once per process, so that the stages'
calls are counted with their sizes, whether they were made during backward, and whether
backward waited for them. torch's DDP calls all_reduce from C++: it is counted by a comm hook.
"""
import copy
import importlib.util
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


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


def check_stage(stage, build, train_step, base, batches, bucket_bytes):
    """Our stage vs torch DDP, step by step, from this rank's own initial weights. build(model)
    makes the stage's object (the script's make()); train_step is the script's."""
    ours_model, ddp_model = copy.deepcopy(base), copy.deepcopy(base)
    differ_before = not same_on_all_ranks(flat_weights(ours_model))
    ours = build(ours_model)
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


def time_stage(build, train_step, base, batches, bucket_bytes, rounds=3):
    """ms per step, ours and torch DDP side by side (A B A B ..., medians)."""
    times = {"ours": [], "ddp": []}
    for _ in range(rounds):
        for who in ("ours", "ddp"):
            model = copy.deepcopy(base)
            ours = build(model) if who == "ours" else None
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
