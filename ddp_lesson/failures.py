"""Root cause of a failed run: the first rank that failed, its exit code and traceback,
not the ranks torchrun tore down after it."""
import re
from pathlib import Path

from .runs import read_json, tail_text

SIGNALS = {
    -9: "killed by SIGKILL (-9): most often the machine ran out of memory and the kernel's "
        "OOM killer ended it; try a smaller batch or fewer processes",
    -15: "stopped by SIGTERM (-15): the torchrun agent ends the other ranks this way after one "
         "fails, or someone stopped the run",
    -6: "aborted (SIGABRT, -6): often a NCCL/gloo error or a failed C++ check; see its stderr",
    -11: "crashed with a segmentation fault (SIGSEGV, -11)",
}


def explain(exitcode):
    if exitcode in SIGNALS:
        return SIGNALS[exitcode]
    if exitcode is not None and exitcode < 0:
        return f"killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def _agent_failures(agent_log):
    """[(rank, exitcode, is_root)] from the summary torchrun prints when the run fails
    (its 'Failures:' and 'Root Cause' entries). torchrun's own choice of root cause
    compares whole seconds, so it cannot be trusted alone."""
    text = Path(agent_log).read_text(errors="replace") if Path(agent_log).exists() else ""
    if "Failures:" in text:
        text = text[text.rindex("Failures:"):]
    elif "Root Cause" in text:
        text = text[text.rindex("Root Cause"):]
    else:
        return []
    root_at = text.find("Root Cause")
    entry = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")
    return [(int(m.group(1)), int(m.group(2)), root_at != -1 and m.start() > root_at)
            for m in entry.finditer(text)]


def root_cause(run_dir):
    """{rank, exitcode, message, traceback} of the first failing rank, or None.

    A rank that died without a Python exception (killed by -9, a segfault, os._exit) is the
    cause: the errors other ranks then raise ("connection closed by peer") are consequences.
    Otherwise the earliest exception wins. Exit code -15 is torchrun's own teardown."""
    logs = Path(run_dir) / "logs"
    errors = [e for e in (read_json(p) for p in logs.glob("rank*.error.json")) if e]
    if errors:
        latest = max(e.get("restart", 0) for e in errors)
        errors = [e for e in errors if e.get("restart", 0) == latest]
    failures = _agent_failures(logs / "agent.log")
    codes = {rank: code for rank, code, _ in failures}
    raised = {e["rank"] for e in errors}
    silent = [f for f in failures if f[0] not in raised and f[1] != -15]
    if silent:
        rank, exitcode, _ = max(silent, key=lambda f: f[2])  # torchrun's root cause if it is one
        return {"rank": rank, "exitcode": exitcode, "message": f"rank {rank} {explain(exitcode)}",
                "traceback": tail_text(logs / f"rank{rank}.stderr.log", 30)}
    if errors:
        first = min(errors, key=lambda e: e["time"])
        tb = first.get("traceback") or tail_text(logs / f"rank{first['rank']}.stderr.log", 30)
        return {"rank": first["rank"], "exitcode": codes.get(first["rank"], 1), "message": first["message"],
                "traceback": tb}
    if failures:
        rank, exitcode, _ = max(failures, key=lambda f: f[2])
        return {"rank": rank, "exitcode": exitcode, "message": f"rank {rank} {explain(exitcode)}",
                "traceback": tail_text(logs / f"rank{rank}.stderr.log", 30)}
    return None


def headline(failure):
    """One line: which rank failed first, and why."""
    return f"Rank {failure['rank']} failed first ({explain(failure['exitcode'])}): {failure['message']}"


def describe(failure):
    """A few lines for a person: which rank, why, and its traceback."""
    if not failure:
        return "The run failed before any rank reported an error; see logs/agent.log."
    head = headline(failure)
    tb = (failure.get("traceback") or "").rstrip()
    return head + ("\n" + tb if tb else "")
