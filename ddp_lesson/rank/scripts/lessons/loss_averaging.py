"""Per-rank loss beside the reduced loss, and accuracy counted right (notebook 03c).

    torchrun --standalone --nproc-per-node 2 loss_averaging.py --epochs 1

Each rank logs its own loss and the norm of its averaged gradient every step. After backward,
the loss is all-reduced FOR THE LOG ONLY (DDP already averaged the gradients; the loss that went
into backward is untouched).
Accuracy: each rank counts correct answers and samples; the counts are summed over ranks,
then divided. A common mistake (divide by the padded DistributedSampler total_size) is logged
beside it as test_accuracy_padded, to compare. The set-up lines are notebook 03's ddp_basic.py.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from ddp_lesson.rank import data, metrics, models


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--n-train", type=int, default=2048)
    p.add_argument("--n-test", type=int, default=1003, help="not a multiple of most world sizes")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def count_correct(model, loader, device):
    """[correct, seen] on this rank, as a tensor ready for all_reduce."""
    model.eval()
    counts = torch.zeros(2, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            counts[0] += (model(x).argmax(1) == y).sum()
            counts[1] += len(y)
    model.train()
    return counts


@record  # DDP: a failing rank's traceback reaches torchrun's error summary
def main():
    args = parse_args()
    rank = int(os.environ["RANK"])                # DDP: global rank, set by torchrun
    local_rank = int(os.environ["LOCAL_RANK"])    # DDP: rank on this machine -> which GPU
    world_size = int(os.environ["WORLD_SIZE"])    # DDP: number of processes in the job
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")  # DDP: nccl on GPUs, gloo on CPUs
    if use_cuda:
        torch.cuda.set_device(local_rank)                    # DDP: one GPU per process
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    torch.manual_seed(args.seed + rank)  # different on purpose: DDP(...) makes the weights equal

    train_set = data.shapes(args.n_train, seed=0)
    test_set = data.shapes(args.n_test, seed=1)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)  # DDP: a shard per rank
    # The sampler gives every rank ceil(N / world_size) samples, so the ranks' batches are equal at
    # every step and DDP's average is exact, apart from the sampler's padding (duplicates count
    # twice); drop_last=True only drops each rank's short last batch.
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = models.SmallCNN(norm=False, width=8).to(device)
    model = DDP(model, device_ids=[local_rank] if use_cuda else None)  # DDP: broadcasts rank 0's weights
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)    # this rank's mean over its own batch
            opt.zero_grad(set_to_none=True)
            loss.backward()                        # DDP: the gradients are averaged here
            # the averaged gradient's length, the same on every rank; notebook 03c checks step 1's
            grad_norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
            opt.step()
            step += 1
            metrics.log(step, loss=loss.item(), grad_norm=grad_norm.item())  # one row per rank

            # For the log only: a copy of the loss, averaged over ranks after backward.
            reduced = loss.detach().clone()
            dist.all_reduce(reduced)  # DDP: sum over ranks
            reduced /= world_size
            if rank == 0:  # DDP: one rank logs the reduced loss and prints
                metrics.log(step, loss_reduced=reduced.item())
                print(f"step {step}: rank-0 loss {loss.item():.3f}, reduced {reduced.item():.3f}",
                      flush=True)

    # Accuracy, counted right: every test sample exactly once (a plain split rank::world_size, no
    # padding), counts summed over ranks, then one division. model(x) is DDP's forward, but this
    # model has no buffers, so it sends nothing and the ranks may run different numbers of batches.
    # With BatchNorm, as in notebook 03's script, its first forward here broadcasts rank 0's
    # buffers: then every rank needs a batch.
    shard = Subset(test_set, range(rank, len(test_set), world_size))
    counts = count_correct(model, DataLoader(shard, batch_size=256), device)
    dist.all_reduce(counts)  # DDP: sum the counts over ranks
    correct, total = counts.tolist()

    # The common mistake: a padded DistributedSampler, divided by its total_size.
    padded = DistributedSampler(test_set, shuffle=False)
    padded_counts = count_correct(model, DataLoader(test_set, batch_size=256, sampler=padded), device)
    dist.all_reduce(padded_counts)  # DDP
    accuracy_padded = padded_counts[0].item() / padded.total_size

    if rank == 0:  # DDP: one rank logs the totals and saves
        metrics.log(step, test_accuracy=correct / total, test_samples=int(total), correct=int(correct),
                    total=int(total), test_accuracy_padded=accuracy_padded, padded_total=padded.total_size)
        print(f"test accuracy {correct / total:.4f} ({int(correct)}/{int(total)}); "
              f"padded way {accuracy_padded:.4f} over {padded.total_size}", flush=True)
        torch.save(model.module.state_dict(), metrics.checkpoint_path())  # the notebook checks it in one process
    dist.destroy_process_group()  # DDP


if __name__ == "__main__":
    main()
