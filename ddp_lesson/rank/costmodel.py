"""The alpha-beta model of an all-reduce: t(bytes) = alpha + bytes / beta, fitted to a
sweep of measured message sizes (latency alpha in seconds, bandwidth beta in bytes/s).

    rows = costmodel.sweep(costmodel.QUICK_SIZES, device=device)   # on every rank
    model = costmodel.summarise([{"bytes": b, "seconds": s} for b, s in rows], world=2)
    costmodel.predict_seconds(grad_bytes, model["alpha"], model["beta"])   # one all-reduce

Used by notebook 06 and bench/allreduce_bandwidth.py (and to predict a DDP step's
communication time: the all-reduce of all gradient bytes).
"""
import sys
import time

QUICK_SIZES = [2 ** k for k in range(10, 23, 2)]   # 1 KiB .. 4 MiB
FULL_SIZES = [2 ** k for k in range(8, 27)]          # 256 B .. 64 MiB


# -- rank side: needs an initialised process group -------------------------------------
def sweep(sizes, iters=10, warmup=2, device=None):
    """[(bytes, seconds per all_reduce)] for each size; the seconds are the max over ranks
    (a collective is as slow as its slowest member)."""
    import torch
    import torch.distributed as dist

    device = device or torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        n = iters if nbytes <= 2 ** 22 else max(2, iters // 4)
        for _ in range(warmup):
            dist.all_reduce(x)
        sync()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        sync()
        dt = torch.tensor([(time.perf_counter() - t) / n], dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        out.append((x.numel() * 4, dt.item()))
    return out


# -- the model ---------------------------------------------------------------------------
def bandwidths(nbytes, seconds, world):
    """(algorithm bandwidth, bus bandwidth) in bytes/s. Bus bandwidth is what a ring moves
    over each link, algbw * 2(n-1)/n: comparable across rank counts."""
    algbw = nbytes / seconds
    return algbw, algbw * 2 * (world - 1) / world


def fit(rows):
    """alpha (s) and beta (bytes/s) of t = alpha + bytes/beta from rows with "bytes" and
    "seconds"; least squares on the relative error (so 1 KiB counts as much as 64 MiB)."""
    # minimise sum(((alpha + x*g) - y) / y)^2 over alpha and g = 1/beta: 2x2 normal equations
    s11 = s12 = s22 = b1 = b2 = 0.0
    for r in rows:
        x, y = r["bytes"], r["seconds"]
        w = 1.0 / (y * y)
        s11 += w; s12 += w * x; s22 += w * x * x; b1 += w * y; b2 += w * x * y
    det = s11 * s22 - s12 * s12
    alpha = (b1 * s22 - b2 * s12) / det
    g = (s11 * b2 - s12 * b1) / det
    if alpha <= 0:
        alpha = min(r["seconds"] for r in rows) / 2
    return alpha, (1 / g if g > 0 else float("inf"))


def predict_seconds(nbytes, alpha, beta):
    """Seconds of one all-reduce of `nbytes` on the fitted line."""
    return alpha + nbytes / beta


def summarise(rows, world, backend=None):
    """Add algbw/busbw to each sweep row and fit the line: {"rows", "alpha", "beta",
    "world", "backend"} (what `report` prints)."""
    for r in rows:
        r["algbw"], r["busbw"] = bandwidths(r["bytes"], r["seconds"], world)
    alpha, beta = fit(rows)
    return {"rows": rows, "alpha": alpha, "beta": beta, "world": world,
            "backend": backend or rows[0].get("backend", "?")}


def human(nbytes):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.3g} {unit}"
        nbytes /= 1024


def report(m, out=sys.stdout):
    """Print a `summarise` result: per size time, bandwidths and the fit, then the ratios."""
    n = m["world"]
    print(f"all_reduce on {n} rank{'s' if n != 1 else ''} ({m['backend']}):", file=out)
    print(f"{'size':>10} {'time':>10} {'algbw':>12} {'busbw':>12} {'fit':>10}", file=out)
    for r in m["rows"]:
        print(f"{human(r['bytes']):>10} {r['seconds'] * 1e6:8.0f}us {r['algbw'] / 1e6:8.1f}MB/s "
              f"{r['busbw'] / 1e6:8.1f}MB/s {predict_seconds(r['bytes'], m['alpha'], m['beta']) * 1e6:8.0f}us",
              file=out)
    small, large = m["rows"][0], m["rows"][-1]
    print(f"fit: latency alpha = {m['alpha'] * 1e6:.0f} us, bandwidth beta = {m['beta'] / 1e6:.0f} MB/s", file=out)
    if m["world"] == 1:        # busbw = algbw x 2(N-1)/N: one rank sends nothing
        print("one rank: the all-reduce sends no bytes, so there is no bus bandwidth to compare", file=out)
        return
    print(f"ratio: busbw at {human(large['bytes'])} / busbw at {human(small['bytes'])} = "
          f"{large['busbw'] / small['busbw']:.0f}x (small messages are latency-bound)", file=out)
    print(f"ratio: time at {human(large['bytes'])} / time at {human(small['bytes'])} = "
          f"{large['seconds'] / small['seconds']:.1f}x for {large['bytes'] / small['bytes']:.0f}x the bytes", file=out)
