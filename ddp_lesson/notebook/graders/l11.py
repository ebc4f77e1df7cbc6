"""Notebook 11's exercise: a fixed global batch at any world size, or a refusal that says why.
check_global_batch grades one run directory; check_global_batch_at several, at two or more world
sizes; check_refusal the # EXERCISE lines at a world size they cannot serve, without a launch;
attempt_at launches and prints the one verdict."""
import re
import textwrap
from collections import defaultdict
from pathlib import Path

from ...launcher import runs
from .common import attempt


GUARD_EXIT = "the script exited with status "   # how the rank's guard records a SystemExit


def _refusal(failure, script):
    """None if a failed run's first failure is a refusal that says why, else what it is.
    A refusal: a SystemExit that carries a message (sys.exit(text), raise SystemExit(text)),
    or an exception with a message raised by a `raise` or `assert` line of the script itself.
    A NameError on an edited line, a failed import, an error inside torch, a bare
    sys.exit(1) or an assert without a message are not."""
    message = (failure or {}).get("message") or "no error was recorded"
    kind, colon, text = message.partition(": ")
    if not colon:                                # a rank that died without a Python exception
        return message
    if kind == "SystemExit":
        reason = text.removeprefix(GUARD_EXIT)
        if reason.lstrip("-").isdigit():
            return f"it exited with status {reason} and no message: say why, raise SystemExit(message)"
        return None
    frames = re.findall(r'^  File "(.*)", line \d+, in .*\n    (.*)$', failure.get("traceback", ""), re.M)
    if not text.strip():
        return f"{kind} without a message: say why in it (assert ..., message)"
    if not frames or Path(frames[-1][0]).name != Path(script).name or \
            not re.match(r"(raise|assert)\b", frames[-1][1]):
        return f"it crashed with {kind}: {text}"
    return None


def check_global_batch(run_dir):
    """11: every optimizer step saw the global batch the script asked for (summed over
    ranks), at the run's world size. Reads `global_batch_asked` and `micro_batch` (logged
    once, before training) and each rank's per-step count (`samples`, or `windows` in
    gpt_ddp.py). Where no whole number of micro-batches per rank gives the global batch
    (48 samples in micro-batches of 4 on 5 ranks), the right answer is to refuse: a run
    that logged those two numbers and then ended before its first optimizer step with a
    refusal that says why (see _refusal) is accepted then; any other failure is not."""
    rec = runs.load(run_dir)
    world = rec.config["world_size"]
    message = (rec.result or {}).get("message")
    head = next((row for row in rec.rows if "global_batch_asked" in row), None)
    assert head or rec.status == "ok", (
        f"the run ended {rec.status} before it logged the global batch it asked for (the metrics.log(0, "
        f"global_batch_asked=..., micro_batch=...) line), so the checker cannot tell whether {world} "
        f"rank(s) can give it; refuse after that line, at # EXERCISE: {message}")
    assert head, "the run did not log the global batch it asked for (global_batch_asked)"
    asked, micro = head["global_batch_asked"], head.get("micro_batch")
    per_step = defaultdict(dict)                 # step -> {rank: samples this rank used}
    for row in rec.rows:
        n = row.get("samples", row.get("windows"))
        if n is not None:
            per_step[row["step"]][row["rank"]] = n
    if rec.status != "ok":
        assert micro and asked % (micro * world), (f"the run ended {rec.status}, but {asked} samples split into "
                                                   f"micro-batches of {micro} on {world} rank(s): {message}")
        assert not per_step, f"the run ended {rec.status} after {len(per_step)} step(s), not before training: {message}"
        why_not = _refusal((rec.result or {}).get("failure"), rec.config.get("script", ""))
        assert why_not is None, (f"the run failed, but not with a refusal that says why ({why_not}); refuse with "
                                 f"raise SystemExit(message) or raise ValueError(message): {message}")
        return (f"refused before training, as it should: {asked} samples do not split into "
                f"micro-batches of {micro} on {world} ranks")
    assert per_step, "the run logged no training steps"
    for step, by_rank in sorted(per_step.items()):
        assert sorted(by_rank) == list(range(world)), f"step {step}: not every rank logged it"
        total = sum(by_rank.values())
        assert total == asked, (f"step {step}: {total} samples over {world} rank(s), not the "
                                f"{asked} asked for (ranks x micro-batch x accumulation steps)")
    return f"{len(per_step)} steps of {asked} samples each on {world} rank(s)"


def check_global_batch_at(run_dirs):
    """11's exercise: check_global_batch on runs of the same script at two or more
    world sizes, so that an ACCUM chosen for one world size (6 on 2 ranks) is rejected."""
    worlds = {}
    for run_dir in run_dirs:
        verdict = check_global_batch(run_dir)
        worlds[runs.load(run_dir).config["world_size"]] = verdict
    assert len(worlds) >= 2, f"runs at {sorted(worlds)} rank(s) only: one world size accepts a constant chosen for it"
    return "; ".join(f"{w} rank(s): {v}" for w, v in sorted(worlds.items()))


def check_refusal(script):
    """11's exercise, without a launch: the lines from `# EXERCISE` to `train_set =`, run here with
    the script's GLOBAL and MICRO and the smallest world size they do not divide, must refuse:
    raise with a message. Dividing without refusing would train the wrong global batch there."""
    lines = Path(script).read_text().splitlines()
    consts = next(l for l in lines if l.startswith("GLOBAL, MICRO"))
    start = next(i for i, l in enumerate(lines) if l.strip().startswith("# EXERCISE"))
    end = next(i for i, l in enumerate(lines) if i > start and l.strip().startswith("train_set ="))
    ns = {}
    exec(consts, ns)
    world = next(w for w in range(2, 1000) if ns["GLOBAL"] % (ns["MICRO"] * w))
    ns.update(world_size=world, local_rank=0, use_cuda=False)
    try:
        exec(textwrap.dedent("\n".join(lines[start:end])), ns)
    except (SystemExit, Exception) as e:
        why = str((e.code if isinstance(e, SystemExit) else e) or "")
        assert why and not isinstance(e, (NameError, ImportError, SyntaxError, AttributeError, TypeError)) and not str(why).isdigit(), (
            f"at {world} ranks the # EXERCISE lines end with {type(e).__name__}({why!r}): not a refusal that says why")
        return f"refuses {world} ranks: {why}"
    raise AssertionError(f"at {world} ranks, where {ns['GLOBAL']} samples do not split into micro-batches of "
                         f"{ns['MICRO']}, the # EXERCISE lines do not refuse: ACCUM = {ns.get('ACCUM')} would "
                         f"train {ns.get('ACCUM', 0) * ns['MICRO'] * world} samples per step")


def attempt_at(script, worlds, timeout=300):
    """common.attempt at each world size in turn, stopping at the first the checker rejects,
    then check_refusal at a world size that cannot give the global batch. Returns (run dirs, passed)."""
    dirs = []
    for nproc in worlds:
        run_dir, passed = attempt(script, check_global_batch, nproc=nproc, timeout=timeout)
        dirs.append(run_dir)
        if not passed:
            return dirs, False
    try:
        print("correct at every world size!", check_global_batch_at(dirs), "; and", check_refusal(script))
        return dirs, True
    except AssertionError as e:
        print("not yet:", e)
        return dirs, False
