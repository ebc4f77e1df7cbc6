"""Where each rank was when a run timed out, from the Python stacks the ranks' guards dump
to logs/rank<R>.stack.log on SIGUSR1 (faulthandler's format), so the timeout message can
say whether a rank waited in a collective, in init_process_group, or was simply busy."""
import re

from ..rank import rundir

THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):", re.M)
FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)', re.M)
INIT = ("init_process_group", "rendezvous", "_create_c10d_store", "_store_based_barrier")


def _main_frames(text):
    """[(file, line, function)] of the main thread, innermost first."""
    m = re.match(r"main thread (0x[0-9a-f]+)", text)
    if not m:
        return []
    main = int(m.group(1), 16)
    heads = list(THREAD.finditer(text))
    for i, head in enumerate(heads):
        if int(head.group(1), 16) == main:
            end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
            return [(f, int(n), fn) for f, n, fn in FRAME.findall(text[head.end():end])]
    return []


def where(run_dir, nproc):
    """{rank: {"state": "collective"|"init"|"busy", "call": name, "at": "script.py line N",
    "complete": whether the dump was whole when read}}."""
    out = {}
    for rank in range(int(nproc or 0)):
        path = rundir.stack_file(run_dir, rank)
        try:
            frames = _main_frames(path.read_text(errors="replace"))
        except OSError:
            continue
        if not frames:
            continue
        # faulthandler writes a stack line by line, so a reader can catch it half written; a
        # whole main-thread stack reaches the program's top level (a "<module>" frame)
        complete = any(fn == "<module>" for _, _, fn in frames)
        script = next(((f, n) for f, n, _ in frames if f.endswith(rundir.SCRIPT)), None)
        dist = [fn for f, _, fn in frames if "torch/distributed" in f.replace("\\", "/")
                and fn not in ("wrapper", "inner", "_fn")]  # decorators say nothing
        outer = dist[-1] if dist else None  # the call the script made into torch.distributed
        state = "busy" if not dist else ("init" if any(fn in INIT for fn in dist) else "collective")
        at = f"{rundir.SCRIPT} line {script[1]}" if script else frames[0][0].rsplit("/", 1)[-1]
        out[rank] = {"state": state, "call": outer, "at": at, "complete": complete}
    return out


def timeout_message(timeout, where):
    head = f"The run did not finish within its {timeout:g} s timeout and was stopped"
    if not where:
        return (head + "; a rank may have been waiting for another (in a collective or in "
                       "init_process_group), or the script was still busy.")

    def names(state):
        return [r for r, w in sorted(where.items()) if w["state"] == state]

    def at(ranks):
        return ", ".join(f"rank {r} at {where[r]['at']}" for r in ranks)
    waiting, joining, busy = names("collective"), names("init"), names("busy")
    if waiting:
        calls = sorted({where[r]["call"] for r in waiting})
        line = (f": rank(s) {', '.join(map(str, waiting))} waited in the collective {', '.join(calls)} "
                f"({at(waiting)})")
        others = joining + busy
        return head + line + (f", which {at(others)} never reached." if others else
                              "; the ranks may have called different collectives.")
    if joining:
        return (head + f": rank(s) {', '.join(map(str, joining))} waited in init_process_group "
                f"({at(joining)})" + (f" for ranks that never joined ({at(busy)})." if busy else
                                      " for ranks that never joined."))
    return head + f": no rank was waiting for another; the script was still busy ({at(busy)})."
