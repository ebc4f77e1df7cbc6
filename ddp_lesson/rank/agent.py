"""The torchrun agent's side of the guard: `python -m ddp_lesson.rank.agent [--parent PID]
[--signal TERM] -m torch.distributed.run ...` (main), with guard.py's parent ties. The agent becomes a child subreaper, so whatever a rank spawns (a daemon, a
new session) stays below it; notes itself in logs/agent.pid; runs torchrun (for a warm launch,
having it ask the warm processes for its ranks: warm.ranks); when torchrun returns, fails or is
stopped, ends every descendant and every process of this run (procs.run_processes) and writes
logs/agent.failures.json from torchrun's own failure record (rank, exit code, error file,
timestamp) or the signal that stopped it. If its launcher died (orphaned), it gives torchrun's
teardown AGENT_TEARDOWN_S seconds, then ends the rest and records the run as interrupted.
"""
import os
import signal
import sys
import time

from . import guard, rundir

WARM_RANKS_ENV = "DDP_LESSON_WARM_RANKS"   # warm.ranks.PATHS_ENV: the warm processes' sockets
PR_SET_CHILD_SUBREAPER = 36
AGENT_TEARDOWN_S = 15                # after its parent died, torchrun's teardown gets this long


def _run_identity():
    return os.environ.get(rundir.ENV), os.environ.get(rundir.TOKEN_ENV)


def sweep():
    """End every descendant of this process and every process of this run (same run
    directory and token), then reap what became our children. Called by the agent last."""
    try:
        import psutil
        from ddp_lesson.rank import procs
    except ImportError:
        return
    try:
        found = psutil.Process().children(recursive=True)
    except psutil.Error:
        found = []
    run_dir, token = _run_identity()
    if run_dir and token:
        found += procs.run_processes(run_dir, token=token)
    procs.kill_all(found)
    procs.wait_gone(found, timeout=5)
    for _ in guard.reaped():   # a subreaper inherits orphans: collect their exit statuses
        pass


def _write_failures(data):
    run_dir, _ = _run_identity()
    if not run_dir:
        return
    try:
        rundir.write_json(rundir.agent_failures(run_dir), data)
    except OSError:
        pass


def _record_agent_exit(e):
    """torchrun's own structured record of the final attempt, not its printed summary."""
    if type(e).__name__ == "ChildFailedError":
        rows = [{"rank": int(rank), "local_rank": f.local_rank, "pid": f.pid, "exitcode": f.exitcode,
                 "error_file": f.error_file, "timestamp": f.timestamp, "message": f.message}
                for rank, f in sorted(e.failures.items())]
        _write_failures({"failures": rows, "time": time.time()})
    elif type(e).__name__ == "SignalException":
        _write_failures({"signal": getattr(e, "sigval", signal.SIGTERM).name, "time": time.time()})


def run_agent(argv):
    guard.prctl(PR_SET_CHILD_SUBREAPER, 1)
    os.environ[guard.AGENT_ENV] = str(os.getpid())
    launcher = os.getppid()
    run_dir = _run_identity()[0]
    if run_dir:
        rundir.write_pid(run_dir, "agent")
    paths = os.environ.pop(WARM_RANKS_ENV, "")
    if paths:   # a warm launch: each rank is forked by its own warm process
        from .warm import ranks
        ranks.install(paths.split(os.pathsep))
    try:
        guard.run_target(argv, rank=None)
    except BaseException as e:
        _record_agent_exit(e)
        raise
    finally:
        sweep()
        if os.getppid() != launcher:   # nobody is left to say how the run ended: say it here
            rundir.record_orphaned(run_dir)


def orphaned():
    """The launcher died; torchrun got SIGTERM and tears down. If that takes too long,
    end the subtree and exit anyway."""
    time.sleep(AGENT_TEARDOWN_S)
    sweep()
    rundir.record_orphaned(_run_identity()[0])
    os._exit(1)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    sig, parent, _, argv = guard.options(argv, roles=())
    if not argv:
        sys.exit("usage: python -m ddp_lesson.rank.agent [--parent PID] [--signal TERM] -m torch.distributed.run ...")
    guard.watch_parent(sig, parent, on_orphan=orphaned)
    run_agent(argv)


if __name__ == "__main__":
    # the package's own modules run, not second copies named __main__
    from ddp_lesson.rank import agent
    agent.main()
