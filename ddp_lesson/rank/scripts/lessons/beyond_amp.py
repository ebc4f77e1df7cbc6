"""Lesson 10: mixed precision with DDP, gradient accumulation and clipping, in the right order.

    torchrun --standalone --nproc-per-node 2 beyond_amp.py --precision auto --steps 12
auto: bf16 on CPU ranks; fp16 with a GradScaler on GPUs. Per optimizer step:
  micro-batches under no_sync() but the last (the last backward all-reduces),
  scaler.unscale_ (so clipping sees true gradients), clip_grad_norm_, scaler.step, update.
(--precision fp16 runs the GradScaler on CPU ranks too.) Every rank all-gathers a fingerprint
of its clipped gradient: equal on all ranks, because clipping runs after the all-reduce on
the same averaged gradient. Writes amp.json; check(amp) is the notebook's check of it: it
unscales the norm backward left by hand and fails if clipping saw another norm (clip before
unscale_) or did not bring it to min(norm, max_norm).
--then SCRIPT ARGS runs a later section's script after this one, in the same ranks
(ddp_lesson/rank/chain.py): the notebook runs sections 1-5's scripts in one launch.
"""
import argparse
import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lesson.rank import chain, data, metrics, models


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps")
    p.add_argument("--accum-steps", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--batch-size", type=int, default=16, help="per micro-batch, per process")
    p.add_argument("--max-norm", type=float, default=0.5, help="clip the gradient norm to this")
    p.add_argument("--lr", type=float, default=0.05)
    chain.add_then(p)
    return p.parse_args(argv)


def fingerprint(model):
    """Two numbers that change when any gradient entry changes: its norm and a weighted sum."""
    g = torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])
    weights = torch.arange(1, g.numel() + 1, dtype=torch.float64, device=g.device)
    return torch.stack([g.norm(), (g * weights).sum()])


def run(args, device):
    """This section's run, in a process group already started; rank 0 writes amp.json."""
    rank, world = dist.get_rank(), dist.get_world_size()
    use_cuda = device.type == "cuda"
    precision = args.precision
    if precision == "auto":
        precision = "fp16" if use_cuda else "bf16"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    # fp16 has a narrow range: small gradients underflow to 0 unless the loss is scaled up first.
    # bf16 has fp32's range, so it needs no scaler.
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    torch.manual_seed(0)
    model = DDP(models.SmallCNN(norm=False).to(device), device_ids=[device.index] if use_cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    k, b = args.accum_steps, args.batch_size
    x_all, y_all = data.shapes(args.steps * k * b * world, seed=7).tensors
    per_rank = args.steps * k * b
    x_all, y_all = x_all[rank * per_rank:(rank + 1) * per_rank], y_all[rank * per_rank:(rank + 1) * per_rank]

    out = {"world_size": world, "precision": precision, "scaler": scaler.is_enabled(),
           "max_norm": args.max_norm, "steps": []}
    for step in range(args.steps):
        for j in range(k):
            i = (step * k + j) * b
            x, y = x_all[i:i + b].to(device), y_all[i:i + b].to(device)
            last = j == k - 1
            with model.no_sync() if not last else contextlib.nullcontext():  # all-reduce on the last only
                with torch.autocast(device.type, dtype=dtype, enabled=precision != "fp32"):
                    logits = model(x)                      # matmuls/convs in low precision
                    loss = F.cross_entropy(logits, y) / k  # cross_entropy autocasts to fp32
                scaler.scale(loss).backward()              # grads land in fp32 .grad (fp32 weights)
        scaled_norm = fingerprint(model)[0].item()         # what backward left: S x the true norm
        scaler.unscale_(opt)                               # 1. true gradients (no-op without fp16)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)  # 2. then clip
        prints = fingerprint(model)
        gathered = [torch.zeros_like(prints) for _ in range(world)]
        dist.all_gather(gathered, prints)                  # every rank's clipped gradient
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        scaler.step(opt)                                   # skips the step if grads hold inf/nan
        scaler.update()                                    # and then halves the scale
        opt.zero_grad(set_to_none=True)
        same = all(torch.equal(g, gathered[0]) for g in gathered)
        metrics.log(step, loss=loss.item() * k, grad_norm=norm.item())
        out["steps"].append({"loss": loss.item() * k, "scaled_norm": scaled_norm, "norm_before_clip": norm.item(),
                             "norm_after_clip": prints[0].item(), "same_on_all_ranks": same,
                             "scale": scale, "stepped": not (scaler.is_enabled() and scaler.get_scale() < scale)})
    out["activation_dtype"] = str(logits.dtype)
    out["loss_dtype"] = str(loss.dtype)
    out["param_dtype"] = str(next(model.parameters()).dtype)
    if rank == 0:
        metrics.save_json("amp.json", out)


def check(amp):
    """The notebook's check of amp.json. The reference is the norm backward left, unscaled by
    hand: clip_grad_norm_ must have seen that norm and brought it to min(norm, max_norm)."""
    stepped = [s for s in amp["steps"] if s["stepped"]]   # the scaler skips steps that overflowed
    assert stepped, "every step overflowed"
    assert all(s["same_on_all_ranks"] for s in stepped), "the ranks stepped with different gradients"
    if amp["scaler"]:                                      # S = 1 would hide the order
        assert all(s["scale"] > 1 for s in stepped), [s["scale"] for s in stepped]
    for s in stepped:
        true = s["scaled_norm"] / s["scale"]               # the averaged gradient's true norm
        assert math.isclose(s["norm_before_clip"], true, rel_tol=1e-4), \
            f"clipping saw norm {s['norm_before_clip']:.4g}, the true one is {true:.4g}: clipped before unscale_?"
        want = min(true, amp["max_norm"])
        assert math.isclose(s["norm_after_clip"], want, rel_tol=1e-3), \
            f"after clipping the norm is {s['norm_after_clip']:.4g}, not min({true:.4g}, max_norm) = {want:.4g}"
    assert any(s["scaled_norm"] / s["scale"] > amp["max_norm"] for s in stepped), "clipping never acted"


if __name__ == "__main__":
    chain.main(parse_args, run)   # set-up as in 03, run(), then any --then sections
