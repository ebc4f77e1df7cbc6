"""Notebook 03's starting point: a plain single-process training script, no DDP.

    python train_single.py --epochs 2
Notebook 03 shows ddp_basic.py, this script made distributed; show_diff prints the lines that differ.
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

from ddp_lesson.rank import data, metrics, models


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--warmup-steps", type=int, default=0, help="linear lr warm-up")
    p.add_argument("--train-samples", type=int, default=4096, help="use fewer to run faster")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", default="shapes", choices=["shapes", "cifar10"])
    p.add_argument("--data-root", default="data", help="where cifar10 is, in torchvision's format")
    return p.parse_args()


def evaluate(model, test_set, device):
    model.eval()
    counts = torch.zeros(2, device=device)  # [correct, seen]
    with torch.no_grad():
        for x, y in DataLoader(test_set, batch_size=256):
            x, y = x.to(device), y.to(device)
            counts[0] += (model(x).argmax(1) == y).sum()
            counts[1] += len(y)
    model.train()
    return (counts[0] / counts[1]).item(), int(counts[1].item())  # accuracy, samples counted


def main():
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if use_cuda else "cpu")
    torch.manual_seed(args.seed)

    train_set = Subset(data.get(args.dataset, train=True, root=args.data_root), range(args.train_samples))
    test_set = data.get(args.dataset, train=False, root=args.data_root)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)

    model = models.SmallCNN(image_size=data.IMAGE_SIZE[args.dataset]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    warmup = lambda step: min(1.0, (step + 1) / args.warmup_steps) if args.warmup_steps else 1.0
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)

    step = 0
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            acc = (out.argmax(1) == y).float().mean()
            row = dict(loss=loss, train_accuracy=acc, lr=sched.get_last_lr()[0], epoch=epoch)
            metrics.log(step, **row)
            done = (i + 1) * 20 // len(loader)
            print(f"\repoch {epoch + 1}/{args.epochs} [{'#' * done}{'.' * (20 - done)}] "
                  f"loss {loss.item():.3f}", end="", flush=True)
        epoch_s = time.perf_counter() - t0
        test_acc, test_samples = evaluate(model, test_set, device)
        metrics.log(step, test_accuracy=test_acc, test_samples=test_samples, epoch_s=epoch_s, epoch=epoch)
        print(f"  test accuracy {test_acc:.1%} ({epoch_s:.1f} s)", flush=True)

    ckpt = metrics.checkpoint_path()
    torch.save(model.state_dict(), ckpt)
    state = torch.load(ckpt, map_location=device, weights_only=True)
    plain = models.SmallCNN(image_size=data.IMAGE_SIZE[args.dataset]).to(device)
    plain.load_state_dict(state)


if __name__ == "__main__":
    main()
