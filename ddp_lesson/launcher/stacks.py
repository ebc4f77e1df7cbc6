"""Where each rank was when a run timed out, from the Python stacks the ranks' guards dump
to logs/rank<R>.stack.log on SIGUSR1 (faulthandler's format), so the timeout message can
say whether a rank waited in a collective, in init_process_group, or was simply busy.

Only the script's own frames count: those inner to the rank's guard (ddp_lesson/rank/guard.py,
which runs the script through runpy). Below the guard a forked (warm) rank's stack holds the
code that forked it: torch's elastic agent and multiprocessing, all in torch/distributed, which
must not read as a collective the script waits in."""
import re

from ..rank import rundir

THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):", re.M)
FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)', re.M)
CUT = re.compile(r"^\s+\.\.\.$", re.M)   # faulthandler keeps the innermost 100 frames, then "..."
INIT = ("init_process_group", "rendezvous", "_create_c10d_store", "_store_based_barrier")
GUARD = "ddp_lesson/rank/guard.py"
FORK = ("multiprocessing/process.py", "_bootstrap")   # where a forked process's own frames begin
TOP = ("<module>", "_run_module_as_main")              # a whole stack's outermost frame


def _path(filename):
    return filename.replace("\\", "/")


def _main_frames(text):
    """([(file, line, function)] of the main thread, innermost first; whether faulthandler cut
    off its outer frames)."""
    m = re.match(r"main thread (0x[0-9a-f]+)", text)
    if not m:
        return [], False
    main = int(m.group(1), 16)
    heads = list(THREAD.finditer(text))
    for i, head in enumerate(heads):
        if int(head.group(1), 16) == main:
            end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
            block = text[head.end():end]
            return [(f, int(n), fn) for f, n, fn in FRAME.findall(block)], bool(CUT.search(block))
    return [], False


def _plumbing(filename):
    f = _path(filename)
    return f.endswith(GUARD) or f == "<frozen runpy>" or f.endswith("/runpy.py")


def script_frames(frames, cut=False):
    """(the script's frames, innermost first, or None if this rank has left its script;
    whether that is known for sure).

    The script's frames are those inner to the innermost guard frame, less runpy's. A forked
    rank whose script has ended waits in torch's worker code: its own frames (those inner to
    the fork, multiprocessing's _bootstrap) hold no guard frame. A stack without either, cut
    off by faulthandler, is all the script's; one still being written is not known yet."""
    for i, (f, _, fn) in enumerate(frames):
        if _path(f).endswith(GUARD):
            return [x for x in frames[:i] if not _plumbing(x[0])], True
        if _path(f).endswith(FORK[0]) and fn == FORK[1]:
            return None, True
    whole = cut or bool(frames and frames[-1][2] in TOP)
    return [x for x in frames if not _plumbing(x[0])], whole


def where(run_dir, nproc):
    """{rank: {"state": "collective"|"init"|"busy"|"ended", "call": name, "at": "script.py line N",
    "complete": whether the dump was whole when read}}. "ended": a forked rank whose script
    has ended, waiting for the others as torch's worker code (a cold rank has exited then)."""
    out = {}
    for rank in range(int(nproc or 0)):
        path = rundir.stack_file(run_dir, rank)
        try:
            frames, cut = _main_frames(path.read_text(errors="replace"))
        except OSError:
            continue
        if not frames:
            continue
        # faulthandler writes a stack line by line, so a reader can catch it half written: it
        # is whole for us once it reaches the guard (or the fork, or the program's top level)
        own, complete = script_frames(frames, cut)
        if own is None:
            out[rank] = {"state": "ended", "call": None, "at": None, "complete": complete}
            continue
        dist = [fn for f, _, fn in own if "torch/distributed" in _path(f)
                and fn not in ("wrapper", "inner", "_fn")]  # decorators say nothing
        outer = dist[-1] if dist else None  # the call the script made into torch.distributed
        state = "busy" if not dist else ("init" if any(fn in INIT for fn in dist) else "collective")
        # the script's file is the outermost of its frames (runpy ran it); "at": its innermost line
        top = own[-1][0] if own else None
        line = next((n for f, n, _ in own if f == top), None)
        name = _path(top).rsplit("/", 1)[-1] if top else _path(frames[0][0]).rsplit("/", 1)[-1]
        at = f"{name} line {line}" if line else name
        out[rank] = {"state": state, "call": outer, "at": at, "complete": complete}
    return out


def timeout_message(timeout, where):
    head = f"The run did not finish within its {timeout:g} s timeout and was stopped"
    # a rank whose script had ended is left out, as a cold rank that exited then sent no stack
    where = {r: w for r, w in (where or {}).items() if w["state"] != "ended"}
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
