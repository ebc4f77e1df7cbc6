"""Notebook 03: DistributedDataParallel, launched by torchrun; the course's reference loop (the demo).

    torchrun --standalone --nproc-per-node 2 ddp_basic.py --epochs 2
Every line that makes it distributed is marked # DDP; a mark on an `if` or `with` covers its block.
Lines marked # course are the course's timing and logging, not needed in your code; outside the
course they do nothing. Without them the training computes the same numbers (tested on CPU ranks).
"""
import argparse
import os  # DDP: torchrun passes the rank and world size in environment variables
import time

import torch
import torch.distributed as dist  # DDP
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record  # DDP
from torch.nn.parallel import DistributedDataParallel as DDP  # DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler  # DDP

try:  # course: the course's logging and step timer, for its run panel
    from ddp_lesson.rank import metrics  # course
except ImportError:  # course: outside the course: nothing logged or timed, model.pt saved here
    class metrics:  # course
        log = lambda step, **values: None  # course
        checkpoint_path = lambda: "model.pt"  # course
        class StepTimer:  # course
            def __init__(self, model, opt): self.timed_loader, self.lap = (lambda loader: loader), dict  # course


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--warmup-steps", type=int, default=0, help="linear lr warm-up")
    p.add_argument("--train-samples", type=int, default=4096, help="use fewer to run faster")
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps --slow-ms each step")  # course
    p.add_argument("--slow-ms", type=float, default=0.0, help="a straggler on purpose")  # course
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", default="shapes", choices=["shapes", "cifar10"])
    p.add_argument("--data-root", default="data", help="where cifar10 is, in torchvision's format")
    return p.parse_args()


def evaluate(model, test_set, rank, world_size, device):  # DDP: takes rank and world size
    # DDP: every rank needs at least one test batch: model(x) may run a collective, and
    # without a batch the others hang, or on gloo abort.
    shard = Subset(test_set, range(rank, len(test_set), world_size))  # DDP: each sample once, no padding
    model.eval()
    counts = torch.zeros(2, device=device)  # [correct, seen] on this rank
    with torch.no_grad():
        for x, y in DataLoader(shard, batch_size=256):  # DDP: this rank's shard
            x, y = x.to(device), y.to(device)
            counts[0] += (model(x).argmax(1) == y).sum()
            counts[1] += len(y)
    dist.all_reduce(counts)  # DDP: add up counts over ranks, then divide
    model.train()
    return (counts[0] / counts[1]).item(), int(counts[1].item())  # accuracy, samples counted


@record  # DDP: a failing rank's traceback reaches torchrun's error summary
def main():
    args = parse_args()
    rank = int(os.environ["RANK"])                # DDP: global rank, set by torchrun
    local_rank = int(os.environ["LOCAL_RANK"])    # DDP: rank on this machine -> which GPU
    world_size = int(os.environ["WORLD_SIZE"])    # DDP: number of processes in the job
    # DDP: init_process_group meets the other ranks at the store MASTER_ADDR:MASTER_PORT, set by torchrun
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")  # DDP: nccl on GPUs, gloo on CPUs
    if use_cuda:
        torch.cuda.set_device(local_rank)                    # DDP: one GPU per process
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")  # DDP: this rank's GPU, or the CPU
    if rank == 0:  # DDP: one rank prints
        print(f"world_size={world_size} backend={dist.get_backend()} "
              f"master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    torch.manual_seed(args.seed + rank)  # DDP: a seed per rank, on purpose; DDP(...) makes the weights equal

    train_set = Subset(get_data(args.dataset, True, args.data_root), range(args.train_samples))
    test_set = get_data(args.dataset, False, args.data_root)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)  # DDP: a shard per rank
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)  # DDP

    model = SmallCNN(image_size=32 if args.dataset == "cifar10" else 16).to(device)
    model = DDP(model, device_ids=[local_rank] if use_cuda else None)  # DDP: broadcasts rank 0's weights
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    timer = metrics.StepTimer(model, opt)  # course: times each step for the run panel, changes nothing
    loader = timer.timed_loader(loader)  # course: also times the loading of each batch
    warmup = lambda step: min(1.0, (step + 1) / args.warmup_steps) if args.warmup_steps else 1.0
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        metrics.log(step, epoch=epoch, shard=list(sampler))  # course: for the shard check
        t0 = time.perf_counter()
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            out = model(x)
            loss = F.cross_entropy(out, y)
            if rank == args.slow_rank: time.sleep(args.slow_ms / 1000)  # course: a straggler on purpose
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP: gradients are averaged over ranks during backward
            opt.step()
            sched.step()
            step += 1
            acc = (out.argmax(1) == y).float().mean()  # course
            metrics.log(step, loss=loss, train_accuracy=acc, lr=sched.get_last_lr()[0], epoch=epoch,  # course
                        **timer.lap())  # course: + data_s, compute_s, wait_s, mem_mb
            if rank == 0:  # DDP: only rank 0 draws the progress bar
                done = (i + 1) * 20 // len(loader)
                print(f"\repoch {epoch + 1}/{args.epochs} [{'#' * done}{'.' * (20 - done)}] "
                      f"loss {loss.item():.3f}", end="", flush=True)
        epoch_s = time.perf_counter() - t0
        test_acc, test_samples = evaluate(model, test_set, rank, world_size, device)  # DDP: passes rank and world size
        metrics.log(step, test_accuracy=test_acc, test_samples=test_samples, epoch_s=epoch_s, epoch=epoch)  # course
        if rank == 0:  # DDP: one rank prints
            print(f"  test accuracy {test_acc:.1%} ({epoch_s:.1f} s)", flush=True)

    ckpt = "model.pt"
    ckpt = metrics.checkpoint_path()  # course: in the run's folder, where the notebook looks
    if rank == 0:  # DDP: one writer; save the inner model, without the "module." prefix
        torch.save(model.module.state_dict(), ckpt)
    dist.barrier()  # DDP: nobody reads the checkpoint before rank 0 has written it; other nodes need a shared folder
    state = torch.load(ckpt, map_location=device, weights_only=True)  # DDP: onto *this* rank's device
    plain = SmallCNN(image_size=32 if args.dataset == "cifar10" else 16).to(device)
    plain.load_state_dict(state)  # loads into a plain model: no DDP needed to use it
    dist.destroy_process_group()  # DDP


# ---- The data and the model: plain PyTorch, no DDP. main() above uses them. ----
def shapes(n, seed, noise=0.35, size=16):
    """The course's data, made from a seed, no download: n noisy drawn shapes (3 x 16 x 16) of
    10 classes: square, frame, disc, ring, hbar, vbar, plus, cross, diagonal, triangle."""
    g = torch.Generator().manual_seed(seed)
    label = torch.randint(0, 10, (n,), generator=g)
    centre = torch.randint(5, size - 5, (n, 2), generator=g).float()
    r = torch.randint(3, 6, (n, 1, 1), generator=g).float()
    grid = torch.arange(size).float()
    dx = (grid.view(1, 1, size) - centre[:, 0].view(n, 1, 1)).expand(n, size, size)
    dy = (grid.view(1, size, 1) - centre[:, 1].view(n, 1, 1)).expand(n, size, size)
    ax, ay, radius = dx.abs(), dy.abs(), (dx ** 2 + dy ** 2).sqrt()
    box, hbar, vbar = (ax <= r) & (ay <= r), (ay <= 1) & (ax <= r), (ax <= 1) & (ay <= r)
    masks = [box, box & (torch.maximum(ax, ay) >= r - 1), radius <= r, (radius <= r) & (radius >= r - 1.3),
             hbar, vbar, hbar | vbar, box & (((dx - dy).abs() <= 1) | ((dx + dy).abs() <= 1)),
             box & ((dx - dy).abs() <= 1), (dy <= r) & (dy >= -r) & (ax <= (dy + r) / 2)]
    mask = torch.stack(masks, 1)[torch.arange(n), label].float()
    colour = torch.rand(n, 3, 1, 1, generator=g) * 0.8 + 0.4
    images = mask.unsqueeze(1) * colour + noise * torch.randn(n, 3, size, size, generator=g)
    return TensorDataset(images - 0.2, label)


def get_data(name, train, root):
    """shapes: 4096 training and 1024 test images, from two seeds; or CIFAR-10, in root."""
    if name == "shapes":
        return shapes(4096, seed=0) if train else shapes(1024, seed=1)
    from torchvision import datasets, transforms
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.49, 0.48, 0.45), (0.25, 0.24, 0.26))])
    return datasets.CIFAR10(root, train=train, download=False, transform=tf)


class SmallCNN(nn.Module):
    """conv-BN-ReLU-pool twice, then a linear classifier."""

    def __init__(self, image_size=16, width=16, num_classes=10):
        super().__init__()
        block = lambda cin, cout: [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                                   nn.ReLU(), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*block(3, width), *block(width, 2 * width))
        self.classifier = nn.Linear(2 * width * (image_size // 4) ** 2, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


if __name__ == "__main__":
    main()
