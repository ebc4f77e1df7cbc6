"""Lesson 10: compress DDP's gradient all-reduce with a communication hook.

    torchrun --standalone --nproc-per-node 2 beyond_compress.py --steps 40
Trains the same model from the same start on the same data three times: DDP's default
(fp32 all-reduce), fp16_compress_hook and bf16_compress_hook. A wrapper around each hook
counts the bytes of the tensors it hands to dist.all_reduce, and on gloo the bytes this
process really wrote to its sockets during backward (/proc/self/io), where DDP's all-reduces
run and finish. Writes compress.json; check(compress) is the notebook's check of it.
--then SCRIPT ARGS runs a later section's script after this one, in the same ranks
(ddp_lesson/rank/chain.py): the notebook runs sections 1-5's scripts in one launch.
"""
import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lesson.rank import chain, data, metrics, models

HOOKS = {"fp32": default_hooks.allreduce_hook,          # what DDP does without a hook
         "fp16": default_hooks.fp16_compress_hook,      # cast to fp16, divide by N, all-reduce, cast back
         "bf16": default_hooks.bf16_compress_hook}


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.05)
    chain.add_then(p)
    return p.parse_args(argv)


class Counted:
    """Hook state: the real hook plus what it sent. The built-in hooks take the process
    group as their state; None means the default group."""
    def __init__(self, hook):
        self.hook, self.calls, self.bytes, self.dtypes = hook, 0, 0, set()


def counting_hook(state, bucket):
    real_all_reduce = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):  # count the tensor the hook hands to the network
        state.calls += 1
        state.bytes += tensor.numel() * tensor.element_size()
        state.dtypes.add(str(tensor.dtype))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        return state.hook(None, bucket)
    finally:
        dist.all_reduce = real_all_reduce


def bytes_written():
    """Bytes this process has written (gloo's sockets among them); None where /proc has no io."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar"))
    except OSError:
        return None


def run(args, device):
    """This section's runs, in a process group already started; rank 0 writes compress.json."""
    rank, world = dist.get_rank(), dist.get_world_size()
    use_cuda = device.type == "cuda"

    b = args.batch_size
    x_all, y_all = data.shapes(args.steps * b * world, seed=11).tensors
    torch.manual_seed(0)
    base = models.SmallCNN(norm=False)
    out = {"world_size": world, "steps": args.steps,
           "gradient_bytes": sum(p.numel() * p.element_size() for p in base.parameters()), "runs": {}}
    weights = {}
    for name, hook in HOOKS.items():
        model = DDP(copy.deepcopy(base).to(device), device_ids=[device.index] if use_cuda else None)
        state = Counted(hook)
        model.register_comm_hook(state, counting_hook)   # DDP calls it once per gradient bucket
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        losses, wire = [], 0
        for step in range(args.steps):
            i = (step * world + rank) * b                  # this rank's slice of the global batch
            x, y = x_all[i:i + b].to(device), y_all[i:i + b].to(device)
            loss = F.cross_entropy(model(x), y)
            w0 = bytes_written()
            loss.backward()                                # DDP's all-reduces start and end in here
            if w0 is not None:
                wire += bytes_written() - w0
            opt.step()
            opt.zero_grad(set_to_none=True)
            logged = loss.detach().clone()
            dist.all_reduce(logged)                        # for the log only: the global mean loss
            losses.append(logged.item() / world)
            metrics.log(step, **{f"loss_{name}": losses[-1]})
        weights[name] = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
        out["runs"][name] = {"losses": losses, "allreduce_calls": state.calls, "bytes": state.bytes,
                             "dtypes": sorted(state.dtypes),
                             "bytes_per_step": state.bytes / args.steps,
                             "wire_bytes_per_step": wire / args.steps if not use_cuda else None}
    for name in HOOKS:
        out["runs"][name]["max_weight_diff_vs_fp32"] = (weights[name] - weights["fp32"]).abs().max().item()
    if rank == 0:
        metrics.save_json("compress.json", out)


def check(compress):
    """The notebook's check of compress.json."""
    r, n = compress["runs"], compress["world_size"]
    fp32 = r["fp32"]
    assert fp32["dtypes"] == ["torch.float32"]
    # DDP hands every gradient to the hook once per step, in buckets: 4 bytes each in fp32
    assert fp32["bytes_per_step"] == compress["gradient_bytes"], (fp32["bytes_per_step"], compress["gradient_bytes"])
    for name, dtype in (("fp16", "torch.float16"), ("bf16", "torch.bfloat16")):
        v = r[name]
        assert v["dtypes"] == [dtype], f"{name}: the hook sent {v['dtypes']}, not {dtype}"
        assert 2 * v["bytes_per_step"] == fp32["bytes_per_step"], f"{name}: not half fp32's bytes"
        assert 0 < v["max_weight_diff_vs_fp32"] < 1e-1, name   # rounded, so not identical, but close
        assert abs(v["losses"][-1] - fp32["losses"][-1]) < 0.05, name   # and the loss curve follows
    if fp32["wire_bytes_per_step"] is not None and n > 1:     # gloo: bytes written, measured
        ring = 2 * (n - 1) / n * compress["gradient_bytes"]   # a ring all-reduce of every fp32 gradient
        assert ring <= fp32["wire_bytes_per_step"] <= 1.02 * ring + 2048, fp32["wire_bytes_per_step"]
        for name in ("fp16", "bf16"):                         # half the bytes on the wire
            ratio = r[name]["wire_bytes_per_step"] / fp32["wire_bytes_per_step"]
            assert 0.45 <= ratio <= 0.55, (name, ratio)
    first, last = fp32["losses"][:5], fp32["losses"][-5:]
    assert sum(last) / 5 < sum(first) / 5 - 0.1, "the model did not learn"


if __name__ == "__main__":
    chain.main(parse_args, run)   # set-up as in 03, run(), then any --then sections
