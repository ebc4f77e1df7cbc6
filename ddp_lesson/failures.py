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


def _agent_root_cause(agent_log):
    """(rank, exitcode) from torchrun's 'Root Cause (first observed failure)' block."""
    text = Path(agent_log).read_text(errors="replace") if Path(agent_log).exists() else ""
    block = text.split("Root Cause", 1)[-1] if "Root Cause" in text else ""
    rank = re.search(r"rank\s*:\s*(\d+)", block)
    code = re.search(r"exitcode\s*:\s*(-?\d+)", block)
    if not rank or not code:
        return None
    return int(rank.group(1)), int(code.group(1))


def root_cause(run_dir):
    """{rank, exitcode, message, traceback} of the first failing rank, or None."""
    logs = Path(run_dir) / "logs"
    errors = [e for e in (read_json(p) for p in logs.glob("rank*.error.json")) if e]
    agent = _agent_root_cause(logs / "agent.log")
    if errors:
        latest = max(e.get("restart", 0) for e in errors)
        errors = [e for e in errors if e.get("restart", 0) == latest]
    if agent and agent[1] != -15 and agent[0] not in {e["rank"] for e in errors}:
        # The first rank torchrun saw fail died without a Python exception (a signal such
        # as -9, or os._exit): the errors the other ranks raised (peer connection closed)
        # are consequences of it, not the cause.
        errors = []
    if errors:
        first = min(errors, key=lambda e: e["time"])
        exitcode = agent[1] if agent and agent[0] == first["rank"] else 1
        tb = first.get("traceback") or tail_text(logs / f"rank{first['rank']}.stderr.log", 30)
        return {"rank": first["rank"], "exitcode": exitcode, "message": first["message"], "traceback": tb}
    if agent:
        rank, exitcode = agent
        return {"rank": rank, "exitcode": exitcode, "message": f"rank {rank} {explain(exitcode)}",
                "traceback": tail_text(logs / f"rank{rank}.stderr.log", 30)}
    return None


def describe(failure):
    """A few lines for a person: which rank, why, and its traceback."""
    if not failure:
        return "The run failed before any rank reported an error; see logs/agent.log."
    head = (f"Rank {failure['rank']} failed first ({explain(failure['exitcode'])}): "
            f"{failure['message']}")
    tb = (failure.get("traceback") or "").rstrip()
    return head + ("\n" + tb if tb else "")
