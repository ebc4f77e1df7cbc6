"""Check (notebook 04): SyncBatchNorm over N ranks of batch b == BatchNorm over the N*b batch.

Every rank builds the same global batch, feeds its own b samples through SyncBatchNorm and,
as the reference, the whole batch through a plain BatchNorm2d. Also times a DDP training
step of SmallCNN with BatchNorm vs SyncBatchNorm, side by side. Writes syncbn.json.
On GPUs this is PyTorch's nn.SyncBatchNorm over nccl; on CPU ranks (gloo) the course's
stand-in, ddp_lesson.rank.syncbn, because nn.SyncBatchNorm refuses CPU tensors.

It also records what the first BN layer of SmallCNN sees at step 1 of notebook 04's runs (the
same weights and each rank's first batch): one channel's values on each rank, the statistics
plain BatchNorm computes on each rank's own batch and those SyncBatchNorm computes over all
ranks. Notebook 04 draws them (diagrams.bn_statistics).

Then, in the same launch (one launch instead of three), the two runs notebook 04 compares
with ddp_syncbn.py --sync-bn, with plain BatchNorm: one process on the global batch of
b x world (rank 0 alone, the other ranks wait), then DDP on every rank with b each. They run
`train` below, a copy of the training loop of the lesson script lessons/ddp_syncbn.py (data, order,
seeds, optimizer, lr warm-up, its `evaluate`), without its step timer, logging and checkpoint:
an edit to notebook 04's work/ddp_syncbn.py does not reach them. Writes reference_runs.json.
    torchrun --standalone --nproc-per-node 2 syncbn_stats.py --batch-size 4 --epochs 2
"""
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from ddp_lesson.rank import bundled, data, metrics, models, syncbn


LESSON = bundled.load(bundled.script("ddp_syncbn.py"))  # the lesson script (not work/'s copy), for `train`


def parse_args():
    """ddp_syncbn.py's own options and defaults, so that `train` copies a run of it (--batch-size is b)."""
    return LESSON.parse_args()


def step_ms(model, x, y, steps=5):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    sync()  # on GPUs: wait for queued work, so that the clock measures the steps themselves
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    sync()
    return 1000 * (time.perf_counter() - t0) / steps


def unbiased_ref(full, momentum, passes, n):
    """running_var after `passes` training passes, from its definition: starts at 1, moves
    by `momentum` towards the global batch variance times Bessel's n/(n-1)."""
    var = full.transpose(0, 1).reshape(full.size(1), -1).var(dim=1, unbiased=False) * n / (n - 1)
    running = torch.ones_like(var)
    for _ in range(passes):
        running = (1 - momentum) * running + momentum * var
    return running


def to_sync_bn(module, device):
    """PyTorch's SyncBatchNorm for GPU tensors, the course's CPU version for CPU tensors."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return syncbn.convert_sync_batchnorm(module)


def batch_statistics(layer, x, ranks):
    """Per channel (mean, biased var) that a BN layer normalised x with, read back from the
    layer itself: with momentum 1 its running statistics are that batch's (the variance stored
    unbiased, n/(n-1), with n the values per channel over `ranks` ranks)."""
    layer.momentum = 1.0
    layer(x)
    n = x.numel() // x.size(1) * ranks
    return layer.running_mean.clone(), layer.running_var * (n - 1) / n


def first_bn_picture(args, device):
    """Step 1 of notebook 04's runs at the first BN layer: rank 0's initial weights (what DDP
    broadcasts) and this rank's first batch from the DistributedSampler. Of its channels, the
    one where some rank's statistics lie furthest from the global ones."""
    torch.manual_seed(args.seed)
    conv = models.SmallCNN().features[0].to(device)
    train_set = Subset(data.shapes_split(train=True), range(args.train_samples))
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    sampler.set_epoch(0)
    idx = list(sampler)[:args.batch_size]
    with torch.no_grad():
        x = conv(torch.stack([train_set[i][0] for i in idx]).to(device))
    c = x.size(1)
    mean, var = batch_statistics(nn.BatchNorm2d(c).to(device), x, 1)
    sync = to_sync_bn(nn.Sequential(nn.BatchNorm2d(c)), device)[0].to(device)
    g_mean, g_var = batch_statistics(sync, x, dist.get_world_size())
    far = (mean - g_mean).abs() / g_var.sqrt() + (var / g_var - 1).abs()
    dist.all_reduce(far, op=dist.ReduceOp.MAX)  # the same channel on every rank
    ch = int(far.argmax())
    return {"channel": ch, "values": x[:, ch].reshape(-1).tolist(),
            "rank_stats": [mean[ch].item(), var[ch].item()],
            "sync_stats": [g_mean[ch].item(), g_var[ch].item()]}


def train(model, train_set, sampler, batch, args, device, accuracy):
    """A copy of the reference ddp_syncbn.py's training loop, without its step timer, logging
    and checkpoint: the loss of every step, the test accuracy after every epoch."""
    loader = DataLoader(train_set, batch_size=batch, sampler=sampler, drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    warmup = lambda step: min(1.0, (step + 1) / args.warmup_steps) if args.warmup_steps else 1.0
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    losses, accuracies = [], []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
        accuracies.append(accuracy(model))
    return {"loss": losses, "test_accuracy": accuracies}


def reference_runs(args, rank, world, device, ids):
    """Section 3's two reference runs (the module's docstring); only rank 0's result has both."""
    evaluate = LESSON.evaluate

    train_set = Subset(data.shapes_split(train=True), range(args.train_samples))
    test_set = data.shapes_split(train=False)
    out = {}
    if rank == 0:  # one process, batch b x world: no DDP, no process group in its evaluation
        torch.manual_seed(args.seed)  # ddp_syncbn.py's rank 0 seed: the same initial weights
        model = models.SmallCNN().to(device)
        sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=args.seed)
        x_test, y_test = (t.to(device) for t in test_set.tensors)

        def accuracy(m):
            m.eval()
            with torch.no_grad():
                acc = (m(x_test).argmax(1) == y_test).float().mean().item()
            m.train()
            return acc
        out["1 process"] = train(model, train_set, sampler, args.batch_size * world, args, device, accuracy)
    dist.barrier()  # the other ranks waited
    torch.manual_seed(args.seed + rank)  # as ddp_syncbn.py: DDP(...) makes the weights equal
    model = DDP(models.SmallCNN().to(device), device_ids=ids)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    run = train(model, train_set, sampler, args.batch_size, args, device,
                lambda m: evaluate(m, test_set, rank, world, device)[0])
    losses = torch.tensor(run["loss"], device=device)
    dist.all_reduce(losses)  # the mean over ranks of each step's loss
    out["DDP, BN"] = {"loss": (losses / world).tolist(), "test_accuracy": run["test_accuracy"]}
    return out


def main():
    args = parse_args()
    B = args.batch_size  # per rank
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    torch.manual_seed(0)
    full = (torch.randn(world * B, 8, 5, 5) * 3 + 1).to(device)  # the same global batch on every rank
    mine = full[rank * B:(rank + 1) * B]

    bn = nn.BatchNorm2d(8).to(device)
    sync = to_sync_bn(nn.Sequential(copy.deepcopy(bn)), device)[0]
    local = copy.deepcopy(bn)
    weights = torch.randn(world * B, 8, 5, 5, generator=torch.Generator().manual_seed(1)).to(device)
    for _ in range(3):  # three training-mode passes update the running statistics
        mine_x, full_x = mine.clone().requires_grad_(), full.clone().requires_grad_()
        out_sync = sync(mine_x)
        out_local = local(mine)
        out_ref = bn(full_x)
    (out_sync * weights[rank * B:(rank + 1) * B]).sum().backward()  # backward sums over ranks too
    (out_ref * weights).sum().backward()
    agree = lambda a, b: torch.allclose(a, b, atol=1e-4)
    n_all = full.numel() // full.size(1)  # values per channel over all ranks
    result = {
        "rank": rank, "per_rank_batch": B, "world_size": world, "backend": dist.get_backend(),
        "device": str(device), "sync_class": type(sync).__module__ + "." + type(sync).__name__,
        "sync_mean_matches_big_batch": agree(sync.running_mean, bn.running_mean),
        "sync_var_matches_big_batch": agree(sync.running_var, bn.running_var),
        "sync_output_matches_big_batch": agree(out_sync, out_ref[rank * B:(rank + 1) * B]),
        "sync_input_grad_matches_big_batch": agree(mine_x.grad, full_x.grad[rank * B:(rank + 1) * B]),
        "plain_bn_mean_matches_big_batch": agree(local.running_mean, bn.running_mean),
        "plain_bn_mean_abs_diff": (local.running_mean - bn.running_mean).abs().max().item(),
        # running_var is unbiased with n = the GLOBAL count: var_biased * n / (n - 1)
        "running_var_unbiased_global_n": agree(sync.running_var, unbiased_ref(full, bn.momentum, 3, n_all)),
        "running_var_matches_local_n": agree(sync.running_var, unbiased_ref(full, bn.momentum, 3, n_all // world)),
        "sync_mean_abs_diff": (sync.running_mean - bn.running_mean).abs().max().item(),
    }

    result["first_bn"] = first_bn_picture(args, device)

    # Cost: one DDP step with BatchNorm vs SyncBatchNorm at this per-rank batch.
    x, y = (t.to(device) for t in data.shapes(B, seed=rank).tensors)
    ids = [local_rank] if use_cuda else None
    plain = DDP(models.SmallCNN().to(device), device_ids=ids)
    synced = DDP(to_sync_bn(models.SmallCNN(), device).to(device), device_ids=ids)
    times = {"bn": [], "syncbn": []}
    for _ in range(3):
        times["bn"].append(step_ms(plain, x, y))
        times["syncbn"].append(step_ms(synced, x, y))
    result["ms_per_step_bn"] = min(times["bn"])
    result["ms_per_step_syncbn"] = min(times["syncbn"])

    results = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        metrics.save_json("syncbn.json", results)

    ref = reference_runs(args, rank, world, device, ids)
    if rank == 0:
        metrics.save_json("reference_runs.json",
                          {"world_size": world, "per_rank_batch": B, "args": vars(args), "runs": ref})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
