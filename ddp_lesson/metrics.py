"""Script side: one JSON line per call in metrics/rank<R>.jsonl of the run directory.

    from ddp_lesson import metrics
    metrics.log(step, loss=loss.item(), accuracy=acc)

Cheap enough for every step (one small write, flushed). Outside the launcher
(DDP_LESSON_RUN_DIR unset, e.g. plain torchrun) it does nothing.
"""
import json
import math
import os
import time

_file = None


def _open():
    global _file
    run_dir = os.environ.get("DDP_LESSON_RUN_DIR")
    if not run_dir:
        return None
    folder = os.path.join(run_dir, "metrics")
    os.makedirs(folder, exist_ok=True)
    _file = open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a", buffering=1)
    return _file


def log(step, **values):
    """Append {rank, step, time, **values}; tensors and numpy scalars become floats."""
    f = _file or _open()
    if f is None:
        return
    row = {"rank": int(os.environ.get("RANK", "0")), "step": int(step), "time": time.time()}
    for k, v in values.items():
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = None  # NaN/inf are not JSON: a diverged loss is written as null
        row[k] = v
    f.write(json.dumps(row, allow_nan=False) + "\n")  # line-buffered: the newline flushes it
