"""Lesson 11, the capstone: a small GPT on the standard library's own .py files, with DDP.
The model is in gpt_model.py, beside this file, as nanoGPT (https://github.com/karpathy/nanoGPT) has train.py and model.py.

    torchrun --standalone --nproc-per-node 2 gpt_ddp.py --steps 60
Byte-level (vocabulary 256), so no tokenizer and no download. Every line that makes it
distributed is marked # DDP. Each optimizer step sees --global-batch windows of --block
bytes, at any world size. Lines marked # course are the course's logging and timing; where
ddp_lesson is not installed they do nothing, and files are saved in the current folder.
"""
import argparse
import collections
import contextlib
import glob
import math
import os
import sysconfig
import time

# threads that wait for work sleep instead of spinning (OpenMP reads this when torch loads it): a
# rank's CPU time is then its work, which section 6 compares across world sizes, and ranks that
# share cores do not burn each other's time
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from gpt_model import GPT, flops_per_token, generate  # the model, in the file beside this one

try:  # course: the course's logging, step timer, peak FLOP/s and all-reduce sweep
    from ddp_lesson.rank import costmodel, metrics, peaks  # course
except ImportError:  # course: outside the course: nothing logged or timed, files saved here
    from pathlib import Path  # course
    class metrics:  # course
        log = lambda step, **values: None  # course
        run_dir = lambda: Path(".")  # course
        class StepTimer:  # course: times nothing
            def __init__(self, model, opt): pass  # course
            def timed_loader(self, loader): return loader  # course
            def backward_done(self): pass  # course
            def lap(self): return {}  # course
    class peaks:  # course: no peak, so no MFU
        peak_rate = lambda device, dtype: (None, "no peak: the course's ddp_lesson.rank.peaks has them", {})  # course
        achievable_rate = lambda device, dtype, window_s: ([], [])  # course
    costmodel = None  # course



def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40, help="optimizer steps of the schedule")
    p.add_argument("--stop-at", type=int, default=0, help="end this run at this step (0: --steps)")
    p.add_argument("--global-batch", type=int, default=24, help="windows per optimizer step, all ranks")
    p.add_argument("--micro-batch", type=int, default=1, help="windows per forward, per rank")
    p.add_argument("--block", type=int, default=64, help="bytes per window (context length)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=192, help="d_model")
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing, block by block")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the GPT before DDP (inductor: on CPU it needs a C++ compiler); compare tokens/s")
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm")
    p.add_argument("--amp", choices=["auto", "bf16", "fp16", "off"], default="auto",
                   help="auto: fp16 + GradScaler on GPUs; bf16 on CPUs where it is faster than fp32")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-windows", type=int, default=96, help="validation windows per evaluation")
    p.add_argument("--save-at", default="", help="steps to checkpoint at, e.g. 30,60")
    p.add_argument("--resume", default="", help="a checkpoint to continue from (any world size)")
    p.add_argument("--sample-bytes", type=int, default=200, help="generated at the end (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-windows", type=int, default=0, help="train on the first n windows only (0: all)")
    p.add_argument("--allreduce-sweep", action="store_true", help="time all-reduces at the end (alpha-beta fit)")
    p.add_argument("--fsdp-check", type=int, default=0,
                   help="at the end: this many steps with DDP, then with FSDP2, from the seed (0: none)")
    return p.parse_args(argv)


# -- data: the standard library's own sources, as bytes ------------------------------------
def stdlib_bytes():
    """The top-level .py files of this Python's standard library, sorted by name, joined."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    return b"".join(open(f, "rb").read() for f in files), len(files)


def split(text, val_fraction=0.1):
    """The first 90% of the bytes train, the last 10% validate (whole files mostly)."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(len(data) * (1 - val_fraction))
    return data[:cut], data[cut:]


class Windows(Dataset):
    """Non-overlapping windows: x = bytes [i*T, i*T+T), y = the same shifted by one, and i."""

    def __init__(self, data, block):
        self.data, self.block = data, block

    def __len__(self):
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i):
        chunk = self.data[i * self.block: (i + 1) * self.block + 1]
        return chunk[:-1], chunk[1:], i


def matmul_s(a, b, tries=5, budget_s=1.0):
    """Seconds of one a @ b: the best of up to `tries` timings, fewer once `budget_s` is spent."""
    a @ b
    best, start = math.inf, time.perf_counter()
    for _ in range(tries):
        t = time.perf_counter()
        a @ b
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() - start > budget_s:
            break
    return best


def make_optimizer(model, lr, fused=False):
    """AdamW as nanoGPT's configure_optimizers sets it up: betas (0.9, 0.95), weight decay 0.1
    on the matrices (parameters of 2 or more dims: the Linear weights and the embeddings) and
    none on the biases and LayerNorm gains. fused=True: one kernel for all parameters (CPU and
    CUDA in this torch; the run passes it for plain tensors, FSDP2's shards keep the default)."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), **({"fused": True} if fused else {}))


def lr_at(step, args):
    """Linear warm-up, then cosine down to a tenth (as nanoGPT)."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    done = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, done))))


def evaluate(model, val_set, n_windows, rank, world_size, device, autocast):
    # DDP: a plain split rank::world_size counts every validation window exactly once
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)   # [loss summed over tokens, tokens]
    with torch.no_grad(), autocast():
        for i in range(rank, min(n_windows, len(val_set)), world_size):
            x, y, _ = val_set[i]
            logits = model(x[None].to(device))
            sums[0] += F.cross_entropy(logits.float().view(-1, 256), y.to(device), reduction="sum")
            sums[1] += y.numel()
    dist.all_reduce(sums)  # DDP: token-weighted: add the sums over ranks, then divide
    model.train()
    return (sums[0] / sums[1]).item(), int(sums[1].item())


# -- FSDP2 as used for a transformer, against DDP in the same ranks (--fsdp-check) ------------
def shard_fsdp2(model, param_dtype=None):
    """FSDP2: each rank keeps 1/W of every weight. Each block is its own unit: its weights are
    all-gathered just before its forward (and again before its backward), freed after, and its
    gradients reduce-scattered, so only a block or two are whole at any time. The root unit holds the
    rest (embeddings, tied to the head, and the last LayerNorm). Mixed precision: the gathered
    weights and the compute in param_dtype, the gradients reduced in fp32; the optimizer keeps
    the fp32 shards."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)  # FSDP2: one all-gather and one reduce-scatter per block
    fully_shard(model, mp_policy=mp)      # FSDP2: the root, last (it stays gathered from forward to backward)
    return model


def clip_local_shards(params, max_norm):
    """A MISTAKE, kept to show what the check catches: each rank clips its shards by the norm
    of its own shards, not of the whole gradient. No collective, and a different clip per rank."""
    grads = [p.grad.to_local() for p in params]          # this rank's pieces (views of the shards)
    norm = torch.nn.utils.get_total_norm(grads)
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def fsdp_check(args, train_set, accum, device, rank):
    """--fsdp-check steps from the seed on the run's first windows, four times in these ranks:
    DDP; FSDP2 in fp32; FSDP2 computing in bf16; FSDP2 with the local-clip mistake. fp32
    throughout otherwise (no autocast). Logs each step's loss and gradient norms, and the
    collectives the clip issued; rank 0 saves each model's whole weights (fsdp_check.pt)."""
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t   # FSDP2: gathers a DTensor whole
    weights = {}
    for variant in ("ddp", "fsdp2_fp32", "fsdp2_bf16", "fsdp2_local_clip"):
        torch.manual_seed(args.seed)
        model = GPT(args.layers, args.heads, args.width, args.block).to(device)
        if variant == "ddp":
            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)  # DDP
        else:
            shard_fsdp2(model, torch.bfloat16 if variant == "fsdp2_bf16" else None)   # FSDP2
        params = list(model.parameters())     # FSDP2: DTensors, each rank holding its Shard(0)
        held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in params)
        opt = make_optimizer(model, args.lr)  # FSDP2: after fully_shard, so it steps the fp32 shards
        sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)   # epoch 0, as the run began
        batches = iter(DataLoader(train_set, batch_size=args.micro_batch, sampler=sampler, drop_last=True))
        for step in range(1, args.fsdp_check + 1):
            for g in opt.param_groups:
                g["lr"] = lr_at(step - 1, args)
            sums = torch.zeros(2, dtype=torch.float64, device=device)
            # step 1's forwards and backwards, with every collective they issue counted
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if step == 1 \
                    else contextlib.nullcontext() as step_prof:
                for i in range(accum):
                    x, y, _ = next(batches)
                    last = i == accum - 1
                    if variant != "ddp":
                        model.set_requires_gradient_sync(last)  # FSDP2: its no_sync: reduce-scatter on the last only
                    with contextlib.nullcontext() if last or variant != "ddp" else model.no_sync():
                        loss = F.cross_entropy(model(x.to(device)).float().view(-1, 256), y.to(device).view(-1))
                        (loss / accum).backward()
                    sums[0] += loss.detach().double() * y.numel()
                    sums[1] += y.numel()
            local = torch.nn.utils.get_total_norm([p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                                                   for p in params])   # this rank's pieces only, before the clip
            # the clip, with every collective it issues counted (torch.profiler sees c10d's ops)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                if variant == "fsdp2_local_clip":
                    norm = clip_local_shards(params, args.clip)
                else:   # DDP: local, every rank has the whole averaged gradient. FSDP2: one all-reduce
                    norm = torch.nn.utils.clip_grad_norm_(params, args.clip)   # of the shards' partial norms
            count = lambda prof: dict(collections.Counter(e.name for e in prof.events() if e.name.startswith("c10d::")))
            clipped = full(torch.nn.utils.get_total_norm([p.grad for p in params]))   # after the clip
            opt.step()
            opt.zero_grad(set_to_none=True)
            dist.all_reduce(sums)  # DDP: for the log only
            metrics.log(step, fsdp_variant=variant, check_loss=sums[0] / sums[1], check_grad_norm=full(norm),
                        local_norm=local, clipped_norm=clipped, clip_collectives=count(prof),
                        **({"param_bytes_held": held, "step_collectives": count(step_prof)} if step == 1 else {}))
        state = (model.module if variant == "ddp" else model).state_dict()
        state = {k: full(v).detach().cpu().clone() for k, v in state.items()}   # FSDP2: all ranks gather
        if rank == 0:
            weights[variant] = state
        del model, opt
    if rank == 0:
        torch.save(weights, metrics.run_dir() / "fsdp_check.pt")
    dist.barrier()  # DDP: nobody reads the file before rank 0 has written it


@record  # DDP: a failing rank's traceback reaches torchrun's error summary
def main():
    args = parse_args()
    if args.allreduce_sweep and costmodel is None:  # course
        raise SystemExit("--allreduce-sweep needs the course's ddp_lesson.rank.costmodel")  # course
    rank = int(os.environ["RANK"])                # DDP: global rank, set by torchrun
    local_rank = int(os.environ["LOCAL_RANK"])    # DDP: rank on this machine -> which GPU
    world_size = int(os.environ["WORLD_SIZE"])    # DDP: number of processes in the job
    if args.global_batch % (args.micro_batch * world_size):  # DDP: refuse a world size that cannot give it
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of --micro-batch "
                         f"{args.micro_batch} x {world_size} ranks.")
    accum = args.global_batch // (args.micro_batch * world_size)  # DDP: micro-batches per rank per step
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")  # DDP: nccl on GPUs, gloo on CPUs
    if use_cuda:
        torch.cuda.set_device(local_rank)                    # DDP: one GPU per process
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")

    # mixed precision: fp16 needs a GradScaler (small gradients underflow); bf16 does not
    probe = {}
    if args.amp == "auto" and use_cuda:
        args.amp = "fp16"
    elif args.amp == "auto":  # bf16 pays only where the CPU has a fast bf16 matmul: measure it
        for dt in (torch.bfloat16, torch.float32):
            a = torch.randn(128, 128, dtype=dt)
            probe[f"matmul_s_{str(dt).split('.')[-1]}"] = matmul_s(a, a, tries=3)
        faster = torch.tensor([float(probe["matmul_s_bfloat16"] < 0.8 * probe["matmul_s_float32"])])
        dist.all_reduce(faster, op=dist.ReduceOp.MIN)  # DDP: every rank must choose the same
        args.amp = "bf16" if faster.item() else "off"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp, torch.float32)
    autocast = lambda: torch.autocast(device.type, dtype=dtype, enabled=args.amp != "off")
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    peak, peak_source, peak_inputs = peaks.peak_rate(device, dtype)  # course: MFU's denominator, the hardware's peak

    text, n_files = stdlib_bytes()
    train_data, val_data = split(text)
    if args.train_windows:  # a small epoch, for tests
        train_data = train_data[:args.train_windows * args.block + 1]
    train_set, val_set = Windows(train_data, args.block), Windows(val_data, args.block)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)  # DDP: a shard per rank
    loader = DataLoader(train_set, batch_size=args.micro_batch, sampler=sampler, drop_last=True)
    steps_per_epoch = len(train_set) // args.global_batch   # the same at any world size
    if args.fsdp_check > steps_per_epoch:  # its steps read one epoch's windows
        raise SystemExit(f"--fsdp-check {args.fsdp_check}: more steps than the {steps_per_epoch} of an epoch")

    torch.manual_seed(args.seed)   # the same init everywhere (DDP(...) would broadcast rank 0's anyway)
    model = GPT(args.layers, args.heads, args.width, args.block, checkpoint=args.checkpoint).to(device)
    fpt = flops_per_token(model, args.layers, args.width, args.block)
    opt = make_optimizer(model, args.lr, fused=True)   # one kernel: on CPU ranks about 2 ms less per step
    step = 0
    if args.resume:  # weights, optimizer and scaler state, and the step: nothing depends on world size
        ckpt = torch.load(args.resume, map_location=device, weights_only=True)  # DDP: onto this rank's device
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        scaler.load_state_dict(ckpt["scaler"])
        step = ckpt["step"]
    gpt = model                                   # the GPT itself: what checkpoints save and sampling runs
    if args.compile:                              # compile first, then DDP (lesson 10)
        model = torch.compile(model)
    model = DDP(model, device_ids=[local_rank] if use_cuda else None)  # DDP: broadcasts rank 0's weights
    timer = metrics.StepTimer(model, opt)  # course: data / compute / waiting for the others; changes nothing
    loader = timer.timed_loader(loader)  # course: also times the loading of each batch (data_s)
    if rank == 0:
        print(f"world_size={world_size} data: {n_files} files, {len(train_data):,} train bytes, "
              f"{len(val_data):,} val bytes; {sum(p.numel() for p in model.parameters()):,} params; "
              f"amp={args.amp}; {accum} micro-batches of {args.micro_batch} per rank per step", flush=True)
    metrics.log(step, params=sum(p.numel() for p in model.parameters()), flops_per_token=fpt,  # course
                peak_flops=peak, peak_source=peak_source, **peak_inputs, amp=args.amp, micro_batch=args.micro_batch,  # course
                accum=accum, global_batch_asked=args.global_batch, train_windows=len(train_set),  # course
                train_bytes=len(train_data), val_bytes=len(val_data), files=n_files, **probe)  # course

    save_at = {int(s) for s in args.save_at.split(",") if s}
    step_times = []
    stop = args.stop_at or args.steps
    while step < stop:
        epoch, done_in_epoch = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        batches = iter(loader)
        for _ in range(done_in_epoch * accum):  # resuming mid-epoch: skip what was trained on
            next(batches)
        for _ in range(done_in_epoch, steps_per_epoch):
            t0, c0 = time.perf_counter(), time.process_time()   # wall clock; CPU time of all this rank's threads
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            sums = torch.zeros(2, dtype=torch.float64, device=device)  # [loss x tokens, tokens]
            ids = []                                                   # this rank's windows, this step
            for i in range(accum):
                x, y, idx = next(batches)
                x, y = x.to(device), y.to(device)
                # DDP: no all-reduce on all but the last micro-batch; gradients add up locally
                with contextlib.nullcontext() if i == accum - 1 else model.no_sync():
                    with autocast():
                        logits = model(x)
                    loss = F.cross_entropy(logits.float().view(-1, 256), y.view(-1))
                    # the mean over this micro-batch's tokens; every window has --block targets, so
                    # / accum here and DDP's average over ranks make it the mean over the step's tokens
                    scaler.scale(loss / accum).backward()
                sums[0] += loss.detach().double() * y.numel()   # no .item(): no wait for the GPU
                sums[1] += y.numel()
                ids += idx.tolist()
            timer.backward_done()  # course: the all-reduce is done; what follows is not waiting
            if use_cuda:
                torch.cuda.synchronize(device)   # the queued micro-batch kernels belong to micro_s, not the fixed part
            micro_s, micro_cpu_s = time.perf_counter() - t0, time.process_time() - c0   # the micro-batches' share
            scaler.unscale_(opt)  # true gradients before clipping (no-op without fp16)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # before clipping
            scaler.step(opt)      # skips the step if fp16 gradients overflowed
            scaler.update()
            opt.zero_grad(set_to_none=True)
            step += 1
            dist.all_reduce(sums)  # DDP: for the log only: token-weighted loss over all ranks
            tokens = len(ids) * args.block                       # this rank's tokens this step
            if use_cuda:
                torch.cuda.synchronize(device)                   # the step's kernels are done
            step_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
            times = timer.lap()  # course: data_s, compute_s, wait_s, mem_mb
            step_times.append(step_s)
            scale = {"scale": scaler.get_scale()} if scaler.is_enabled() else {}  # fp16: for the next step
            metrics.log(step, loss=sums[0] / sums[1], grad_norm=grad_norm, windows=len(ids), window_ids=ids,  # course
                        lr=lr_at(step - 1, args), tokens_per_s=tokens / step_s,  # course
                        **({"mfu": fpt * tokens / step_s / peak} if peak else {}), step_s=step_s, cpu_s=cpu_s,  # course
                        micro_s=micro_s, micro_cpu_s=micro_cpu_s, epoch=epoch, **scale, **times)  # course
            if step % args.eval_every == 0 or step == stop:
                val_loss, val_tokens = evaluate(model, val_set, args.eval_windows, rank, world_size, device, autocast)
                metrics.log(step, val_loss=val_loss, val_tokens=val_tokens)  # course
                timer.lap()  # course: evaluation time is not the next step's
                if rank == 0:
                    print(f"step {step}: loss {(sums[0] / sums[1]).item():.3f} val {val_loss:.3f} "
                          f"{tokens / step_s:,.0f} tok/s/rank", flush=True)
            if step in save_at:
                path = f"ckpt_{step}.pt"
                path = metrics.run_dir() / path  # course: in the run's folder, where the notebook looks
                if rank == 0:  # DDP: one writer; the inner model, without the "module." prefix
                    torch.save({"model": gpt.state_dict(), "opt": opt.state_dict(),
                                "scaler": scaler.state_dict(), "step": step, "args": vars(args)}, path)
                dist.barrier()  # DDP: nobody reads the checkpoint before rank 0 has written it
            if step >= stop:
                break

    if step_times:  # course: a matmul's rate over windows as long as a median step, all ranks at once as in training
        median_s = sorted(step_times)[len(step_times) // 2]  # course
        rates, cpu_rates = peaks.achievable_rate(device, dtype, min(1.0, median_s))  # course
        metrics.log(step, achievable_flops=rates, achievable_flops_per_cpu_s=cpu_rates)  # course
    if args.fsdp_check:  # FSDP2 against DDP, in the same ranks, from the same seed
        fsdp_check(args, train_set, accum, device, rank)
    if args.allreduce_sweep:  # course: the same ranks, after training: what one all-reduce of b bytes costs
        for b, seconds in costmodel.sweep(costmodel.QUICK_SIZES, iters=6, device=device):  # course: all ranks
            metrics.log(step, bytes=b, seconds=seconds)  # course
    if rank == 0 and args.sample_bytes:  # one rank writes the sample
        with autocast():
            # DDP: the model inside the wrapper: one rank alone must not run DDP's forward,
            # which can start a collective (a broadcast of buffers) the other ranks never join
            sample = generate(gpt, b"def ", args.sample_bytes, device, seed=args.seed)
        print("--- sample ---\n" + sample, flush=True)
        metrics.log(step, sample=sample)  # course
    dist.destroy_process_group()  # DDP


if __name__ == "__main__":
    main()
