"""Lesson 10: a checkpoint that outlives the world size, with torch.distributed.checkpoint (DCP).

    torchrun --standalone --nproc-per-node 2 beyond_dcp.py --save ckpt   # train, save sharded
    torchrun --standalone --nproc-per-node 3 beyond_dcp.py --load ckpt   # load at 3 ranks
An FSDP2 model holds 1/N of every parameter per rank. Saving it the lesson-03 way (rank 0
calls torch.save) would keep only rank 0's shards. dcp.save has every rank write its own
shards plus one metadata file that says where each piece of each tensor lives, so dcp.load
can re-cut the pieces for any number of ranks. Writes dcp_save.json / dcp_load.json;
check(saved, loaded) is the notebook's check of the two.
The notebook runs the save as the end of one launch (... --then beyond_dcp --save DIR, see
ddp_lesson/rank/chain.py) after sections 1-4's scripts, in the same ranks.
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ddp_lesson.rank import chain, data, metrics


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", metavar="DIR", help="train a few steps, then save a sharded checkpoint")
    g.add_argument("--load", metavar="DIR", help="load the checkpoint in DIR at this world size")
    p.add_argument("--steps", type=int, default=3)
    return p.parse_args(argv)


def sharded_model(mesh, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 64), nn.ReLU(), nn.Linear(64, 64),
                          nn.ReLU(), nn.Linear(64, 10)).to(mesh.device_type)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state(model):
    """Every parameter whole (gathered from all ranks), on CPU."""
    return {k: v.full_tensor().cpu().clone() for k, v in model.state_dict().items()}


def full_moments(model, opt):
    """Adam's two moments of every parameter, whole (gathered from all ranks), on CPU."""
    return {f"{name}.{m}": opt.state[p][m].full_tensor().cpu().clone()
            for name, p in model.named_parameters() for m in ("exp_avg", "exp_avg_sq")}


def hyperparameters(opt):
    """lr and betas of every param_group: what set_optimizer_state_dict restores, not dcp.load."""
    return [{"lr": g["lr"], "betas": list(g["betas"])} for g in opt.param_groups]


def run(args, device):
    """Save or load, in a process group already started; rank 0 writes dcp_save.json / dcp_load.json."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))

    if args.save:
        model = sharded_model(mesh, seed=0)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.95))   # not Adam's defaults
        x, y = data.shapes(16 * world * args.steps, seed=19).tensors
        for s in range(args.steps):
            i = (s * world + rank) * 16
            F.cross_entropy(model(x[i:i + 16].to(mesh.device_type)), y[i:i + 16].to(mesh.device_type)).backward()
            opt.step()
            opt.zero_grad()
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save(state, checkpoint_id=args.save)        # every rank writes its own shards
        reference = full_state(model)                     # for the check at load time only
        mine = {k: v.to_local() for k, v in model.state_dict().items()}  # rank 0's share
        if rank == 0:
            torch.save(reference, os.path.join(args.save, "reference_full.pt"))
        moments = full_moments(model, opt)                # a collective: every rank calls it
        if rank == 0:
            torch.save(moments, os.path.join(args.save, "reference_moments.pt"))
            out = {"world_size": world, "steps": args.steps, "files": sorted(os.listdir(args.save)),
                   "floats_total": sum(v.numel() for v in reference.values()),
                   "hyperparameters": hyperparameters(opt),
                   "floats_on_rank0": sum(v.numel() for v in mine.values()),
                   "full_shapes": {k: list(v.shape) for k, v in reference.items()},
                   "local_shapes": {k: list(v.shape) for k, v in mine.items()}}
            metrics.save_json("dcp_save.json", out)
    else:
        model = sharded_model(mesh, seed=1)               # different weights: the load must replace them
        opt = torch.optim.Adam(model.parameters())        # Adam's defaults: the load must bring the save's
        before = full_state(model)
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=args.load)          # fills this rank's shards, re-cut for N
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        after = full_state(model)
        reference = torch.load(os.path.join(args.load, "reference_full.pt"), weights_only=True)
        steps = [s["step"].item() for s in opt.state.values()]
        moments = full_moments(model, opt)                # the new Adam had none before the load
        saved_moments = torch.load(os.path.join(args.load, "reference_moments.pt"), weights_only=True)
        if rank == 0:
            out = {"world_size": world,
                   "max_diff_vs_saved": max((after[k] - reference[k]).abs().max().item() for k in reference),
                   "max_diff_before_load": max((before[k] - reference[k]).abs().max().item() for k in reference),
                   "adam_steps_restored": steps,
                   "hyperparameters": hyperparameters(opt),
                   "adam_moments_restored": sorted(moments) == sorted(saved_moments),
                   "max_moment_diff_vs_saved": max((moments[k] - saved_moments[k]).abs().max().item()
                                                   for k in saved_moments),
                   "min_moment_abs_max": min(v.abs().max().item() for v in saved_moments.values()),
                   "local_shapes": {k: list(v.to_local().shape) for k, v in model.state_dict().items()}}
            metrics.save_json("dcp_load.json", out)


def check(saved, loaded):
    """The notebook's check of dcp_save.json and dcp_load.json: saved at N ranks, loaded at another."""
    n_save, n_load = saved["world_size"], loaded["world_size"]
    assert n_load != n_save, "the load ran at the save's world size"
    shard_files = [f for f in saved["files"] if f.endswith(".distcp")]
    assert len(shard_files) == n_save and ".metadata" in saved["files"]   # one file per saving rank
    for name, full in saved["full_shapes"].items():        # rank 0 held ceil(rows / N) rows, at each end
        for n, local in ((n_save, saved["local_shapes"][name]), (n_load, loaded["local_shapes"][name])):
            assert local == [math.ceil(full[0] / n)] + full[1:], f"{name}: {local} at {n} ranks, full {full}"
    assert loaded["max_diff_before_load"] > 1e-3                           # the new model started elsewhere
    assert loaded["max_diff_vs_saved"] == 0.0                              # the weights came back exactly
    assert loaded["adam_steps_restored"]                                   # optimizer state too: the
    assert all(s == saved["steps"] for s in loaded["adam_steps_restored"])  # step counts the save reached,
    assert loaded["adam_moments_restored"] and loaded["max_moment_diff_vs_saved"] == 0.0   # Adam's moments,
    assert loaded["min_moment_abs_max"] > 0                                 # which were not all zero
    assert loaded["hyperparameters"] == saved["hyperparameters"], (         # and the param_groups:
        f"param_groups came back as {loaded['hyperparameters']}, saved {saved['hyperparameters']}: "
        f"dcp.load fills the moments in place, set_optimizer_state_dict restores lr and betas")
    if n_save > 1:                                                         # rank-0 torch.save would lose the rest
        assert saved["floats_on_rank0"] < saved["floats_total"]


if __name__ == "__main__":
    chain.main(parse_args, run)   # set-up as in 03, run(), then any --then sections
