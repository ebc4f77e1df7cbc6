"""Lesson 11's capstone (gpt_ddp.py) against nanoGPT's train.py, side by side, same model and batch.

    python bench/capstone_vs_nanogpt.py /path/to/nanoGPT [--rounds 3] [--steps 40] [--nproc 2]

Both run under the same torchrun, on CPU ranks (gloo), fp32, as the same model: 2 layers, 4 heads,
width 192, block 64, biases, vocab 256, no dropout, 1,024 tokens a step (16 windows of 64 bytes
over the ranks, micro-batches of --micro windows). nanoGPT reads a data directory: this script
writes the capstone's own bytes (the Python standard library's source, gpt_ddp.stdlib_bytes) as
uint16 train.bin / val.bin and a meta.pkl (vocab 256) into a temporary directory and points
nanoGPT's --dataset at it. Nothing of nanoGPT is copied here: its train.py runs from its checkout,
with the two lines that make its DDP ranks GPU ranks replaced in memory (CPU_RANKS).

Each program's time per step is measured the way nanoGPT measures its own: the wall clock from
one step's end to the next's on rank 0, everything in between included (the capstone's metric
rows, its logging all-reduce, its step timer). The capstone's step ends when its metric row is
written (each row's `time`). Steps before --skip are warm-up. The two run in turn, A B A B ...,
--rounds times: on a shared machine only ratios of runs taken side by side mean anything, and
the load average is printed with them. Prints tokens/s per round and the ratio capstone / nanoGPT.
"""
import argparse
import json
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ddp_lesson.notebook.lesson import load_script, script


def write_data(folder):
    """The capstone's bytes as nanoGPT's uint16 train.bin / val.bin, and meta.pkl (vocab 256)."""
    gpt = load_script(script("gpt_ddp.py"))
    text, _ = gpt.stdlib_bytes()
    train, val = gpt.split(text)
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in (("train", train), ("val", val)):
        np.frombuffer(bytes(data), dtype=np.uint8).astype(np.uint16).tofile(folder / f"{name}.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 256}, f)
    return len(train)


def torchrun(nproc):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


# nanoGPT's train.py takes a DDP run for a GPU run: three lines, replaced in memory when a rank
# runs it (its checkout is left as it is), make its ranks CPU ranks, as the capstone's are.
CPU_RANKS = [("    device = f'cuda:{ddp_local_rank}'\n    torch.cuda.set_device(device)\n", "    device = 'cpu'\n"),
             ("model = DDP(model, device_ids=[ddp_local_rank])", "model = DDP(model)")]


def nanogpt_rank(checkout, args):
    """One rank of nanoGPT's train.py (torchrun starts this file with --nanogpt-rank)."""
    path = Path(checkout) / "train.py"
    src = path.read_text()
    for old, new in CPU_RANKS:
        if src.count(old) != 1:
            raise SystemExit(f"{path}: expected one {old.strip()!r} to make its ranks CPU ranks; another version?")
        src = src.replace(old, new)
    sys.path.insert(0, str(checkout))         # its model.py; configurator.py is read from the cwd
    sys.argv = [str(path), *args]
    exec(compile(src, str(path), "exec"), {"__name__": "__main__", "__file__": str(path)})


def run_nanogpt(checkout, data, out, a):
    """ms per step of nanoGPT's train.py (its own 'time ... ms' lines), after warm-up."""
    args = [f"--dataset={data}", f"--out_dir={out}", "--device=cpu", "--dtype=float32", "--compile=False",
            "--backend=gloo", "--n_layer=2", "--n_head=4", "--n_embd=192", "--block_size=64", "--bias=True",
            "--dropout=0.0", f"--batch_size={a.micro}", f"--gradient_accumulation_steps={16 // a.micro}",
            f"--max_iters={a.steps}", "--eval_interval=1000000", "--eval_iters=1", "--log_interval=1",
            "--always_save_checkpoint=False", "--wandb_log=False", "--learning_rate=4e-3",
            "--warmup_iters=10", f"--lr_decay_iters={a.steps}", "--min_lr=4e-4", "--beta2=0.95",
            "--grad_clip=1.0", "--weight_decay=0.1"]
    p = subprocess.run(torchrun(a.nproc) + [__file__, "--nanogpt-rank", str(checkout), *args], cwd=checkout,
                       capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise SystemExit(f"nanoGPT's train.py failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    ms = [float(t) for t in re.findall(r"^iter \d+: .*time ([\d.]+)ms", p.stdout, re.M)]
    return ms[1 + a.skip:]        # iter 0's time is from before the loop


def run_capstone(out, a):
    """ms per step of gpt_ddp.py: the gaps between rank 0's metric rows, after warm-up."""
    env = dict(os.environ, DDP_LESSON_RUN_DIR=str(out))
    args = ["--steps", str(a.steps), "--global-batch", "16", "--micro-batch", str(a.micro), "--block", "64",
            "--layers", "2", "--heads", "4", "--width", "192", "--amp", "off", "--lr", "4e-3",
            "--eval-every", "1000000", "--eval-windows", "2", "--sample-bytes", "0"]
    p = subprocess.run(torchrun(a.nproc) + [str(a.capstone), *args], capture_output=True, text=True,
                       env=env, timeout=900)
    if p.returncode:
        raise SystemExit(f"gpt_ddp.py failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    rows = [json.loads(line) for f in sorted(Path(out).glob("**/*.jsonl")) for line in open(f)]
    times = sorted((r["step"], r["time"]) for r in rows if r.get("rank") == 0 and "step_s" in r)
    return [1e3 * (t - u) for (_, u), (_, t) in zip(times, times[1:])][a.skip:]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--nanogpt-rank"]:
        return nanogpt_rank(argv[1], argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("nanogpt", help="path of a nanoGPT checkout (its train.py, configurator.py, model.py)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of each run")
    p.add_argument("--micro", type=int, default=8, choices=(1, 2, 4, 8), help="windows per micro-batch")
    p.add_argument("--nproc", type=int, default=2, choices=(1, 2, 4, 8))
    p.add_argument("--capstone", default=str(script("gpt_ddp.py")),
                   help="the capstone script to run (default: this checkout's gpt_ddp.py)")
    a = p.parse_args(argv)
    if not Path(a.capstone).exists():
        raise SystemExit(f"--capstone {a.capstone}: no such file")
    checkout = Path(a.nanogpt).resolve()
    if not (checkout / "train.py").exists() or not (checkout / "configurator.py").exists():
        raise SystemExit(f"{checkout} is not a nanoGPT checkout: no train.py and configurator.py there")
    if 16 // a.micro % a.nproc:
        raise SystemExit(f"16 windows in micro-batches of {a.micro} do not split over {a.nproc} ranks")
    with tempfile.TemporaryDirectory(prefix="capstone_vs_nanogpt_") as tmp:
        tmp = Path(tmp)
        n = write_data(tmp / "data")
        print(f"data: {n:,} train bytes as uint16 in {tmp / 'data'}; {a.nproc} CPU ranks, fp32, 1,024 tokens a "
              f"step in micro-batches of {a.micro}; {a.steps} steps a run, the first {a.skip} left out")
        ratios = []
        for r in range(a.rounds):
            load = os.getloadavg()[0]
            ours = statistics.median(run_capstone(tmp / f"capstone{r}", a))
            theirs = statistics.median(run_nanogpt(checkout, tmp / "data", tmp / f"nanogpt{r}", a))
            ratios.append(theirs / ours)
            print(f"round {r + 1}: capstone {ours:6.1f} ms/step = {1024 / ours * 1e3:7,.0f} tokens/s;  "
                  f"nanoGPT {theirs:6.1f} ms/step = {1024 / theirs * 1e3:7,.0f} tokens/s;  "
                  f"ratio {theirs / ours:.2f}x  (load average {load:.1f} -> {os.getloadavg()[0]:.1f} "
                  f"on {os.cpu_count()} CPUs)", flush=True)
        print(f"capstone / nanoGPT tokens/s: median {statistics.median(ratios):.2f}x over {a.rounds} "
              f"interleaved rounds (each {', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
