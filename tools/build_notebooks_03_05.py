"""Builds notebooks 03-05 (stored without outputs). The %%writefile cells are filled from
ddp_lesson/scripts/, so the notebooks and the reference scripts cannot drift apart
(tests/test_scripts_in_sync.py checks it too).   python tools/build_notebooks_03_05.py"""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
SCRIPTS = REPO / "ddp_lesson" / "scripts"


def md(s):
    return new_markdown_cell(s.strip("\n"))


def code(s):
    return new_code_cell(s.strip("\n"))


def writefile(name):
    return new_code_cell(f"%%writefile work/{name}\n" + (SCRIPTS / name).read_text())


SETUP = '''
import json, os, sys, time, difflib
from pathlib import Path
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from IPython.display import display, Markdown
from ddp_lesson import launch, runs, plots
from ddp_lesson.widgets import RunPanel, DevicePicker

SCRIPTS = Path(launch.__file__).parent / "scripts"   # reference scripts and check scripts
os.makedirs("work", exist_ok=True)                     # the scripts you edit live here

def check(name, *args, nproc=2):
    """Start a check script on CPU ranks (gloo); returns the launch.Run at once."""
    return launch.start(SCRIPTS / f"{name}.py", nproc=nproc, cpu=True, args=args, timeout=600)

def verdict(run, filename):
    """Wait for a check run and read the JSON it wrote into its run directory."""
    result = run.wait()
    assert result["status"] == "ok", result.get("message")
    return json.loads((run.run_dir / filename).read_text())

def show_diff(old, new):
    """The lesson is the diff: what changed from the previous lesson's script."""
    a, b = (SCRIPTS / old).read_text().splitlines(), Path(new).read_text().splitlines()
    print("\\n".join(difflib.unified_diff(a, b, old, new, lineterm="", n=1)))

def show(fig):
    display(fig); plt.close(fig)
'''

# ---------------------------------------------------------------------------------------
nb03 = [
md('''
# 03 · DistributedDataParallel with torchrun

**Why.** `nn.DataParallel` (lesson 01) drives all devices from one Python process: one GIL,
a fresh copy of the model on every step, outputs gathered on device 0.
`DistributedDataParallel` (DDP) runs **one process per device**. Each process holds its own
copy of the model, trains on its own share of every batch, and during `backward()` the
processes average their gradients with an **all-reduce**. Every copy then takes the same
optimizer step, so the copies stay identical without ever being sent around.

**How.** A launcher (`torchrun`) starts the processes and tells each one who it is through
environment variables. A Jupyter kernel cannot be one of those processes, so this course
starts `torchrun` in a subprocess and watches its files.

In this notebook:
1. the whole DDP training script, line by line, and a run with live per-rank curves;
2. checkpoints: who writes, who waits, how to load;
3. `DistributedSampler.set_epoch`;
4. proof that 2 ranks train *exactly* like one process on the same global batch;
5. `find_unused_parameters`;
6. batch size and learning rate: the linear scaling rule with warm-up;
7. torchrun vs `torch.distributed.launch` vs `mp.spawn`;
8. an exercise.

On this machine a "device" is a CPU process using the `gloo` backend. With NVIDIA GPUs the
same script uses `nccl`, one GPU per process; nothing in it changes.
'''),
code(SETUP),
md('''
## 1 · The script

Everything distributed is marked `# DDP`. What torchrun gives each process:

| variable | meaning | on 2 CPU ranks |
|---|---|---|
| `RANK` | this process's number in the whole job | 0 or 1 |
| `LOCAL_RANK` | its number on this machine: which GPU it uses | 0 or 1 |
| `WORLD_SIZE` | how many processes in the job | 2 |
| `MASTER_ADDR`, `MASTER_PORT` | where rank 0 waits for the others to connect | 127.0.0.1, a free port |

`init_process_group` reads them, connects the processes, and picks the backend: `nccl` for
GPUs, `gloo` for CPUs. Each process seeds its RNG *differently* on purpose: we will see that
`DDP(...)` makes the weights equal anyway.

The next cell writes the script to `work/ddp_basic.py`. Edit it and rerun the cell and the
panel below to try your own changes.
'''),
writefile("ddp_basic.py"),
md('''
**The run panel.** Pick the processes (or GPUs), set the options, press **Run**. Curves are
per rank: each rank logs the loss and accuracy of *its own* share of the batch, so the two
lines differ a little even though the weights are identical.

(When the notebook runs unattended, the next code cell presses Run for you.)
'''),
code('''
panel = RunPanel("work/ddp_basic.py",
                 options={"epochs": 2, "batch-size": 32, "lr": 0.05, "train-samples": 2048},
                 picker=DevicePicker(), metrics=("loss", "accuracy"))
panel
'''),
code('''
panel.run()             # what the Run button does; returns at once
result = panel.wait()   # block here, updating the live plot, until the run ends
rec = runs.load(panel.run_dir)
print(result["status"], f"{result['duration_s']:.1f} s", "ranks:", rec.ranks())
print("test accuracy per epoch:", [round(a, 3) for _, a in rec.series("test_accuracy", rank=0)])
assert result["status"] == "ok", result.get("message")
assert rec.ranks() == list(range(rec.config["world_size"]))          # every rank logged
assert rec.series("test_accuracy", rank=0)[-1][1] > 0.5              # it learned something
print(panel.log_text.splitlines()[-1])                               # rank 0's progress line
'''),
md('''
Only rank 0 printed the progress bar; every rank logged metrics. The test accuracy is
computed by **adding up counts** over ranks (`all_reduce` of `[correct, seen]`) and then
dividing, not by averaging per-rank accuracies.

## 2 · Checkpoints: one writer, a barrier, `map_location`

At the end the script does three things in order:
1. **rank 0 only** saves `model.module.state_dict()`: the inner model, so the keys have no
   `module.` prefix and load into a plain model. Two ranks writing the same file can corrupt it.
2. `dist.barrier()`: no rank reads the file before rank 0 has finished writing it.
3. every rank loads it with `map_location=device`: a checkpoint written from `cuda:0` would
   otherwise be loaded onto `cuda:0` by *every* rank, piling all copies on one GPU.
'''),
code('''
from ddp_lesson import models
state = torch.load(panel.run_dir / "model.pt", map_location="cpu", weights_only=True)
print(list(state)[:4])
assert not any(k.startswith("module.") for k in state)   # saved from model.module
plain = models.SmallCNN()
plain.load_state_dict(state)                              # loads without any DDP wrapper
'''),
md('''
## 3 · `DistributedSampler` and `set_epoch`

`DistributedSampler` gives each rank a disjoint shard of the dataset. Its shuffle is seeded
by `seed + epoch`, and it only learns the epoch from `set_epoch(epoch)`. Forget that call
and **every epoch sees the same order**. Nothing crashes; the training just gets a little worse.
It costs nothing to look (no processes needed: a sampler only needs to be told its rank):
'''),
code('''
from torch.utils.data.distributed import DistributedSampler
s = DistributedSampler(range(16), num_replicas=2, rank=0, shuffle=True, seed=0)
print("without set_epoch:", [list(s) for _ in range(3)])
with_epoch = []
for epoch in range(3):
    s.set_epoch(epoch)
    with_epoch.append(list(s))
print("with set_epoch:   ", with_epoch)
'''),
md('''
## 4 · Does DDP really train like one process?

The claim: **N ranks, each with b samples, take exactly the optimizer steps that one process
would take on the global batch of N·b samples.** The gradient of a mean loss is the mean of the
per-shard gradients, and DDP's all-reduce averages them.

The check script `ddp_equivalence.py` (in `ddp_lesson/scripts/`) holds a model *without*
BatchNorm (BN statistics are per rank, which lesson 04 is about). It:
- seeds each rank differently and checks the weights differ before `DDP(...)` and are equal after;
- trains the DDP model on each rank's shard, and beside it a plain copy on the whole global
  batch, and compares the weights after **every** step with `torch.allclose`;
- records the `DistributedSampler` shuffles with and without `set_epoch`.

A second check, `find_unused.py` (section 5), runs at the same time.
'''),
code('''
eq_run = check("ddp_equivalence")
fu_run = check("find_unused")
eq = verdict(eq_run, "equivalence.json")
steps = [s["step"] for s in eq["steps"]]
fig, ax = plt.subplots(figsize=(5, 2.8))
ax.semilogy(steps, [max(s["max_abs_diff"], 1e-12) for s in eq["steps"]], "o-")
ax.set_xlabel("optimizer step"); ax.set_ylabel("max |w_DDP - w_single|")
ax.set_title("DDP (2 ranks) vs one process, same global batch"); ax.grid(alpha=.3)
show(fig)
'''),
code('''
assert eq["allclose_every_step"], eq["steps"]          # exactly like one process, every step
assert not eq["weights_equal_before_ddp"]              # different seeds: different weights ...
assert eq["weights_equal_after_ddp"]                   # ... until DDP(...) broadcasts rank 0's
assert eq["epochs_repeat_without_set_epoch"]           # the same shuffle every epoch
assert eq["epochs_differ_with_set_epoch"]
assert eq["shards_disjoint"]                           # no sample on two ranks in one epoch
print("all DDP checks passed")
'''),
md('''
The differences are around 1e-8: float32 rounding, because (g₀+g₁)/2 is not added up in the
same order as the full-batch mean. That is "exactly" in the sense of `allclose`.

**The seed's extra step is unnecessary.** The seed tutorial saves rank 0's initial weights
to a file and makes every rank load them, "so all ranks start equal". `DDP(model)` already
**broadcasts rank 0's parameters and buffers** in its constructor: the check above started
the ranks from different seeds and found them equal right after `DDP(...)`.

## 5 · `find_unused_parameters`

DDP starts all-reducing a bucket of gradients as soon as every gradient in it is ready. If
a parameter is not used in a forward pass (a branch taken only sometimes, a frozen head),
its gradient never arrives and the step cannot finish. DDP notices on the next iteration:
'''),
code('''
fu = verdict(fu_run, "find_unused.json")
print("without the flag:", fu["error_without_flag"][:160], "...")
print(f"cost on a model that uses every parameter: "
      f"{fu['ms_per_step_flag_off']:.1f} ms/step off vs {fu['ms_per_step_flag_on']:.1f} ms/step on")
assert fu["error_without_flag"] and "find_unused_parameters" in fu["error_without_flag"]
'''),
md('''
`find_unused_parameters=True` makes DDP walk the autograd graph after each forward pass to
mark unused parameters ready. **Turn it on only when some parameters can go unused**: on
a model that uses every parameter it only adds that graph walk (the numbers above, measured
side by side in one run; on 2 CPU cores shared with other work they are noisy). The seed's
DDP line passes it unconditionally. If the set of used parameters never changes, `static_graph=True`
is the cheaper fix.

## 6 · Batch size and learning rate

With N processes each taking b samples, one optimizer step sees a **global batch of N·b**.
Adding GPUs at a fixed per-device batch means fewer, larger steps per epoch. If the
learning rate stays the same, the model gets fewer updates of the same size and learns less
per epoch.

The **linear scaling rule** (Goyal et al. 2017, *Accurate, Large Minibatch SGD*): when the
global batch grows k-fold, multiply the lr by k. This can blow up early in training, while
the weights are still changing fast, so they ramp the lr up from a small value over the
first few epochs: **warm-up**.

The seed's advice "lr = (1, n) × lr_base" is this rule stated loosely. Here is an experiment
at a GPU-like scale set through parameters. The reference recipe is batch 16 with lr 0.0125.
Our job has global batch 2 × 64 = 128, which is 8× larger. The three runs start together,
so their timings mean nothing; look at the curves.
Try other values too, for example half the linear factor.
'''),
code('''
base_batch, base_lr, per_device, world = 16, 0.0125, 64, 2
k = per_device * world / base_batch
setups = {f"lr {base_lr} (not scaled)": base_lr,
          f"lr {base_lr * k:g} (k: linear rule)": base_lr * k}
common = ["--epochs", "2", "--batch-size", per_device, "--train-samples", 4096]
lr_runs = {name: launch.start("work/ddp_basic.py", nproc=2, cpu=True, args=common + ["--lr", lr])
           for name, lr in setups.items()}
lr_runs[f"lr {base_lr * k:g} + warm-up"] = launch.start(
    "work/ddp_basic.py", nproc=2, cpu=True, args=common + ["--lr", base_lr * k, "--warmup-steps", 16])
for name, run in lr_runs.items():
    assert run.wait()["status"] == "ok", run.result
dirs = [r.run_dir for r in lr_runs.values()]
show(plots.compare_runs(dirs, metric="loss", labels=list(lr_runs)))
final = {name: runs.load(r.run_dir).series("test_accuracy", rank=0)[-1][1] for name, r in lr_runs.items()}
for name, acc in final.items():
    print(f"{name:28s} test accuracy after 2 epochs: {acc:.1%}")
full, warm = list(final.values())[1:]
assert warm > full, "warm-up should rescue the full linear factor"
'''),
md('''
What to look for (on 2 CPU ranks, seed 0): at the **full linear factor without warm-up**
the loss jumps in the first steps and the run ends far behind. The same lr **with warm-up**
trains normally. The unscaled lr is safe but takes 8x fewer steps than the reference recipe,
each no larger. In our trials half the linear factor did best of all: the rule is a starting
point for a search, not a law. On ImageNet-size problems with global batches of thousands, the early blow-up
without warm-up is what Goyal et al. fixed.

## 7 · Three ways to start the processes

| | torchrun | `python -m torch.distributed.launch` | `mp.spawn` |
|---|---|---|---|
| status | current | **deprecated** (warns since 2.0) | fine, but you do the launcher's work |
| rank info | environment | `--local-rank` argument, or environment with `--use-env` | function argument |
| MASTER_ADDR/PORT | set for you (`--standalone`: a free port) | `--master-port` | you set them |
| restarts, elastic | yes | yes (it is torchrun underneath) | no |
| in a notebook | as a subprocess | as a subprocess | **no**: the worker function must be importable, so run `python script.py` |

The seed uses `torch.distributed.launch --use_env`; today that is just a worse way to call
torchrun. The three scripts:
'''),
code('''
variants = SCRIPTS / "launch_variants"
for name in ("hello_torchrun.py", "hello_launch.py", "hello_spawn.py"):
    print(f"# ---- {name}\\n" + (variants / name).read_text())
'''),
code('''
import subprocess
env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
port = launch.free_port()
commands = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2", variants / "hello_torchrun.py"],
    "launch": [sys.executable, "-m", "torch.distributed.launch", "--nproc-per-node", "2",
               "--master-port", str(port), variants / "hello_launch.py"],
    "mp.spawn": [sys.executable, variants / "hello_spawn.py"],   # a subprocess, never in the kernel
}
procs = {k: subprocess.Popen(list(map(str, c)), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for k, c in commands.items()}
outputs = {k: p.communicate(timeout=300) for k, p in procs.items()}
for k, (out, err) in outputs.items():
    print(f"{k:9s}", " | ".join(sorted(l for l in out.splitlines() if l.strip())))
assert all(p.returncode == 0 for p in procs.values())
assert all(out.count("sum 2") == 2 for out, _ in outputs.values())   # 2 ranks each, all-reduce worked
assert "deprecated" in outputs["launch"][1]                          # launch warns
'''),
md('''
## 8 · Exercise: global batch and learning rate

Write `scaled(per_device_batch, world_size, base_batch, base_lr)` that returns
`(global_batch, lr)` by the linear scaling rule. The checker also tries a wrong answer, to
show it can fail.
'''),
code('''
def scaled(per_device_batch, world_size, base_batch, base_lr):
    # your code here
    return None

def check_scaled(fn):
    assert fn(32, 1, 32, 0.1) == (32, 0.1), "one process at the base batch keeps the base lr"
    g, lr = fn(32, 8, 256, 0.1)
    assert g == 256 and abs(lr - 0.1) < 1e-12, "8 x 32 = 256 is the base batch: same lr"
    g, lr = fn(64, 4, 32, 0.05)
    assert g == 256 and abs(lr - 0.4) < 1e-12, "the global batch is 8x the base: lr x 8"
    return True

try:
    check_scaled(scaled); print("correct!")
except (AssertionError, TypeError) as e:
    print("not yet:", e)
'''),
md('''**Solution**'''),
code('''
def scaled_solution(per_device_batch, world_size, base_batch, base_lr):
    global_batch = per_device_batch * world_size
    return global_batch, base_lr * global_batch / base_batch

assert check_scaled(scaled_solution)
wrong = lambda b, w, bb, lr: (b * w, lr * w)        # scales by world size, ignores the base batch
try:
    check_scaled(wrong); raise RuntimeError("the checker should have failed")
except AssertionError:
    print("the checker rejects the wrong rule")
'''),
md('''
**Takeaways.** One process per device; the launcher tells each one its rank. `DDP(...)`
broadcasts rank 0's weights, and `backward()` averages the gradients. Shard the data with
`DistributedSampler` and call `set_epoch`. Only rank 0 logs and saves `model.module`, then a
`barrier`, then load with `map_location`. Next: BatchNorm, the one layer where the ranks'
batches still matter (lesson 04).
'''),
]

# ---------------------------------------------------------------------------------------
nb04 = [
md('''
# 04 · SyncBatchNorm

**Why.** DDP averages *gradients*, but BatchNorm also normalises each batch with that
batch's own mean and variance. Under DDP each rank only sees **its own** per-device batch,
so BN's statistics come from b samples, not from the global N·b. With a large b that
hardly matters. With the small per-device batches of detection and segmentation (2-4
images per GPU) the statistics are noisy and the model's running averages are worse.

`SyncBatchNorm` computes the mean and variance over **all ranks' batches** with an
all-reduce in every BN layer, in forward and in backward.

Plan: (1) the script diff; (2) a check that SyncBN over 2 ranks of batch b equals BN over
the concatenated 2b batch; (3) one process vs DDP vs DDP+SyncBN at a small per-device
batch; (4) when it matters; (5) an exercise.
'''),
code(SETUP),
md('''
## 1 · The script: lesson 03's plus a few lines

`convert_sync_batchnorm` swaps every `BatchNorm*d` for a `SyncBatchNorm`, and it must run
**before** `DDP(...)`. Two notes:
- The flag is `action="store_true"`. The seed declares `--syncBN` with `type=bool`, and
  `bool("False")` is `True`: any value turns it on.
- PyTorch's `nn.SyncBatchNorm` runs only on GPUs ("expected input tensor to be on GPU"). On
  CPU ranks the script uses the course's `ddp_lesson.syncbn`: the same arithmetic (sum of x,
  sum of x², count → one all-reduce → global mean and variance) in 20 readable lines, with a
  differentiable all-reduce so backward sums over ranks too.
'''),
writefile("ddp_syncbn.py"),
code('''show_diff("ddp_basic.py", "work/ddp_syncbn.py")'''),
code('''
import inspect
from ddp_lesson import syncbn
print(inspect.getsource(syncbn.CPUSyncBatchNorm))
'''),
md('''
## 2 · Check: SyncBN over 2 ranks of b = BN over 2b

`syncbn_stats.py` builds the same global batch of 2·b samples on both ranks. Each rank feeds
*its half* through a SyncBN layer, and as the reference the *whole* batch through a plain
`BatchNorm2d`. After three passes the running mean and variance, the outputs, and the
gradients with respect to the input must all agree. A plain BN on each rank's half must
**not** agree. It also times a DDP training step with BN vs SyncBN, side by side.
'''),
code('''
stats_run = check("syncbn_stats", 4)        # per-rank batch b = 4
stats = verdict(stats_run, "syncbn.json")
for r in stats:
    print(f"rank {r['rank']}: |running mean - big batch| SyncBN {r['sync_mean_abs_diff']:.1e}, "
          f"plain BN {r['plain_bn_mean_abs_diff']:.3f}")
'''),
code('''
for r in stats:
    assert r["sync_mean_matches_big_batch"] and r["sync_var_matches_big_batch"]
    assert r["sync_output_matches_big_batch"] and r["sync_input_grad_matches_big_batch"]
    assert not r["plain_bn_mean_matches_big_batch"]     # per-rank BN sees only its own half
print("SyncBN == BN over the concatenated batch, on every rank")
'''),
md('''
## 3 · Experiment: one process vs DDP vs DDP + SyncBN at a small per-device batch

Per-device batch 4 on 2 ranks, so a global batch of 8:
- **one process, batch 8**: BN sees 8 samples;
- **DDP, no SyncBN**: the same global batch, but each BN layer sees 4;
- **DDP + SyncBN**: each BN layer sees all 8 again, at the cost of an all-reduce per BN layer.

The SyncBN run goes through the panel (you can rerun it with other options). The other two
are started alongside it. They share 2 CPU cores, so compare their **curves**, not their
clocks. The per-step cost comes from the side-by-side timing in the check above.
'''),
code('''
small = {"epochs": 2, "batch-size": 4, "lr": 0.02, "train-samples": 1024}
args = [a for k, v in small.items() for a in (f"--{k}", v)]
others = {
    "1 process, batch 8": launch.start("work/ddp_syncbn.py", nproc=1, cpu=True,
                                       args=args[:2] + ["--batch-size", 8] + args[4:],
                                       env={"OMP_NUM_THREADS": 1}),   # one core, like one rank
    "DDP 2x4, BN": launch.start("work/ddp_syncbn.py", nproc=2, cpu=True, args=args),
}
panel = RunPanel("work/ddp_syncbn.py", options={**small, "sync-bn": True},
                 picker=DevicePicker(), metrics=("loss", "accuracy"))
panel
'''),
code('''
panel.run()
result = panel.wait()
assert result["status"] == "ok", result.get("message")
for run in others.values():
    assert run.wait()["status"] == "ok", run.result
dirs = {**{k: r.run_dir for k, r in others.items()}, "DDP 2x4, SyncBN": panel.run_dir}
show(plots.compare_runs(list(dirs.values()), metric="loss", labels=list(dirs)))
acc = {k: runs.load(d).series("test_accuracy", rank=0)[-1][1] for k, d in dirs.items()}
cost = stats[0]["ms_per_step_syncbn"] / stats[0]["ms_per_step_bn"]
for k, a in acc.items():
    print(f"{k:20s} test accuracy {a:.1%}")
print(f"step cost, measured side by side: BN {stats[0]['ms_per_step_bn']:.1f} ms, "
      f"SyncBN {stats[0]['ms_per_step_syncbn']:.1f} ms ({cost:.1f}x)")
'''),
code('''
fig, ax = plt.subplots(figsize=(5.5, 2.8))
ax.bar(list(acc), list(acc.values()), color=["C0", "C1", "C2"])
ax.set_ylabel("test accuracy"); ax.set_ylim(0, 1)
ax.set_title("per-device batch 4, 2 epochs (one run each: noisy)")
for i, a in enumerate(acc.values()):
    ax.annotate(f"{a:.1%}", (i, a), ha="center", va="bottom")
show(fig)
'''),
md('''
**Reading it.** With a per-device batch of 4, plain DDP normalises with statistics from 4
samples, so its running mean and variance (used at test time) are noisier. SyncBN brings
back the 8-sample statistics of the single process. Each bar is one short run: differences of a
few points are within run-to-run noise. Rerun with other seeds before believing a gap.

**The seed's claim against its own numbers.** The seed says SyncBN "reaches a slightly higher
best mAP", but its source's measured results are **0.811 without vs 0.810 with SyncBN**.
At its per-device batch that is no difference. The honest summary: SyncBN fixes the
*statistics*, which matters when per-device batches are tiny. It always costs an all-reduce
per BN layer in forward and backward, here the ratio printed above. With small per-device
batches of 2-8 (detection, segmentation, video, 3D), use it. With 32 or more per device
it usually buys nothing.

## 4 · When it matters

| per-device batch | BN statistics from | SyncBN |
|---|---|---|
| 1-2 | nearly meaningless (1 sample: BN fails in training) | needed (or GroupNorm/LayerNorm) |
| 4-16 | noisy | usually helps |
| ≥ 32 | fine | costs time, buys little |

Models without BatchNorm (most transformers use LayerNorm) need no SyncBN at all.

## 5 · Exercise: merging statistics across ranks

SyncBN's forward needs only three numbers per channel from each rank. Write
`merge(parts)` that takes a list of per-rank `(count, mean, biased_var)` and returns the
global `(mean, biased_var)`, the statistics of the concatenated batch.
'''),
code('''
def merge(parts):
    # your code here: parts = [(n_r, mean_r, var_r), ...]
    return None

def check_merge(fn):
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(n, generator=g) * s + m for n, s, m in ((4, 1.0, 0.0), (4, 2.0, 3.0), (7, 0.5, -1.0))]
    parts = [(len(c), c.mean().item(), c.var(unbiased=False).item()) for c in chunks]
    whole = torch.cat(chunks)
    mean, var = fn(parts)
    assert abs(mean - whole.mean().item()) < 1e-5, "mean: weight each rank by its count"
    assert abs(var - whole.var(unbiased=False).item()) < 1e-4, \\
        "variance: E[x^2] - mean^2 over all ranks, not the average of the variances"
    return True

try:
    check_merge(merge); print("correct!")
except (AssertionError, TypeError) as e:
    print("not yet:", e)
'''),
md('''**Solution**: add up counts, sums and sums of squares (what the all-reduce carries), then divide.'''),
code('''
def merge_solution(parts):
    n = sum(c for c, _, _ in parts)
    s = sum(c * m for c, m, _ in parts)                 # sum of x
    sq = sum(c * (v + m * m) for c, m, v in parts)      # sum of x^2
    mean = s / n
    return mean, sq / n - mean * mean

assert check_merge(merge_solution)
naive = lambda parts: (sum(m for _, m, _ in parts) / len(parts), sum(v for *_, v in parts) / len(parts))
try:
    check_merge(naive); raise RuntimeError("the checker should have failed")
except AssertionError as e:
    print("averaging per-rank statistics is wrong:", e)
'''),
md('''
**Takeaways.** BN statistics are per rank under DDP. `convert_sync_batchnorm` before `DDP(...)`
makes them global at the cost of an all-reduce per BN layer. Use it for small per-device
batches, not by habit. Next: gradient accumulation, another way to get a larger batch
(lesson 05).
'''),
]

# ---------------------------------------------------------------------------------------
nb05 = [
md('''
# 05 · Gradient accumulation

**Why.** A batch that does not fit in memory can still be the batch you *train* with. Run k
micro-batches of b, let their gradients add up in `.grad`, then take one optimizer step:
the step is the step of a k·b batch. Under DDP there is a second reason. The all-reduce
costs time on every `backward()`, and with accumulation only the **last** micro-batch of
each window needs to communicate. `model.no_sync()` tells DDP to skip the others.

Plan: (1) the script diff and a run; (2) checks: exactness without BN (and the BN gap),
one all-reduce per step with `no_sync`, the same weights; (3) the seed's 2×3090 table
reproduced in shape, and why accuracy falls with many accumulation steps; (4) a partial
window at the end of an epoch; (5) an exercise.
'''),
code(SETUP),
md('''
## 1 · The script: lesson 04's plus accumulation

- `loss / window` makes the accumulated gradient the **mean** over the window's k·b samples,
  as one batch would give.
- `model.no_sync()` around all but the last micro-batch: gradients add up locally, with no
  all-reduce; the last `backward()` all-reduces the sum.
- the last window of an epoch may be shorter than k (section 4).
'''),
writefile("ddp_accum.py"),
code('''show_diff("ddp_syncbn.py", "work/ddp_accum.py")'''),
md('''
Run it with 4 micro-batches of 16 per optimizer step: each step sees 2 × 4 × 16 = 128
samples. The check of section 2 starts at the same time, in its own processes.
'''),
code('''
acc_check = check("accum_nosync")
panel = RunPanel("work/ddp_accum.py",
                 options={"epochs": 2, "batch-size": 16, "accum-steps": 4, "lr": 0.05,
                          "train-samples": 2048, "sync-bn": False},
                 picker=DevicePicker(), metrics=("loss", "accuracy"))
panel
'''),
code('''
panel.run()
result = panel.wait()
assert result["status"] == "ok", result.get("message")
rec = runs.load(panel.run_dir)
n_steps = len(rec.series("loss", rank=0))
print(f"{n_steps} optimizer steps; test accuracy {rec.series('test_accuracy', rank=0)[-1][1]:.1%}")
assert n_steps == 2 * (2048 // 2 // 16 // 4)    # epochs x windows per epoch
'''),
md('''
## 2 · Checks

`accum_nosync.py` checks three things on 2 CPU ranks:
1. **Exactness**: k=4 micro-batches of 8 with `loss / k` give the gradient of one batch of 32
   for a model **without BatchNorm**. With BN in training mode they do *not*: each micro-batch
   is normalised with its own 8-sample statistics. We show the gap instead of hiding it.
2. **One all-reduce per optimizer step.** A DDP communication hook
   (`model.register_comm_hook(state, hook)`) is called once per gradient bucket that DDP
   all-reduces. Ours counts calls and bytes, then hands the bucket to the default
   `allreduce_hook`. This model's 41 KB of gradients fit in one bucket (25 MB by default).
3. **Same weights** with `no_sync` as when syncing every micro-batch: all-reduce is linear,
   so reducing the sum once equals summing k reductions.
'''),
code('''
acc = verdict(acc_check, "accum.json")
c = acc["counts"]
print(f"no BN: max |grad diff| {acc['no_bn_max_abs_diff']:.1e}   with BN: {acc['bn_max_abs_diff']:.1e}")
for name, v in c.items():
    print(f"{name:24s} all-reduces per optimizer step: {v['calls_per_optimizer_step']:.0f}, "
          f"bytes sent into all-reduce over {acc['steps']} steps: {v['bytes']:,}")
print("time per optimizer step (side by side):",
      {k: f"{v:.1f} ms" for k, v in acc["ms_per_optimizer_step"].items()})
'''),
code('''
assert acc["no_bn_exact"]                                    # k micro-batches == one k*b batch
assert not acc["bn_exact"] and acc["bn_max_abs_diff"] > 1e-4   # BN breaks it, visibly
assert c["no_sync"]["calls_per_optimizer_step"] == 1         # one all-reduce per step
assert c["sync_every_micro_batch"]["calls_per_optimizer_step"] == acc["k"]
assert c["no_sync"]["bytes"] * acc["k"] == c["sync_every_micro_batch"]["bytes"]
assert acc["same_weights"], acc["weights_max_abs_diff"]
print("accumulation checks passed")
'''),
md('''
Over the 3 optimizer steps, `no_sync` sent 3 × 40,872 bytes: the whole gradient once per
step. Syncing every micro-batch sent it k times per step, for the same weights.

## 3 · The seed's table, in shape

The seed trained roberta-large for 2 epochs on two RTX 3090s:

| setup | time | dev acc |
|---|---|---|
| 1 card | 1029 s | 71-74 % |
| 2 cards | 707 s (1.455×) | 73-74 % |
| 2 cards + accumulation 2-20 | ~580 s | 75-78 % |
| 2 cards + accumulation 50 | 621 s | 71.9 % |
| 2 cards + accumulation 80 | ~570 s | 67 % |

`accum_sweep.py` runs the same kind of sweep in **one** launch on 2 CPU ranks: first one
process alone on the global batch of 64 (the other rank waits), then 2 ranks with
micro-batches of 32 and k = 1, 4, 16, 64, at the same lr and number of epochs.
'''),
code('''
sweep_run = check("accum_sweep", "--ks", "1,4,16,64", "--batch-size", 32, "--train-samples", 4096)
sweep = verdict(sweep_run, "sweep.json")
rows = sweep["rows"]
print(f"{'setup':12s} {'k':>3s} {'time s':>7s} {'opt steps':>9s} {'ms/opt step':>11s} {'test acc':>8s}")
for r in rows:
    print(f"{r['setup']:12s} {r['k']:3d} {r['seconds']:7.2f} {r['optimizer_steps']:9d} "
          f"{r['ms_per_optimizer_step']:11.1f} {r['test_accuracy']:8.1%}")
'''),
code('''
labels = [f"1 proc" if r["setup"] == "1 process" else f"2, k={r['k']}" for r in rows]
fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3))
a1.bar(labels, [r["seconds"] for r in rows], color="C0"); a1.set_ylabel("training time (s)")
a1.set_title("time for 2 epochs")
a2.plot(labels, [r["test_accuracy"] for r in rows], "o-", color="C3"); a2.set_ylabel("test accuracy")
a2.set_ylim(0, 1); a2.set_title("accuracy at the same lr and epochs")
for a in (a1, a2):
    a.tick_params(axis="x", rotation=30); a.grid(alpha=.3)
show(fig)
steps = {r["k"]: r["optimizer_steps"] for r in rows if r["setup"] != "1 process"}
accs = {r["k"]: r["test_accuracy"] for r in rows if r["setup"] != "1 process"}
assert steps[64] * 64 <= steps[1] and steps[64] < steps[1] / 16   # k x fewer optimizer steps
assert accs[64] < accs[1]                                        # ... and worse accuracy
'''),
md('''
**Why time falls.** With k = 1 every micro-batch pays for an all-reduce and for DDP's
per-step bookkeeping. With `no_sync` only 1 in k does. That is the seed's 707 s → 580 s.
On GPUs the communication share is large: roberta-large has 355 M parameters, so every
all-reduce moves 1.4 GB of gradients over PCIe. Our CPU ranks have a 10 k-parameter model and
tiny micro-batches, so the fixed cost per step is what dominates. 2 ranks at k = 1 may be no
faster than one process (lesson 01's "small batches make multi-device slower" in another
form), and accumulation wins much of it back. Past some k the gain stops, because compute is
all that is left. On a machine shared with other work these times are noisy: rerun the cell
before reading much into one pair of bars.

**Why accuracy falls.** It is not because accumulation is "inexact": without BN it is exact
(section 2). Each optimizer step sees a k-times larger batch, but the **lr stays the same and
the number of epochs stays the same**, so the model takes k times **fewer steps of the same
size**. At k = 64 our run takes only a handful of steps in 2 epochs. At 50-80 the seed's
roberta took about 1/50 of its steps, and its accuracy fell from 76 % to 67 %. Fixes: more
epochs, or scale the lr with the effective batch (lesson 03's linear rule, with warm-up), or
keep k small. Use accumulation to reach a batch size you *want*, not as a speed knob.

## 4 · A partial window at the end of an epoch

With n micro-batches per epoch and n not a multiple of k, the last window is short. The
options:
- **divide by the real window size** (what `ddp_accum.py` does): the last step is an ordinary
  step on a smaller batch;
- divide by k anyway: the last step is silently scaled down by window/k;
- drop the leftovers (`drop_last`-like), or carry them into the next epoch.

And `no_sync` must not be active on the epoch's last micro-batch, or those gradients are
never all-reduced before `step()`: rank copies drift apart with no error. Let's check the first
option on a tiny model in this kernel (one process, no DDP needed):
'''),
code('''
from ddp_lesson import data, models
import torch.nn.functional as F

def windows(n, k):
    """Sizes of the accumulation windows for n micro-batches, k per optimizer step."""
    return [min(k, n - start) for start in range(0, n, k)]

n, k, b = 10, 4, 8
print("windows:", windows(n, k))          # [4, 4, 2]
x, y = data.shapes(n * b, seed=5).tensors
torch.manual_seed(0)
model = models.SmallCNN(norm=False)
last = list(zip(x.chunk(n), y.chunk(n)))[8:]          # the short window: micro-batches 9 and 10
for xi, yi in last:
    (F.cross_entropy(model(xi), yi) / len(last)).backward()   # divide by the real window size
g_acc = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
model.zero_grad()
F.cross_entropy(model(x[8 * b:]), y[8 * b:]).backward()       # one batch of those 16 samples
g_one = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
assert windows(n, k) == [4, 4, 2] and sum(windows(n, k)) == n
assert torch.allclose(g_acc, g_one, atol=1e-6)                 # a normal step on 16 samples
print("dividing by k=4 instead would scale this step by", len(last) / k)
'''),
md('''
## 5 · Exercise: which micro-batches skip the all-reduce?

Write `plan(n, k)` returning a list of n booleans: `True` where the micro-batch should run
under `model.no_sync()`. Every window's last micro-batch must sync, **including a short
final window**.
'''),
code('''
def plan(n, k):
    # your code here
    return None

def check_plan(fn):
    assert fn(8, 4) == [True, True, True, False] * 2, "sync only at the end of each window"
    assert fn(5, 1) == [False] * 5, "k = 1: every micro-batch syncs"
    p = fn(10, 4)
    assert p[-1] is False, "the epoch's last micro-batch must sync, even in a short window"
    assert p == [True, True, True, False, True, True, True, False, True, False]
    return True

try:
    check_plan(plan); print("correct!")
except (AssertionError, TypeError) as e:
    print("not yet:", e)
'''),
md('''**Solution**: the same test as in `ddp_accum.py`.'''),
code('''
def plan_solution(n, k):
    return [not ((i + 1) % k == 0 or i + 1 == n) for i in range(n)]

assert check_plan(plan_solution)
forgets_tail = lambda n, k: [(i + 1) % k != 0 for i in range(n)]
try:
    check_plan(forgets_tail); raise RuntimeError("the checker should have failed")
except AssertionError as e:
    print("rejected:", e)
'''),
md('''
**Takeaways.** `loss / window` and `step()` every k micro-batches give the gradient of one
k·b batch, exactly without BN. `no_sync()` cuts all-reduces to one per optimizer step with
the same result. Fewer steps at the same lr learn less: scale the lr or train longer.
'''),
]


def save(cells, name):
    for i, cell in enumerate(cells):  # stable ids: a rebuild changes only what changed
        cell["id"] = f"{name[:2]}-{i:02d}"
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    nbformat.write(nb, NOTEBOOKS / name)


if __name__ == "__main__":
    save(nb03, "03_ddp_torchrun.ipynb")
    save(nb04, "04_sync_batchnorm.ipynb")
    save(nb05, "05_gradient_accumulation.ipynb")
    print("written")
