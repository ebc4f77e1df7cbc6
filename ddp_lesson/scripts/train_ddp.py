"""Reference DDP training script: a small CNN on the built-in `shapes` data (or CIFAR-10).

Run it with a launcher, one process per device:
    torchrun --standalone --nproc-per-node 2 train_ddp.py --epochs 3
    python -m ddp_lesson run train_ddp.py --nproc 2 -- --epochs 3
Every line that makes it distributed is here, marked with # DDP.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from ddp_lesson import data, metrics, models, syncbn


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--dataset", default="shapes", choices=["shapes", "cifar10"])
    p.add_argument("--data-root", default="data")
    p.add_argument("--sync-bn", action="store_true", help="synchronise BatchNorm statistics")
    p.add_argument("--checkpoint", default="", help="save each epoch here and resume from it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps --slow-ms each step")
    p.add_argument("--slow-ms", type=float, default=0.0, help="a straggler on purpose")
    return p.parse_args()


def evaluate(model, test_set, rank, world_size, device):
    # DDP: a plain split rank::world_size counts every test sample exactly once. A
    # DistributedSampler would pad the last shard with duplicates to equal lengths.
    shard = Subset(test_set, range(rank, len(test_set), world_size))
    model.eval()
    counts = torch.zeros(2, device=device)  # [correct, seen] on this rank
    with torch.no_grad():
        for x, y in DataLoader(shard, batch_size=256):
            x, y = x.to(device), y.to(device)
            counts[0] += (model(x).argmax(1) == y).sum()
            counts[1] += len(y)
    dist.all_reduce(counts)  # DDP: add up counts over ranks, then divide
    model.train()
    return (counts[0] / counts[1]).item(), int(counts[1].item())  # accuracy, samples counted


@record  # DDP: a failing rank's traceback reaches torchrun's error summary
def main():
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")          # DDP
    rank, world = dist.get_rank(), dist.get_world_size()              # DDP
    local_rank = int(os.environ["LOCAL_RANK"])                        # DDP
    if args.slow_rank >= world:
        raise SystemExit(f"--slow-rank {args.slow_rank} does not exist: the ranks are 0..{world - 1}.")
    if use_cuda:
        torch.cuda.set_device(local_rank)                             # DDP
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    torch.manual_seed(args.seed)

    train_set = data.get(args.dataset, train=True, root=args.data_root)
    test_set = data.get(args.dataset, train=False, root=args.data_root)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)  # DDP: a shard each
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    channels, size = data.num_channels_and_size(args.dataset)
    model = models.SmallCNN(in_channels=channels, image_size=size).to(device)
    if args.sync_bn:  # DDP: BatchNorm statistics over all ranks (PyTorch's takes GPU tensors only)
        sync_bn = torch.nn.SyncBatchNorm if device.type == "cuda" else syncbn  # chosen by device
        model = sync_bn.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank] if use_cuda else None)  # DDP: broadcasts rank 0's weights
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    timer = metrics.StepTimer(model)  # time per step: data / compute / waiting in the all-reduce

    start_epoch, step = 0, 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        ckpt = torch.load(args.checkpoint, map_location=device, weights_only=True)  # DDP: map_location
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]
        if rank == 0:
            print(f"resumed from {args.checkpoint} after epoch {ckpt['epoch'] + 1}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        t0, seen = time.time(), 0
        for i, (x, y) in enumerate(timer.timed(loader)):  # timed: data_s
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            if rank == args.slow_rank:  # a straggler: the other ranks will wait for it in backward
                time.sleep(args.slow_ms / 1000)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP: gradients are all-reduced (averaged) here
            opt.step()
            step, seen = step + 1, seen + len(x)
            metrics.log(step, loss=loss.item(), epoch=epoch, **timer.lap())  # + data/compute/wait_s, mem_mb
            if rank == 0:  # DDP: only rank 0 draws the progress bar
                done = (i + 1) * 20 // len(loader)
                print(f"\repoch {epoch + 1}/{args.epochs} [{'#' * done}{'.' * (20 - done)}] "
                      f"loss {loss.item():.3f}", end="", flush=True)
        throughput = torch.tensor([seen / (time.time() - t0)], device=device)
        dist.all_reduce(throughput)  # DDP: for the log only: samples/s over all ranks
        acc, test_samples = evaluate(model, test_set, rank, world, device)
        metrics.log(step, test_accuracy=acc, test_samples=test_samples, samples_per_s=throughput.item(),
                    epoch=epoch)
        if rank == 0:
            print(f"  test accuracy {acc:.1%}, {throughput.item():.0f} samples/s", flush=True)
            if args.checkpoint:  # DDP: one writer; write then rename, so a crash never leaves half a file
                state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                         "epoch": epoch, "step": step}
                torch.save(state, args.checkpoint + ".tmp")
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
        dist.barrier()  # DDP: nobody reads the checkpoint before it is written

    if rank == 0 and "DDP_LESSON_RUN_DIR" in os.environ:  # DDP: one writer; the inner model's weights
        torch.save(model.module.state_dict(), os.path.join(os.environ["DDP_LESSON_RUN_DIR"], "model.pt"))
    dist.destroy_process_group()  # DDP


if __name__ == "__main__":
    main()
