"""Notebook 04, section 4: the SyncBN run against the two reference runs, and its check.

`compare(panel, ref, options, timing)` waits for the panel's SyncBN run, draws the three loss
curves, prints test accuracies and the step cost, and raises AssertionError when SyncBN's first
losses are not the one process's. The check needs a run like the reference runs (CPU ranks, the
same rank count and options); when the panel's run is not one, it launches one itself.
"""
from pathlib import Path

from ..launcher import launch, runs
from . import plots
from .lesson import show


def check_step_by_step(loss, one, plain, world):
    """SyncBN's first losses are the one process's, so the script converted; plain BN's are not."""
    assert len(loss) == len(one) == len(plain), "the runs have different step counts"
    first = max(abs(a - c) for a, c in zip(loss[:5], one[:5]))   # measured: < 1e-6 at 2 and 3 ranks
    assert first < 1e-5, f"SyncBN vs one process, first 5 steps: {first:.1e}"   # the same statistics
    assert world == 1 or abs(plain[0] - loss[0]) > 1e-5, "SyncBN's step 1 equals plain BN's: no conversion?"
    if world > 1:   # over the whole run: SyncBN's distance from the one process stays mostly below plain BN's
        sync_gap, plain_gap = (median([abs(c - o) for c, o in zip(curve, one)]) for curve in (loss, plain))
        print(f"median distance from the one process's loss: SyncBN {sync_gap:.1e}, plain BN {plain_gap:.1e}")
        assert sync_gap < plain_gap, \
            f"SyncBN's median distance from the one process {sync_gap:.1e} is not below plain BN's {plain_gap:.1e}"


def median(values):
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def to_args(options):
    return [str(a) for k, v in options.items() for a in (f"--{k}", v)]


def like_the_reference(rec, ref, options):
    """Why a run (runs.load's record) is not like the reference runs: CPU ranks, the same rank
    count and options. '' when it is."""
    used = {k: str(ref["args"][k.replace("-", "_")]) for k in options}
    if rec.gpus:
        return "it ran on GPUs"
    if rec.config["world_size"] != ref["world_size"]:
        return f"it ran on {rec.config['world_size']} rank(s), not {ref['world_size']}"
    if {k: str(v) for k, v in options.items()} != used:
        return f"its options {options} are not the reference runs' {used}"
    return ""


def _losses(run_dir):
    return plots.series(runs.load(run_dir).rows, "loss")[1]


def compare(panel, ref, options, timing, script="work/ddp_syncbn.py"):
    """Wait for the panel's run, draw it with the reference runs, check it; return the test
    accuracy of each of the three runs, by label."""
    result = panel.wait()
    assert result["status"] == "ok", result.get("message")
    rec = runs.load(panel.run_dir)
    world, b = ref["world_size"], ref["per_rank_batch"]
    others = {f"1 process, batch {b * world}": ref["runs"]["1 process"],
              f"DDP {world}x{b}, BN": ref["runs"]["DDP, BN"]}
    sync_label = f"DDP {rec.config['world_size']}x{options['batch-size']}, SyncBN"
    steps, loss = _losses(panel.run_dir)          # the mean over ranks, per step

    from matplotlib.figure import Figure
    fig = Figure(figsize=(11, 3.6))
    ax, gap = fig.subplots(1, 2)
    for label, r in others.items():
        ax.plot(range(1, len(r["loss"]) + 1), r["loss"], lw=1.8, label=label)
    ax.plot(steps, loss, lw=1.8, label=sync_label)
    ax.set_xlabel("step"); ax.set_ylabel("loss (mean over ranks)"); ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    # the curves overlap on the left: the right shows each DDP run's distance from the one process
    one, plain = (r["loss"] for r in others.values())
    for label, curve, colour in ((f"DDP {world}x{b}, BN", plain, "C1"), (sync_label, loss, "C2")):
        n = min(len(one), len(curve))
        gap.plot(range(1, n + 1), [max(abs(c - o), 1e-9) for c, o in zip(curve[:n], one[:n])],
                 lw=1.5, color=colour, label=label)
    gap.set_yscale("log"); gap.set_xlabel("step"); gap.grid(alpha=0.3)
    gap.set_ylabel("|loss - 1 process's loss|"); gap.legend(fontsize="small")
    gap.set_title("distance from the one process (1e-9: equal)", fontsize="medium")
    fig.tight_layout()   # room for the axis labels: without it "step" is clipped
    show(fig)

    acc = {**{label: r["test_accuracy"][-1] for label, r in others.items()},
           sync_label: rec.series("test_accuracy", rank=0)[-1][1]}
    for label, a in acc.items():
        print(f"{label:20s} test accuracy {a:.1%}")
    bn, sync = timing["ms_per_step_bn"], timing["ms_per_step_syncbn"]
    print(f"step cost, measured side by side: BN {bn:.1f} ms, SyncBN {sync:.1f} ms ({sync / bn:.1f}x)")

    unlike = like_the_reference(rec, ref, options)
    if unlike:   # the check needs like for like: a CPU run with the reference runs' options
        print(f"the panel's run differs from the reference runs ({unlike}): "
              f"checking a run on {world} CPU rank(s)")
        used = {k: ref["args"][k.replace("-", "_")] for k in options}
        own = launch.start(Path(script), nproc=world, cpu=True, args=to_args(used) + ["--sync-bn"])
        assert own.wait()["status"] == "ok", runs.log_tail(own.run_dir, 0, 30, "stderr")
        _, loss = _losses(own.run_dir)
    one, plain = others[f"1 process, batch {b * world}"]["loss"], others[f"DDP {world}x{b}, BN"]["loss"]
    check_step_by_step(loss, one, plain, world)
    print(f"step 1 loss: 1 process {one[0]:.6f}, SyncBN {loss[0]:.6f}, plain BN {plain[0]:.6f}")
    return acc
