"""Check (lesson 07): two DDP mistakes of a UNet training script from a Chinese single-machine multi-GPU guide (one of the two posts the course grew from, named in notebook 00), run on real ranks.

1. It never wraps the model in DDP (it calls init_process_group, uses DistributedSampler and
   then trains `model` itself): no gradient is averaged, so every rank trains its own copy on
   its own shard and the copies drift apart. Wrapped in DDP they stay identical.
2. It calls random_split without a generator on every rank: each process draws its own
   train/valid split, so DistributedSampler's shards (positions in different permutations)
   overlap and one rank's validation samples are another rank's training samples. With
   generator=torch.Generator().manual_seed(0) every rank has the same split: disjoint shards.
Also: the unwrapped model's state_dict() keys have no "module." prefix; DDP's do.
Writes unet_split.json (rank 0, with every rank's figures).
--then SCRIPT ARGS runs another script after this one, in the same ranks (ddp_lesson/rank/chain.py):
notebook 07 runs `hang --mode sleep` after it: the run its section 2 stops by force.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, random_split
from torch.utils.data.distributed import DistributedSampler

from ddp_lesson.rank import chain, data, metrics, models

SAMPLES, STEPS = 120, 3
TRAIN = int(0.85 * SAMPLES)  # that script's 85 / 15 split


def split_report(generator):
    dataset = data.shapes(SAMPLES, seed=0)
    kwargs = {} if generator is None else {"generator": generator}
    train, valid = random_split(dataset, [TRAIN, SAMPLES - TRAIN], **kwargs)
    shard = [train.indices[i] for i in DistributedSampler(train, shuffle=False)]  # dataset indices
    return {"shard": shard, "valid": list(valid.indices)}, train


def weights_after_training(train, wrap):
    torch.manual_seed(0)  # the UNet script loads the same pretrained weights on every rank
    model = models.SmallCNN(width=4)
    net = DDP(model) if wrap else model
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = DataLoader(train, batch_size=8, sampler=DistributedSampler(train, seed=0))
    for _, (x, y) in zip(range(STEPS), loader):
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, list(net.state_dict())[0]


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    chain.add_then(p)
    return p.parse_args(argv)


@record
def main():
    args = parse_args()
    dist.init_process_group("gloo")
    device = torch.device("cpu")
    run(args, device)
    chain.then(args.then, device)        # --then: a later script, in these same ranks
    dist.destroy_process_group()


def run(args, device):
    """The check, in a process group already started; rank 0 writes unet_split.json."""
    rank, world = dist.get_rank(), dist.get_world_size()
    unseeded, _ = split_report(None)                        # that script: every rank its own split
    seeded, train = split_report(torch.Generator().manual_seed(0))
    result = {}
    for wrap in (False, True):
        flat, first_key = weights_after_training(train, wrap)
        every = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(every, flat)
        name = "ddp" if wrap else "no_ddp"
        result[f"{name}_max_weight_diff"] = max((w - every[0]).abs().max().item() for w in every)
        result[f"{name}_first_key"] = first_key
    splits = [None] * world
    dist.all_gather_object(splits, {"unseeded": unseeded, "seeded": seeded})
    if rank == 0:
        # DistributedSampler pads the shards to equal lengths with repeats (102 samples on 4
        # ranks: 2); disjoint means every training sample on exactly one rank besides those
        result["padding"] = len(seeded["shard"]) * world - TRAIN
        for kind in ("unseeded", "seeded"):
            shards = [s[kind]["shard"] for s in splits]
            every_index = [i for s in shards for i in s]
            result[f"{kind}_shards_disjoint"] = len(set(every_index)) == TRAIN
            result[f"{kind}_train_in_other_valid"] = sum(
                len(set(splits[a][kind]["shard"]) & set(splits[b][kind]["valid"]))
                for a in range(world) for b in range(world) if a != b)
            result[f"{kind}_same_split"] = all(s[kind]["valid"] == splits[0][kind]["valid"] for s in splits)
        result.update(world_size=world, steps=STEPS)
        metrics.save_json("unet_split.json", result)


if __name__ == "__main__":
    main()
