"""Speed-up and efficiency vs number of ranks, with the time of a step split into compute
and all-reduce, and a two-term model (compute + all-reduce) that predicts the speed-up; all
measured in one run.

    rows = scaling.measure([1, 2, 4]); scaling.report(rows)   (notebook 06, bench/scaling.py)

One launch per rank count. Every rank trains SmallCNN on the built-in `shapes` data with
a fixed per-rank batch, so an epoch of the same data takes 1/n of the steps on n ranks
(the setting of the s/epoch figures in the blog posts the course grew from). In each launch rank 0 of scripts/workers/scaling_worker.py reports:
- epoch_s    one real DDP epoch (after a warm-up);
- compute_s  a step with the all-reduce switched off (`no_sync`): forward, backward, step;
- compute_max_s  the same, per step the slowest rank's time (median over steps);
- allreduce_s one all_reduce of a flat tensor as large as all gradients;
- step_s     epoch_s / steps, a full DDP step.
- compute_cpu_s, step_cpu_s  the CPU seconds of those steps, which a crowded machine does not
             stretch; cpu_share = compute_cpu_s / compute_s, the least share of a core any rank
             got while computing; step_share = step_cpu_s / step_s, the same in the DDP steps
             (either below CONTENDED: the ranks waited, for cores or for each other: contended).
Model:  step(n) = compute_max(n) + allreduce(n)  (no overlap: SmallCNN's gradients form one
        bucket, reduced after the whole backward),
        compute_max = per step, the slowest rank's compute (every rank waits for it);
        speed-up(n) = n * step(1) / step(n)   (each rank does 1/n of the steps).
The measured speed-up uses the median step of the real epoch the same way. The rest,
measured step - model step (`rest_s`, wall clock), is what the two terms leave out: DDP's own
work, waits for a core, parts timed at different moments; not told apart here, so it is printed,
never added to the model, and it can be negative.
On CPU each rank is given one thread (one rank = one core, like one GPU), so 4 ranks on 2
cores are oversubscribed: compute(n) grows, and the model sees it because it is measured.
"""
import datetime
import json
import os
import platform
import sys
from pathlib import Path

from . import devices, launch, runs
from ..rank.bundled import script

WORKER = script("scaling_worker.py")

# The blog posts' measurements (named in notebook 00). WZ (ResNet-34, flower_photos, batch 16, Tesla V100): s/epoch on
# 1, 2, 4, 8 GPUs. The 3090 post: roberta-large, 1029 s on one card, 707 s on two.
BLOG_WZ_S_PER_EPOCH = {1: 9.0, 2: 5.5, 4: 3.0, 8: 2.0}
BLOG_3090_S = {1: 1029.0, 2: 707.0}


CONTENDED = 0.8   # a rank that got less than 80% of a core while computing waited for one


def blog_speedups():
    wz = {n: BLOG_WZ_S_PER_EPOCH[1] / t for n, t in BLOG_WZ_S_PER_EPOCH.items()}
    return {"wz_v100": wz, "3090": {n: BLOG_3090_S[1] / t for n, t in BLOG_3090_S.items()}}


def default_nprocs(cpu=False):
    n = 0 if cpu else len(devices.list_gpus())
    if n == 0:
        return [1, 2, 4]
    return [k for k in (1, 2, 4, 8) if k <= n]


def run_one(nproc, quick=True, cpu=False, samples=None, batch_size=64, run_dir=None, timeout=300,
            extras=False):
    """One launch with `nproc` ranks; returns rank 0's row (with `extras`, also the rows of
    the all-reduce sweep and of the DDP knobs, under "allreduce" and "knobs")."""
    samples = samples or (8192 if quick else 32768)  # quick: ~1 s of steps per launch, enough for a stable median
    run = launch.start(WORKER, nproc=nproc, cpu=cpu, run_dir=run_dir, timeout=timeout,
                       label=f"scaling-{nproc}", env={"OMP_NUM_THREADS": 1},
                       args=["--samples", samples, "--batch-size", batch_size,
                             "--compute-steps", 16 if quick else 30] + (["--extras"] if extras else []))
    res = run.wait()
    if res["status"] != "ok":
        raise RuntimeError(f"scaling run with {nproc} rank(s) {res['status']}: {res.get('message')}")
    all_rows = runs.load(run.run_dir).rows
    row = [r for r in all_rows if "epoch_s" in r][0]
    row["nproc"], row["run_dir"] = nproc, str(run.run_dir)
    if extras:
        row["allreduce"] = [r for r in all_rows if r.get("kind") == "allreduce"]
        row["knobs"] = [r for r in all_rows if r.get("kind") == "knobs"]
    return row


def model_step(r):
    """The model's step: the slowest rank's compute, then the all-reduce (none on one rank)."""
    return r["compute_max_s"] + (r["allreduce_s"] if r["nproc"] > 1 else 0.0)


def analyse(rows):
    """Add speedup, efficiency, predicted step/speed-up, compute share (utilisation)."""
    base = next(r for r in rows if r["nproc"] == 1)
    for r in rows:
        n = r["nproc"]
        # epoch time from the median step (robust to other people's bursts on the machine);
        # each rank does 1/n of the steps, so speed-up = n * step(1) / step(n)
        r["epoch_est_s"] = r["steps"] * r["step_s"]
        r["speedup"] = base["epoch_est_s"] / r["epoch_est_s"]
        r["efficiency"] = r["speedup"] / n
        r["pred_step_s"] = model_step(r)
        r["rest_s"] = r["step_s"] - r["pred_step_s"]   # what the model leaves out (negative: noise)
    for r in rows:  # the model's speed-up: n * step(1) / step(n), with step = compute + all-reduce
        r["pred_speedup"] = r["nproc"] * base["pred_step_s"] / r["pred_step_s"]
        r["naive_speedup"] = float(r["nproc"])
        r["utilisation"] = min(1.0, r["compute_s"] / r["step_s"])  # busy fraction of a step
        r["cpu_ratio"] = r["compute_cpu_s"] / base["compute_cpu_s"]  # CPU work per step, vs 1 rank
        # the DDP steps of the epoch too: a rank that ran only part of its step's wall time waited,
        # for a core or for a rank that waited for one (gloo's all-reduce blocks, it does not spin)
        r["step_share"] = min(1.0, r["step_cpu_s"] / r["step_s"])
        r["contended"] = min(r["cpu_share"], r["step_share"]) < CONTENDED
    return rows


def measure(nprocs=None, quick=True, cpu=False, samples=None, batch_size=64, extras_at=None):
    """Launch once per rank count (1 always included); `extras_at`: the rank count whose
    launch also runs the all-reduce sweep and the DDP knobs."""
    nprocs = list(nprocs or default_nprocs(cpu))
    if 1 not in nprocs:
        nprocs = [1] + nprocs
    return analyse([run_one(n, quick=quick, cpu=cpu, samples=samples, batch_size=batch_size,
                            extras=(n == extras_at)) for n in nprocs])


def report(rows, out=sys.stdout, ratios=True):
    blogs = blog_speedups()
    dev = rows[0]["device"]
    print(f"SmallCNN on shapes, {rows[0]['backend']} ({dev}), per-rank batch fixed:", file=out)
    print(f"{'ranks':>5} {'s/epoch':>8} {'speed-up':>8} {'effic.':>7} {'compute':>9} {'allreduce':>9} {'rest':>7} "
          f"{'step':>8} {'model':>7} {'WZ V100':>8} {'2x3090':>7}", file=out)
    for r in rows:
        n = r["nproc"]
        wz = blogs["wz_v100"].get(n)
        g = blogs["3090"].get(n)
        print(f"{n:>5} {r['epoch_est_s']:8.2f} {r['speedup']:7.2f}x {r['efficiency']:6.0%} "
              f"{r['compute_max_s'] * 1e3:7.1f}ms {r['allreduce_s'] * 1e3 if n > 1 else 0:7.1f}ms "
              f"{r['rest_s'] * 1e3:5.1f}ms {r['step_s'] * 1e3:6.1f}ms {r['pred_speedup']:6.2f}x "
              f"{(f'{wz:.2f}x' if wz else '-'):>8} {(f'{g:.3f}x' if g else '-'):>7}", file=out)
    print("compute: the slowest rank's step with the all-reduce off (median over steps); model: the speed-up that\n"
          "compute + all-reduce predict; rest: measured step - compute - all-reduce, what the two terms leave out\n"
          "(DDP's own work, waits for a core, parts timed at different moments; not told apart here; can be negative)", file=out)
    for r in rows[1:] if ratios else []:
        err = abs(r["pred_speedup"] - r["speedup"]) / r["speedup"]
        print(f"ratio: {r['nproc']} ranks: measured/predicted speed-up = {r['speedup'] / r['pred_speedup']:.2f} "
              f"(model error {err:.0%}); compute with {r['nproc']} ranks / with 1 = "
              f"{r['compute_max_s'] / rows[0]['compute_max_s']:.2f}x", file=out)
    for r in rows:
        print(f"CPU: {r['nproc']} rank(s): {r['compute_cpu_s'] * 1e3:.1f} ms of CPU per compute step "
              f"({r['cpu_ratio']:.2f}x 1 rank's), {r['cpu_share']:.0%} of a core while computing, "
              f"{r['step_share']:.0%} in the DDP steps"
              + (": contended, the ranks waited for cores" if r["contended"] else ""), file=out)


def check(rows, cores):
    """Notebook 06's checks of a measurement, the ones that hold on a crowded machine too:
    returns the list of launches that were contended (the wall-clock checks then do not apply).
    - each rank does the same work per step at every rank count: CPU time per compute step
      within 0.6x-1.75x of one rank's. A crowded machine stretches CPU time a little too (shared
      caches, switches between processes: 1.38x measured at 4 ranks on 2 cores, load 15); a
      per-rank batch that doubled or halved with n falls outside;
    - more ranks than cores: every such launch is seen as contended (its ranks shared cores);
    - arithmetic: the model's speed-up is n * step(1) / step(n) of its two measured parts,
      the slowest rank's compute + the all-reduce, recomputed here apart from analyse.
    """
    by_n = {r["nproc"]: r for r in rows}
    base = by_n[1]
    for r in rows:
        n = r["nproc"]
        assert 0.6 < r["cpu_ratio"] < 1.75, (
            f"{n} ranks: {r['compute_cpu_s'] * 1e3:.1f} ms of CPU per compute step against "
            f"{base['compute_cpu_s'] * 1e3:.1f} ms on 1 rank: the work per rank per step changed")
        if n > cores:
            assert r["contended"], f"{n} ranks on {cores} cores, yet each got {r['cpu_share']:.0%} of a core"
        parts = lambda x: x["compute_max_s"] + (x["allreduce_s"] if x["nproc"] > 1 else 0.0)
        want = n * parts(base) / parts(r)
        assert abs(r["pred_speedup"] - want) <= 1e-9 * want, (
            f"{n} ranks: the model says {r['pred_speedup']:.2f}x, its measured parts give {want:.2f}x")
    return [r["nproc"] for r in rows if r["contended"]]


def rest_note(r):
    """The rest of a measured step, in words that the run's own numbers do not contradict."""
    note = f"rest {r['rest_s'] * 1e3:.1f} ms"
    if r["rest_s"] < 0:
        return note + (" (negative: the model's parts took longer than the whole step; they were timed at "
                       "different moments, so the machine's crowd probably changed in between)")
    return note + (": what the two terms leave out (DDP's own work, waits, parts timed at different "
                   "moments; not told apart here)"
                   + ("; contended, so waits for a core are in it too" if r["contended"] else ""))


WALL_TOL = 0.50   # a printed verdict only: a 2-core machine's wall clock is noisy even with nothing else running


def wall_launches(rows):
    """The rank counts whose wall clock is read: the launch's ranks each had a core to itself
    (not contended), and for n > 1 the 1-rank launch was not contended either."""
    one = next(r for r in rows if r["nproc"] == 1)
    return [r["nproc"] for r in rows if not r["contended"] and (r["nproc"] == 1 or not one["contended"])]


def wall_verdict(rows, cores, tol=WALL_TOL):
    """Notebook 06's wall-clock comparison, printed, not asserted: one line per rank count > 1.
    Neither the two-term model nor "n ranks are n times faster" is checked against the wall
    clock here. On a quiet 2-core machine the reference misses the 2-rank speed-up by far more
    than 50% (its DDP step is much longer than compute + all-reduce), so an assert would only
    say which run it met."""
    read = wall_launches(rows)
    lines = []
    for r in rows:
        n = r["nproc"]
        if n == 1:
            continue
        if n not in read:
            lines.append(f"{n} ranks: wall clock not read, "
                         + ("its ranks waited for a core" if r["contended"] else "the 1-rank launch waited for a core"))
            continue
        err = (r["pred_speedup"] - r["speedup"]) / r["speedup"]
        lines.append(
            f"{n} ranks: measured step {r['step_s'] * 1e3:.1f} ms, model (compute + all-reduce) "
            f"{r['pred_step_s'] * 1e3:.1f} ms, {rest_note(r)}. Speed-up measured {r['speedup']:.2f}x, model "
            f"{r['pred_speedup']:.2f}x ({err:+.0%}), perfect scaling {n}x. Verdict: the model is "
            + ("within" if abs(err) < tol else "not within") + f" {tol:.0%}; {n} ranks were "
            + ("faster" if r["speedup"] > 1 else "not faster") + f" than one ({r['speedup']:.2f}x)"
            + (f" on {cores} cores" if n <= cores else f", with more ranks than the {cores} cores") + ".")
    return lines


def contention_note(rows):
    """One sentence from the run: which launches are contended noise, and what to read instead."""
    bad = [r["nproc"] for r in rows if r["contended"]]
    if not bad:
        return "every rank had a core to itself: your wall-clock numbers are measurements; the reference below is a second run to compare with."
    return (f"contended at {bad} rank(s): those ranks waited for a core, so their wall-clock columns "
            "(s/epoch, speed-up, compute, step, model) are mostly your neighbours' noise; "
            "read the reference figures below for the shape of the curve.")


# -- reference figures: a measurement saved with where and when it was made (bench/scaling.py --save) --
REFERENCE = Path(__file__).resolve().parents[2] / "bench" / "reference" / "scaling_cpu.json"
KEEP = ("nproc", "steps", "step_s", "epoch_est_s", "speedup", "efficiency", "compute_s", "compute_max_s",
        "allreduce_s", "rest_s", "pred_step_s", "pred_speedup", "compute_cpu_s", "step_cpu_s", "cpu_share", "cpu_ratio", "step_share",
        "utilisation", "contended", "device", "backend")


def _cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(start=None, argv=None):
    """Where and when: called before a measurement (returns the start) and after it (adds the end)."""
    import torch
    now = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "load": round(os.getloadavg()[0], 2)}
    if start is None:
        return now
    return {"date": start["date"], "cores": devices.cpu_count(), "cpu_model": _cpu_model(),
            "load_start": start["load"], "load_end": now["load"], "torch": torch.__version__,
            "command": " ".join(map(str, argv or []))}


def save_reference(path, rows, prov):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"provenance": prov, "rows": [{k: r[k] for k in KEEP if k in r} for r in rows]},
                                     indent=1) + "\n")


def load_reference(path=REFERENCE):
    d = json.loads(Path(path).read_text())
    return analyse(d["rows"]), d["provenance"]   # the derived columns recomputed by today's code


def describe_provenance(p):
    quiet = max(p["load_start"], p["load_end"]) <= p["cores"]
    return (f"measured {p['date']} on {p['cores']} cores ({p['cpu_model']}), torch {p['torch']}, "
            f"load average {p['load_start']} at the start and {p['load_end']} at the end: "
            + ("a quiet machine" if quiet else f"a crowded machine, more runnable processes than its {p['cores']} cores"))


def side_by_side(mine, ref, out=sys.stdout):
    """The learner's speed-ups beside the reference's, rank count by rank count."""
    ref_by_n = {r["nproc"]: r for r in ref}
    print(f"{'ranks':>5} {'yours':>8} {'reference':>10}  reference's least share of a core", file=out)
    for r in mine:
        f = ref_by_n.get(r["nproc"])
        print(f"{r['nproc']:>5} {r['speedup']:7.2f}x "
              + (f"{f['speedup']:9.2f}x  {min(f['cpu_share'], f['step_share']):.0%}" + (", contended" if f["contended"] else "") if f else f"{'-':>10}"), file=out)
