"""Exercise (notebook 04): the global batch's BatchNorm statistics, by hand.

    torchrun --standalone --nproc-per-node 2 ex_syncbn.py
Each rank holds x, what the first BN layer of a small CNN sees for this rank's images:
shape [images, channels, height, width]. Rank r holds 3 + r images, so counts differ across
ranks, as SyncBatchNorm allows. Each rank also shifts its x by a random amount per channel
that only it knows, as real data would differ: no rank can rebuild another rank's x, so the
numbers have to be sent. Your job, in the lines marked # EXERCISE: every rank computes, per
channel, the mean and the biased variance of the global batch, every rank's x together.
That is what SyncBatchNorm's forward needs.
"""
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_lesson.rank import data, metrics, models


@record
def main():
    dist.init_process_group("gloo")  # DDP: CPU ranks are enough, nothing here trains
    rank, world_size = dist.get_rank(), dist.get_world_size()
    images = data.shapes(world_size * (world_size + 3), seed=0).tensors[0]
    mine = images[rank::world_size][:3 + rank]        # this rank's images: 3 + rank of them
    torch.manual_seed(0)                              # the same layer on every rank
    conv = models.SmallCNN(width=8).features[0]       # the layer before the first BN
    secret = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
    with torch.no_grad():
        x = conv(mine)                                # [3 + rank, 8, 16, 16]
        x += 0.1 * torch.randn(x.shape[1], 1, 1, generator=secret)   # a shift only this rank knows
    metrics.log(0, x=x.tolist())                      # course: for the checker

    # EXERCISE: mean and var, each of shape [channels]: over every rank's x together,
    # per channel, the mean and the biased variance (divide by the count, not count - 1).
    # Every rank must end with the same two tensors. These lines see this rank only:
    mean = x.mean(dim=(0, 2, 3))
    var = x.var(dim=(0, 2, 3), unbiased=False)

    metrics.log(1, mean=mean.tolist(), var=var.tolist())
    dist.destroy_process_group()  # DDP


if __name__ == "__main__":
    main()
