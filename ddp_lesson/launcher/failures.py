"""Root cause of a failed run: the first rank that failed, its exit code and traceback,
not the ranks torchrun tore down after it.

Reads two structured records, never torchrun's printed summary:
- logs/agent.failures.json, written by the agent's guard from torchrun's own failure record
  of the final attempt (rank, local_rank, pid, exitcode, error_file, timestamp), or the
  signal that stopped the agent;
- logs/rank<R>.error.json, written by each rank's guard when the script raised (message,
  traceback, time to the microsecond, pid).
"""
import signal


from ..rank import rundir
from ..rank.rundir import read_json
from .runs import tail_text

SIGNALS = {
    -9: "killed by SIGKILL (-9): most often the machine ran out of memory and the kernel's "
        "OOM killer ended it; try a smaller batch or fewer processes",
    -15: "stopped by SIGTERM (-15): the torchrun agent ends the other ranks this way after one "
         "fails, or someone stopped the run",
    -6: "aborted (SIGABRT, -6): often a NCCL/gloo error or a failed C++ check; see its stderr",
    -11: "crashed with a segmentation fault (SIGSEGV, -11)",
}
TEARDOWN = (-15, -6)  # what a peer dies of while the run is torn down after a failure

# (words in the error, one line for a person); the first match wins
HINTS = [
    (("Found no NVIDIA driver", "Torch not compiled with CUDA", "no CUDA GPUs are available",
      "CUDA driver initialization failed"),
     "hint: this machine has no usable NVIDIA GPU/CUDA; run on CPU ranks with gloo (--cpu, and "
     "device 'cpu' in the script) or use a GPU machine."),
    (("doesn't have NCCL built in", "ProcessGroupNCCL is only supported with GPUs",
      "NCCL is not available"),
     "hint: nccl needs NVIDIA GPUs and a CUDA build of torch; on CPU ranks use the gloo backend."),
    (("CUDA out of memory", "OutOfMemoryError"),
     "hint: the GPU ran out of memory; try a smaller batch, a smaller model or fewer ranks per GPU."),
    (("Address already in use", "EADDRINUSE"),
     "hint: a port was already taken; do not hard-code MASTER_PORT (29500), let the launcher pick one."),
]

# gloo's full mesh (built in init_process_group) could not connect a pair: the side that dials
# says "timed out connecting ... remote=[addr]", the side that waits "Connect timeout". Only on
# several nodes is that a question of which network interface: on one node it is a peer that
# died or was slow; and a "No route to host" outside connectFullMesh is the store (MASTER_ADDR
# or the rendezvous endpoint), not a gloo pair.
UNREACHABLE_WORDS = ("timed out connecting", "No route to host", "Network is unreachable", "Connect timeout")
UNREACHABLE = ("hint: a rank could not reach another rank's gloo address. Without GLOO_SOCKET_IFNAME gloo "
               "listens on the address the machine's own name resolves to (or loopback if that is not "
               "a local address), which on a machine with several networks may be one the others cannot "
               "reach; set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME for nccl) to the interface the "
               "machines share (see `ip -4 addr`), on every node.")


def explain(exitcode):
    if exitcode in SIGNALS:
        return SIGNALS[exitcode]
    if exitcode is not None and exitcode < 0:
        return f"killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def hint(failure):
    """One line for a common root cause, or None. The network-interface hint needs the run's
    node count (failure["nnodes"], from config.json: root_cause puts it there)."""
    if not failure:
        return None
    text = f"{failure.get('message', '')}\n{failure.get('traceback', '')}"
    for words, line in HINTS:
        if any(w in text for w in words):
            return line
    if (failure.get("nnodes") or 1) > 1 and "connectFullMesh" in text and any(w in text for w in UNREACHABLE_WORDS):
        return UNREACHABLE
    return None


def _errors(run_dir):
    return [e for e in (read_json(p) for p in rundir.error_files(run_dir)) if e]


def _silent(run_dir, rank, exitcode):
    return {"rank": rank, "exitcode": exitcode, "message": f"rank {rank} {explain(exitcode)}",
            "traceback": tail_text(rundir.rank_log(run_dir, rank, "stderr"), 30)}


def _raised(run_dir, error, exitcode):
    tb = error.get("traceback") or tail_text(rundir.rank_log(run_dir, error["rank"], "stderr"), 30)
    return {"rank": error["rank"], "exitcode": exitcode, "message": error["message"], "traceback": tb}


def root_cause(run_dir):
    """{rank, exitcode, message, traceback[, same_error]} of the first failing rank, or None.

    Among the ranks torchrun reports for the final attempt: a rank that died without a
    Python exception and not of teardown (-9, a segfault, os._exit) is the cause, since the
    errors other ranks raise then ("connection closed by peer") are consequences; else the
    earliest exception; else a rank that aborted or was stopped. An exception counts only
    if the very process torchrun reports raised it (same pid), so an error file left by an
    earlier restart cannot win. `rank` is None when the agent itself was stopped. `nnodes`
    is the run's node count (for hint())."""
    failure = _root_cause(run_dir)
    if failure:
        failure["nnodes"] = (read_json(rundir.config(run_dir)) or {}).get("nnodes", 1)
    return failure


def _root_cause(run_dir):
    errors = _errors(run_dir)
    agent = read_json(rundir.agent_failures(run_dir)) or {}
    if agent.get("signal"):
        name = agent["signal"]
        code = -int(getattr(signal, name, signal.SIGTERM))
        return {"rank": None, "exitcode": code, "traceback": "",
                "message": f"the torchrun agent was stopped by {name} from outside the run "
                           f"(someone or something ended it); its ranks were ended with it"}
    rows = agent.get("failures") or []
    if rows:
        by_pid = {e.get("pid"): e for e in errors}
        silent = [r for r in rows if r["pid"] not in by_pid and r["exitcode"] not in TEARDOWN]
        if silent:
            first = min(silent, key=lambda r: (r["timestamp"], r["rank"]))
            return _silent(run_dir, first["rank"], first["exitcode"])
        raised = [(by_pid[r["pid"]], r["exitcode"]) for r in rows if r["pid"] in by_pid]
        if raised:
            error, code = min(raised, key=lambda x: x[0]["time"])
            return _same_errors(_raised(run_dir, error, code), [e for e, _ in raised])
        first = min(rows, key=lambda r: (TEARDOWN.index(r["exitcode"]) if r["exitcode"] in TEARDOWN
                                         else -1, r["timestamp"], r["rank"]))
        return _silent(run_dir, first["rank"], first["exitcode"])
    if errors:  # the agent left no record (it was killed): the latest attempt's errors
        latest = max(e.get("restart", 0) for e in errors)
        errors = [e for e in errors if e.get("restart", 0) == latest]
        first = min(errors, key=lambda e: e["time"])
        return _same_errors(_raised(run_dir, first, 1), errors)
    return None


def _same_errors(failure, errors):
    """Other ranks that raised the very same error are named, not shown again."""
    same = sorted(e["rank"] for e in errors
                  if e["rank"] != failure["rank"] and e["message"] == failure["message"])
    if same:
        failure["same_error"] = same
    return failure


def headline(failure):
    """One line: which rank failed first, and why."""
    if failure.get("rank") is None:
        return f"The run was stopped from outside: {failure['message']}"
    return f"Rank {failure['rank']} failed first ({explain(failure['exitcode'])}): {failure['message']}"


def describe(failure, traceback=True):
    """A few lines for a person: which rank, why, a hint for common causes, and (unless the
    ranks' output was already shown) the traceback, once."""
    if not failure:
        return f"The run failed before any rank reported an error; see {rundir.agent_log('')} in its run directory."
    lines = [headline(failure)]
    if failure.get("same_error"):
        ranks = ", ".join(map(str, failure["same_error"]))
        lines.append(f"(rank {ranks} raised the same error)")
    tip = hint(failure)
    if tip:
        lines.append(tip)
    tb = (failure.get("traceback") or "").rstrip()
    if traceback and tb:
        lines.append(tb)
    return "\n".join(lines)


NETWORK_HANG = ("hint: on several nodes, ranks that wait in init_process_group often cannot reach "
                "each other's address (gloo connects every pair there): gloo listens on the address the "
                "machine's own name resolves to unless GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME for nccl) "
                "names the interface the machines share; set it on every node.")
NO_RANKS = ("hint: no rank reported where it was; on several nodes the torchrun agents wait in the "
            "rendezvous until every node has joined: check that the other nodes were started, with the "
            "same --rdzv-endpoint and --rdzv-id, and can reach the endpoint's port.")


def after_timeout(message, config, where=None):
    """The timeout message, with a hint for a multi-node run: the network hint when ranks
    waited in init_process_group (and none was in a collective: waiting there after the group
    formed is not a reachability problem), the rendezvous hint when no rank reported at all."""
    if (config or {}).get("nnodes", 1) <= 1:
        return message
    states = {w.get("state") for w in (where or {}).values()}
    if not states:
        return f"{message}\n{NO_RANKS}"
    if "init" in states and "collective" not in states:
        return f"{message}\n{NETWORK_HANG}"
    return message
