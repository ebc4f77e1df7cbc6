"""IPython magics for a live world of ranks (ddp_lesson.launcher.world), after `%load_ext ddp_lesson`:

    %ranks start [-n N] [--gpus IDS] [--cpu] [--timeout S]   start (or start afresh) a world
    %%ranks [RANKS] [--timeout S]                            run the cell on every rank, or RANKS (0,2 or 0-2)
    %ranks status | %ranks restart | %ranks stop

A cell's output is one display, updated while it runs: each rank's lines side by side,
labelled, errors in red (HTML), with a plain-text form ("[rank 0] ...") for stored
notebooks and terminals. The cell's results (a list of world.RankResult, one per rank)
are left in the notebook's namespace as `_ranks`. A rank that raised makes the cell fail
with one line after the display, so "Run all" stops there as for any failing cell.
"""
import argparse
import html
import shlex
import threading
import time

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from .. import BadInput
from ..launcher import world as world_mod

LIVE_AFTER_S = 0.5     # a cell finishing sooner shows one display, not a live one
UPDATE_EVERY_S = 0.25  # at most 4 updates per second while a cell runs
LIVE_LINES = 40        # while a cell runs, each update shows each rank's last lines only
LIVE_CHARS = 20_000
RED, AMBER = "#cf222e", "#9a6700"

_world = None          # the world of this kernel's magics
_panels = []           # its WorldStatus displays, refreshed when it stops


def current_world():
    """The world %ranks started (None before, or after %ranks stop)."""
    return _world


class ShortError(Exception):
    """Shown by IPython as its one sentence, without a traceback of the magic's frames."""

    def _render_traceback_(self):
        return [f"\x1b[31m{self}\x1b[0m"]


class RanksTimeout(ShortError, TimeoutError):
    pass


class RanksOutput:
    """What the ranks printed in one cell, as text/plain and text/html."""

    def __init__(self, ranks):
        self.ranks = list(ranks)
        self.parts = {r: [] for r in self.ranks}   # [(kind, text)], kind: stdout/stderr/value/error
        self.note = ""                             # a line under the columns (a timeout, say)
        self.live = False                          # only each rank's latest output, while it runs

    def add(self, rank, kind, text):
        parts = self.parts[rank]
        if parts and parts[-1][0] == kind and not parts[-1][1].endswith("\n"):
            parts[-1] = (kind, parts[-1][1] + text)   # the rest of a line sent in pieces
        elif text:
            parts.append((kind, text))

    def shown(self, rank):
        """The parts to show: all of them, or while live the last LIVE_LINES lines
        (LIVE_CHARS at most), so that each live update costs the same however much
        came before; the whole output is shown once when the cell ends."""
        parts = self.parts[rank]
        if not self.live:
            return parts
        kept, lines, size = [], 0, 0
        for kind, chunk in reversed(parts):
            if lines >= LIVE_LINES or size >= LIVE_CHARS:
                kept.append(("note", "... (earlier lines: in full when the cell ends)\n"))
                break
            chunk, cut = chunk[-(LIVE_CHARS - size):], None
            if chunk.count("\n") > LIVE_LINES - lines:   # keep only its last lines
                cut = len(chunk)
                for _ in range(LIVE_LINES - lines + 1):
                    cut = chunk.rfind("\n", 0, cut)
                chunk = chunk[cut + 1:]
            kept.append((kind, chunk))
            lines, size = lines + chunk.count("\n"), size + len(chunk)
            if cut is not None:
                kept.append(("note", "... (earlier lines: in full when the cell ends)\n"))
                break
        return kept[::-1]

    def text(self):
        lines = []
        for r in self.ranks:
            for kind, chunk in self.shown(r):
                lead = f"[rank {r}] Out: " if kind == "value" else f"[rank {r}] "
                for i, line in enumerate(chunk.rstrip("\n").split("\n")):
                    lines.append((lead if i == 0 else f"[rank {r}] ") + line)
            if not self.parts[r]:
                lines.append(f"[rank {r}] (no output)")
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def html(self):
        cols = []
        for r in self.ranks:
            body = []
            for kind, chunk in self.shown(r):
                t = html.escape(chunk.rstrip("\n"))
                if kind == "value":
                    body.append(f"<pre style='margin:0'><span style='color:#57606a'>Out:</span> {t}</pre>")
                else:
                    color = {"error": RED, "stderr": AMBER, "note": "#57606a"}.get(kind, "inherit")
                    body.append(f"<pre style='margin:0;color:{color};white-space:pre-wrap'>{t}</pre>")
            cols.append("<div style='flex:1 1 0;min-width:14em;border-left:3px solid #d0d7de;"
                        "padding:0 .5em;overflow-x:auto'>"
                        f"<div style='font-weight:bold'>rank {r}</div>{''.join(body)}</div>")
        note = (f"<div style='color:{RED}'>{html.escape(self.note)}</div>" if self.note else "")
        return f"<div style='display:flex;flex-wrap:wrap;gap:.5em'>{''.join(cols)}</div>{note}"

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/plain": self.text(), "text/html": self.html()}

    def __repr__(self):
        return self.text()


class WorldStatus:
    """The world's one-line state with a Stop button (a widget where widgets work; the
    line alone in plain text)."""

    def __init__(self, world):
        import ipywidgets as W
        self.world = world
        self.label = W.HTML()
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop")
        self.stop_button.on_click(lambda _: self.stop_in_background())
        self.widget = W.HBox([self.stop_button, self.label])
        self.refresh()

    def refresh(self):
        self.label.value = html.escape(self.world.describe())
        self.stop_button.disabled = self.world.state in ("stopping", "stopped")

    def stop(self):
        self.stop_button.disabled = True
        self.world.stop()
        self.refresh()

    def stop_in_background(self):
        # a click must not hold the kernel up for the second or two a stop takes
        threading.Thread(target=self.stop, daemon=True, name="ddp-lesson-world-stop").start()

    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = dict(self.widget._repr_mimebundle_() or {})
        bundle["text/plain"] = self.world.describe()
        return bundle


def _show_status():
    """Show the world's status panel: one per world, shown again (not made anew) after a
    restart, so the panels do not pile up and every view of it stays current."""
    panel = next((p for p in _panels if p.world is _world), None) or WorldStatus(_world)
    _panels[:] = [panel]
    panel.refresh()
    display(panel)


def _refresh_panels():
    for panel in _panels:
        panel.refresh()


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one sentence, no usage block
        raise UsageError(f"{self.prog}: {message[0].upper()}{message[1:]}.")


def _start_parser():
    p = _Parser(prog="%ranks start", add_help=False)
    p.add_argument("-n", "--nproc", help="number of ranks (default: every free GPU where there are two or more, else 2 CPU ranks)")
    p.add_argument("--gpus", help="GPU ids like 0,1 (one rank each)")
    p.add_argument("--cpu", action="store_true", help="CPU ranks on gloo even where GPUs exist")
    p.add_argument("--timeout", help="seconds a cell may take (default 120)")
    return p


def _cell_parser():
    p = _Parser(prog="%%ranks", add_help=False)
    p.add_argument("ranks", nargs="?", help="ranks like 0,2 or 0-2 (default: all)")
    p.add_argument("--timeout", help="seconds this cell may take")
    return p


def parse_ranks(text):
    """"0,2" -> [range(0, 1), range(2, 3)]; "0-2" -> [range(0, 3)]; "all" or None ->
    None (every rank). Ranges are never spelled out, so "0-99999999" costs nothing;
    rank_list() checks them against a world."""
    if text is None or text == "all":
        return None
    spans = []
    for part in text.split(","):
        first, dash, last = part.partition("-")
        if not (_whole(first) and (_whole(last) if dash else not last)):
            raise UsageError(f"%%ranks: RANKS must look like 0,2 or 0-2, got {_short(text)}.")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise UsageError(f"%%ranks: the range {lo}-{hi} is empty; write it low to high, "
                             f"like {hi}-{lo}.")
        spans.append(range(lo, hi + 1))
    return spans


def rank_list(spans, world_size):
    """The ranks `spans` (from parse_ranks) name, sorted, once each; UsageError with one
    short sentence naming (at most a few of) those this world does not have."""
    if spans is None:
        return None
    bad = [range(max(s.start, world_size), s.stop) for s in spans if s.stop > world_size]
    if bad:
        names = [str(b.start) if len(b) == 1 else f"{b.start}-{b.stop - 1}" for b in bad[:3]]
        many = len(bad) > 1 or len(bad[0]) > 1
        raise UsageError(f"%%ranks: {'Ranks' if many else 'Rank'} {', '.join(names)}"
                         f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''} {'do' if many else 'does'} not "
                         f"exist: this world has ranks 0-{world_size - 1}.")
    return sorted({r for s in spans for r in s})


def _whole(text):
    """A plain whole number: digits only (no sign, spaces, '1e3' or 'inf'), at most 18."""
    return text.isascii() and text.isdigit() and len(text) <= 18


def _short(text, limit=40):
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _split(line):
    try:
        return shlex.split(line)
    except ValueError as e:
        raise UsageError(f"%ranks: cannot read the arguments ({e}).") from None


@magics_class
class RanksMagics(Magics):

    @line_cell_magic
    def ranks(self, line, cell=None):
        """%ranks start [-n N] [--gpus IDS] [--cpu] [--timeout S] | status | restart | stop;
        %%ranks [RANKS] [--timeout S] runs the cell on the ranks."""
        if cell is None:
            return self._command(_split(line))
        return self._cell(_split(line), cell)

    def _command(self, argv):
        global _world
        what = argv[0] if argv else ""
        if what == "start":
            a = _start_parser().parse_args(argv[1:])
            if _world is not None and _world.state != "stopped":
                _world.stop()
                print("Stopped the previous world.")
            _world = None
            print("Starting the ranks (torchrun, import torch, init_process_group) ...", flush=True)
            try:
                _world = world_mod.start(nproc=a.nproc, gpus=a.gpus, cpu=a.cpu, timeout=a.timeout)
            except (BadInput, ValueError) as e:
                raise UsageError(f"%ranks start: {e}") from None
            except RuntimeError as e:
                raise ShortError(str(e)) from None
            _show_status()
        elif what in ("stop", "status", "restart") and len(argv) == 1:
            if _world is None:
                if what == "stop":
                    print("No world is running.")
                    return
                raise UsageError("No world is running: start one with %ranks start.")
            if what == "stop":
                _world.stop()
                _refresh_panels()
                print(f"Stopped: every process of the world has ended ({_world.run_dir}).")
            elif what == "status":
                print(_world.describe())
            else:
                try:
                    _world.restart()
                except RuntimeError as e:
                    raise ShortError(str(e)) from None
                _show_status()
        else:
            raise UsageError("Use %ranks start [-n N] [--gpus IDS] [--cpu] [--timeout S], "
                             "%ranks status, %ranks restart or %ranks stop; %%ranks [RANKS] runs a cell.")

    def _cell(self, argv, cell):
        a = _cell_parser().parse_args(argv)
        spans = parse_ranks(a.ranks)
        w = _world
        if w is None or w.state in ("starting", "stopping", "stopped"):
            raise UsageError("No world is running: start one with %ranks start.")
        ranks = rank_list(spans, w.world_size)   # sorted, once each, all in this world
        out = RanksOutput(range(w.world_size) if ranks is None else ranks)   # World.run picks them
        live = _Live(out)
        try:
            results = w.run(cell, ranks=ranks, timeout=a.timeout, on_output=live.output)
        except ValueError as e:
            raise UsageError(f"%%ranks: {e}") from None
        except TimeoutError as e:
            for rank in getattr(e, "busy", ()):
                out.add(rank, "stderr", "(still busy)")
            live.finish([r for r in getattr(e, "results", ()) if r.rank not in getattr(e, "busy", ())])
            raise RanksTimeout(str(e)) from None
        except RuntimeError as e:
            raise ShortError(str(e)) from None
        except KeyboardInterrupt:
            out.note = ("Interrupted." if w.state == "ready" else
                        "Interrupted; a rank was blocked, so the world must restart: %ranks restart.")
            live.finish()
            raise
        live.finish(results)
        self.shell.user_ns["_ranks"] = results
        failed = [r.rank for r in results if r.error is not None]
        if failed:
            raise ShortError(f"{world_mod.ranks_text(failed).capitalize()} raised an exception "
                             f"(traceback above); the world is still running.")


class _Live:
    """One display of a cell's output: shown once the cell has run LIVE_AFTER_S (or at the
    end), then updated in place at most every UPDATE_EVERY_S."""

    def __init__(self, out):
        self.out = out
        self.t0 = time.monotonic()
        self.handle = None
        self.shown_at = 0.0
        self.dirty = False

    def output(self, rank, stream, text):
        self.out.add(rank, stream, text)
        self.dirty = True
        now = time.monotonic()
        if now - self.t0 >= LIVE_AFTER_S and now - self.shown_at >= UPDATE_EVERY_S:
            self._show(now)

    def _show(self, now, live=True):
        self.out.live = live
        if self.handle is None:
            self.handle = display(self.out, display_id=True)
        else:
            self.handle.update(self.out)
        self.shown_at, self.dirty = now, False

    def finish(self, results=()):
        for res in results:
            for kind in ("value", "error"):
                if getattr(res, kind) is not None:
                    self.out.add(res.rank, kind, getattr(res, kind))
                    self.dirty = True
        if self.handle is None or self.dirty or self.out.live:
            self._show(time.monotonic(), live=False)


def register(ipython):
    ipython.register_magics(RanksMagics)

