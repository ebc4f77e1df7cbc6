"""A DDP job that checkpoints every epoch and resumes from its checkpoint, with a crash
you can switch on (a flaky node, simulated): rank --crash-rank raises at the start of
each epoch listed in --crash-at, once per epoch (a marker file next to the checkpoint
remembers that it already crashed there).

    torchrun --standalone --nproc-per-node 2 resume.py --checkpoint ck.pt --epochs 4 --crash-at 1
    # fails; run the same command again: it resumes after the last saved epoch
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 resume.py ...   # torchrun resumes it
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_lesson.rank import data, metrics, models


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--crash-at", default="", help="epochs (0-based, comma-separated) to crash at, once each")
    p.add_argument("--crash-rank", type=int, default=1)
    args = p.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # 0, then 1 after a restart

    train = data.shapes(args.samples, seed=0)
    sampler = DistributedSampler(train, seed=0)
    loader = DataLoader(train, batch_size=64, sampler=sampler, drop_last=True)
    torch.manual_seed(0)
    model = DDP(models.SmallCNN(width=8).to(device), device_ids=[local_rank] if use_cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    start_epoch, step = 0, 0
    if os.path.exists(args.checkpoint):  # resume: every rank loads the same file
        ckpt = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]
        print(f"rank {rank}: resumed from {os.path.basename(args.checkpoint)} at epoch {start_epoch} "
              f"(attempt {attempt})", flush=True)
    crash_at = {int(e) for e in args.crash_at.split(",") if e.strip()}

    for epoch in range(start_epoch, args.epochs):
        marker = f"{args.checkpoint}.crashed-at-{epoch}"
        if rank == args.crash_rank and epoch in crash_at and not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError(f"simulated failure of rank {rank} at epoch {epoch}")
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
        metrics.log(step, loss=loss.item(), epoch=epoch, attempt=attempt, resumed_from=start_epoch)
        if rank == 0:  # one writer; write then rename, so a crash never leaves half a file
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch, "step": step}, args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)
            print(f"epoch {epoch} done, loss {loss.item():.3f}, checkpoint saved", flush=True)
        dist.barrier()  # nobody starts the next epoch (or crashes) before the checkpoint exists
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
