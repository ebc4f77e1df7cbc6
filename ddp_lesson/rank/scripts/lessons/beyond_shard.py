"""Lesson 10: when the model does not fit. Memory per rank, ZeRO-1 and FSDP2, each against DDP.

    torchrun --standalone --nproc-per-node 2 beyond_shard.py --steps 5
Trains one model from the same start on the same global batches four ways, with Adam:
  ddp       every rank holds all parameters, gradients and optimizer state (P + P + 2P
            floats) and, with gradient_as_bucket_view=False (the default), DDP's buckets:
            a second, gradient-sized copy (P floats): 20 bytes per parameter, not 16;
  ddp_view  the same with gradient_as_bucket_view=True: the gradients are views into the
            buckets, the copy is gone (16 bytes per parameter);
  zero      DDP + ZeroRedundancyOptimizer: each rank keeps the Adam state of its own
            parameters only (~2P/N), steps them, then broadcasts them to the others
            (on top of DDP's all-reduce: ~1.5x DDP's bytes, not the ZeRO paper's
            reduce-scatter + all-gather);
  fsdp      FSDP2 fully_shard: parameters, gradients and state all sharded (~4P/N), each
            layer all-gathered just before use and freed after; gradients reduce-scattered.
Per rank it counts the bytes the formulas predict, the bytes the tensors really hold (DDP's
buckets found by a comm hook), and, on gloo, the bytes each rank wrote to its sockets per
step (/proc/self/io). Writes shard.json.
--then SCRIPT ARGS runs a later section's script after this one, in the same ranks
(ddp_lesson/rank/chain.py): the notebook runs sections 1-5's scripts in one launch.
"""
import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lesson.rank import chain, data, metrics


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=6, help="hidden layers of the same size")
    chain.add_then(p)
    return p.parse_args(argv)


def mlp(hidden, layers):
    torch.manual_seed(0)
    blocks = [nn.Flatten(), nn.Linear(3 * 16 * 16, hidden), nn.ReLU()]
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(hidden, 10))


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def held_bytes(tensors):
    """Bytes of storage these tensors really hold on this rank (each storage counted once)."""
    seen = {}
    for t in tensors:
        s = local(t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def memory(model, opt_state, buckets=()):
    """Bytes held per part; DDP's buckets count only where they are not the gradients' storage."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in opt_state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    grad_storages = {local(g).untyped_storage().data_ptr() for g in grads}
    return {"params": held_bytes(params), "grads": held_bytes(grads), "optimizer": held_bytes(state),
            "buckets": held_bytes([b for b in buckets if b.untyped_storage().data_ptr() not in grad_storages])}


def keeping_buckets(kept, bucket):
    """A comm hook: DDP's own all-reduce, keeping each bucket's flat buffer to measure it."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    kept[bucket.index()] = bucket.buffer()
    return allreduce_hook(None, bucket)


def bytes_written():
    """Bytes this process has written (gloo's sockets among them); None where /proc has no io."""
    try:
        with open("/proc/self/io") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("wchar"))
    except OSError:
        return None


def train(model, opt, batches, sent=None):
    losses = []
    w0 = bytes_written()
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if len(losses) < len(batches):
            opt.zero_grad(set_to_none=True)  # keep the last gradients, to measure them
    if sent is not None and w0 is not None:
        sent.append((bytes_written() - w0) / len(batches))   # per step, this rank
    return losses


def full_weights(model):
    """All parameters as one flat tensor; FSDP2's shards gathered with DTensor.full_tensor()."""
    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1).cpu()
                      for p in model.parameters()])


def gather(value):
    """One number from every rank, as a list indexed by rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def unsharded_peak(model, x, y):
    """Peak bytes of whole (unsharded) weights alive at once during one forward and backward.
    FSDP2 swaps a module's parameter from its shard (a DTensor) to the gathered plain tensor
    while the module runs, and back when it reshards; a hook at every layer's forward and
    backward adds up the plain ones at that moment."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    peak = [0]

    def note(*_):
        whole = sum(p.numel() * p.element_size() for m in layers for p in m.parameters(recurse=False)
                    if not isinstance(p, DTensor))
        peak[0] = max(peak[0], whole)
    hooks = [h for m in layers for h in (m.register_forward_pre_hook(note), m.register_forward_hook(note),
                                          m.register_full_backward_hook(note))]
    F.cross_entropy(model(x), y).backward()
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    return peak[0]


def wrapped(base, mesh, how):
    """FSDP2 three ways: "per layer" (every Linear its own unit, the default reshard),
    "per layer, kept" (reshard_after_forward=False: whole from forward until backward, like
    ZeRO-2), "root only" (one unit: the whole model gathered at once)."""
    model = copy.deepcopy(base)
    if how != "root only":
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, reshard_after_forward=(how == "per layer"))
    fully_shard(model, mesh=mesh)
    return model


def run(args, device):
    """This section's runs, in a process group already started; rank 0 writes shard.json."""
    rank, world = dist.get_rank(), dist.get_world_size()
    use_cuda = device.type == "cuda"
    ids = [device.index] if use_cuda else None

    b = args.batch_size
    x_all, y_all = data.shapes(args.steps * b * world, seed=17).tensors
    batches = [(x_all[(s * world + rank) * b:][:b].to(device), y_all[(s * world + rank) * b:][:b].to(device))
               for s in range(args.steps)]
    base = mlp(args.hidden, args.layers).to(device)
    P = sum(p.numel() for p in base.parameters())
    largest = max(p.numel() for p in base.parameters())
    out = {"world_size": world, "params": P, "largest_param": largest, "bytes_per_float": 4,
           "counted": {"ddp": {"params": 4 * P, "grads": 4 * P, "optimizer": 8 * P, "buckets": 4 * P},
                       "ddp_view": {"params": 4 * P, "grads": 4 * P, "optimizer": 8 * P, "buckets": 0},
                       "zero": {"params": 4 * P, "grads": 4 * P, "optimizer": 8 * P / world, "buckets": 4 * P},
                       "fsdp": {"params": 4 * P / world, "grads": 4 * P / world,
                                "optimizer": 8 * P / world, "buckets": 0}},
           "held": {}, "losses": {}, "sent_per_step": {}}
    sent = {k: [] for k in ("ddp", "ddp_view", "zero", "fsdp")}

    # 1. plain DDP with Adam, gradient_as_bucket_view False (the default), then True
    for kind, as_view in (("ddp", False), ("ddp_view", True)):
        ddp = DDP(copy.deepcopy(base), device_ids=ids, gradient_as_bucket_view=as_view)
        kept = {}
        ddp.register_comm_hook(kept, keeping_buckets)
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
        out["losses"][kind] = train(ddp, opt, batches, sent[kind])
        out["held"][kind] = memory(ddp, opt.state, kept.values())
        out[f"{kind}_buckets"] = len(kept)
    w_ddp = full_weights(ddp)

    # 2. DDP + ZeroRedundancyOptimizer: the same Adam, its state split across ranks
    zero = DDP(copy.deepcopy(base), device_ids=ids)
    kept = {}
    zero.register_comm_hook(kept, keeping_buckets)
    zopt = ZeroRedundancyOptimizer(zero.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    out["losses"]["zero"] = train(zero, zopt, batches, sent["zero"])
    out["held"]["zero"] = memory(zero, zopt.optim.state, kept.values())   # .optim: this rank's local Adam
    w_zero = full_weights(zero)
    state_floats = sum(v.numel() for s in zopt.optim.state.values() for v in s.values()
                       if torch.is_tensor(v) and v.dim() > 0)
    out["zero_state_floats_per_rank"] = gather(state_floats)
    out["zero_max_weight_diff_vs_ddp"] = (w_zero - w_ddp).abs().max().item()

    # 3. FSDP2: shard every Linear, then the root (which holds nothing of its own here)
    mesh = init_device_mesh(device.type, (world,))
    fsdp = copy.deepcopy(base)
    for layer in fsdp:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fopt = torch.optim.Adam(fsdp.parameters(), lr=1e-3)
    out["fsdp_local_shapes"] = {n: [list(p.to_local().shape), list(p.shape)] for n, p in fsdp.named_parameters()}
    out["fsdp_local_floats_per_rank"] = gather(sum(p.to_local().numel() for p in fsdp.parameters()))
    out["losses"]["fsdp"] = train(fsdp, fopt, batches, sent["fsdp"])
    out["held"]["fsdp"] = memory(fsdp, fopt.state)
    w_fsdp = full_weights(fsdp)
    out["fsdp_max_weight_diff_vs_ddp"] = (w_fsdp - w_ddp).abs().max().item()
    out["fsdp_max_loss_diff_vs_ddp"] = max(abs(a - b) for a, b in zip(out["losses"]["fsdp"], out["losses"]["ddp"]))
    # the peak of whole weights at once: the model just trained, then three ways of wrapping it
    out["unsharded_peak"] = {"trained": unsharded_peak(fsdp, *batches[0])}
    out["unsharded_peak"].update({how: unsharded_peak(wrapped(base, mesh, how), *batches[0])
                                  for how in ("per layer", "per layer, kept", "root only")})
    out["layer_bytes"] = [sum(p.numel() * 4 for p in m.parameters()) for m in base if isinstance(m, nn.Linear)]
    out["held_per_rank"] = {k: gather(sum(v.values())) for k, v in out["held"].items()}
    if not use_cuda:                     # nccl's bytes do not go through this process's sockets
        out["sent_per_step"] = {k: gather(v[0]) for k, v in sent.items() if v}
    if rank == 0:
        metrics.save_json("shard.json", out)


def check_unsharded_peak(sh):
    """The notebook's check of what per-layer wrapping buys: the peak of whole weights at once,
    first in the model section 3 trained (the lines you edit), then in the three demo wrappings."""
    peak, full = sh["unsharded_peak"], 4 * sh["params"]
    two = sum(sorted(sh["layer_bytes"])[-2:])        # the layer running and, at most, one prefetched
    assert peak["trained"] <= two < full, (
        f"the model section 3 trained held {peak['trained']:,} bytes of whole weights at once, more than "
        f"the two largest layers ({two:,}) of the model's {full:,}: is every Linear its own fully_shard "
        f"unit, before fully_shard(fsdp)?")
    assert peak["per layer"] <= two < full, (
        f"per-layer wrapping held {peak['per layer']:,} bytes of whole weights at once, more than the two "
        f"largest layers ({two:,}) of the model's {full:,}: is every Linear its own fully_shard unit?")
    assert peak["root only"] == full, (
        f"root-only wrapping held {peak['root only']:,} bytes at its peak, expected the whole model ({full:,})")
    assert peak["per layer, kept"] == full, (
        f"reshard_after_forward=False held {peak['per layer, kept']:,} bytes at its peak, expected every "
        f"layer kept whole from forward to backward ({full:,})")


if __name__ == "__main__":
    chain.main(parse_args, run)   # set-up as in 03, run(), then any --then sections
