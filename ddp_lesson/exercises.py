"""Checkers for the exercises of 03-05 that launch a DDP script and read its run.

    run_dir = exercises.attempt("work/ex_set_epoch.py", exercises.check_set_epoch)

Each check_* reads a finished run directory (config.json and the ranks' metrics; check_no_sync
also the learner's prediction) and raises
AssertionError with one sentence saying what is wrong, or returns a line saying what it saw.
Expectations come from the run's own world size.
"""
from collections import defaultdict

from . import launch, runs


def attempt(script, check, nproc=None, timeout=300):
    """Launch `script` on CPU ranks, wait, run `check` on its run directory and print the
    verdict. Returns (run_dir, passed)."""
    run = launch.start(script, nproc=nproc, cpu=True, timeout=timeout)
    run.wait()
    try:
        print("correct!", check(run.run_dir))
        return run.run_dir, True
    except AssertionError as e:
        print("not yet:", e)
        return run.run_dir, False


def _finished(run_dir):
    rec = runs.load(run_dir)     # reads config.json, result.json and the metrics once
    assert rec.status == "ok", f"the run ended {rec.status}: {(rec.result or {}).get('message')}"
    return rec, rec.config["world_size"]


def check_set_epoch(run_dir):
    """03: every epoch a new order, the same shuffle on every rank: disjoint shards that
    together cover all the data set's samples once per epoch, and change from epoch to epoch."""
    rec, world = _finished(run_dir)
    order = defaultdict(list)                    # (rank, epoch) -> indices in training order
    sizes = {row["samples"] for row in rec.rows if "samples" in row}
    assert len(sizes) == 1, "the run did not log its data set's size (samples) once, the same on every rank"
    n = sizes.pop()
    for row in rec.rows:
        if "indices" in row:
            order[row["rank"], row["epoch"]].extend(row["indices"])
    epochs = sorted({e for _, e in order})
    assert len(epochs) >= 2, "the run logged fewer than 2 epochs of indices"
    for e in epochs:
        shards = [order[r, e] for r in range(world)]
        everything = sorted(i for s in shards for i in s)
        assert everything == sorted(set(everything)), \
            f"epoch {e}: some sample was trained on by two ranks (are the shards still DistributedSampler's?)"
        assert everything == list(range(n)), \
            f"epoch {e}: the shards cover {len(set(everything) & set(range(n)))} of the {n} samples"
    for a, b in zip(epochs, epochs[1:]):
        for r in range(world):
            assert order[r, a] != order[r, b], \
                f"rank {r} saw the same samples in the same order in epochs {a} and {b}"
        assert world == 1 or any(set(order[r, a]) != set(order[r, b]) for r in range(world)), \
            f"every rank trained on the same samples in epochs {a} and {b}, only reordered: " \
            "shuffle all n indices, then give each rank its share"
    return f"{world} rank(s), {len(epochs)} epochs, each epoch a new order"


def check_bn_average(run_dir):
    """04: plain BatchNorm in training, then every rank holds the average over ranks of each
    BN layer's running statistics (the ones the ranks logged before, `own`)."""
    rec, world = _finished(run_dir)
    assert world > 1, "with one rank there is nothing to average: run it on 2 or more"
    own = {row["rank"]: row for row in rec.rows if "own" in row}
    after = {row["rank"]: row["after"] for row in rec.rows if "after" in row}
    assert sorted(own) == sorted(after) == list(range(world)), \
        "not every rank logged its BatchNorm statistics before and after the exercise's lines"
    types = own[0]["bn_types"]
    assert types, "the model has no BatchNorm layer"
    synced = [t for t in types if "Sync" in t]
    assert not synced, (f"{len(synced)} of {len(types)} layers are {synced[0]}: this exercise keeps plain "
                        "BatchNorm in training and averages its statistics afterwards")
    spread = off = 0.0
    for key in ("running_mean", "running_var"):
        for layer in range(len(types)):
            mine = [own[r]["own"][key][layer] for r in range(world)]
            average = [sum(v) / world for v in zip(*mine)]
            for r in range(world):
                got = after[r][key][layer]
                spread = max(spread, max(abs(a - b) for a, b in zip(got, after[0][key][layer])))
                off = max(off, max(abs(a - b) for a, b in zip(got, average)))
    assert spread < 1e-4, f"the ranks' running statistics still differ by up to {spread:.3g}"
    assert off < 1e-4, f"the ranks agree, but not on the average of their own statistics (off by up to {off:.3g})"
    return f"{len(types)} {types[0]} layers: every one of {world} ranks holds the average (max error {off:.1e})"


def all_reduced(run_dir):
    """05: {placement: [rank][micro-batch] -> did its forward and backward all-reduce?}, from
    the rows ex_no_sync.py logged."""
    rec, world = _finished(run_dir)
    out = {}
    for row in sorted((r for r in rec.rows if "placement" in r), key=lambda r: (r["rank"], r["step"])):
        ranks = out.setdefault(row["placement"], [[] for _ in range(world)])
        ranks[row["rank"]].append(row["all_reduces"] > 0)
    return out


def check_no_sync(run_dir, predicted):
    """05: `predicted` maps each placement of no_sync() to the micro-batches (numbered from 1)
    whose forward and backward all-reduce; compared with what the run measured on every rank."""
    measured = all_reduced(run_dir)
    assert measured, "the run logged no micro-batches"
    for placement, ranks in measured.items():
        synced = [[k + 1 for k, on in enumerate(row) if on] for row in ranks]
        assert all(s == synced[0] for s in synced), f"{placement}: the ranks all-reduced at different micro-batches {synced}"
        guess = predicted.get(placement)
        assert guess is not None, f"no prediction yet for {placement!r}"
        assert sorted(guess) == synced[0], \
            f"{placement}: you said micro-batches {sorted(guess)}, which is not what the run measured"
    return f"all {len(measured)} placements as the run measured them on {len(ranks)} rank(s)"


# -- lesson 09: the bucketed hook ---------------------------------------------------------
_BUCKETED_HOOK = '''    def hook(self, p):
        i, offset = self.where[p]
        self.flat[i][offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):    # the bucket's last gradient arrived
            %s

    def finish(self):
        for i, bucket in enumerate(self.buckets):
            %s
            self.flat[i] /= dist.get_world_size()
            for p in bucket:
                offset = self.where[p][1]
                p.grad.copy_(self.flat[i][offset:offset + p.numel()].view_as(p))
        self.ready = [0] * len(self.buckets)
        self.works = [None] * len(self.buckets)
'''


def bucketed_solution(path, starter=None, blocking=False, waiting=False):
    """09: write a solution of the bucketed-hook exercise to `path`: the starter file with
    `hook` and `finish` written. Wrong ones, which check_bucketed must reject: blocking=True
    (the hook's all-reduce is async_op=False), waiting=True (async_op=True, then .wait() in
    the hook): either way backward stalls on the network."""
    from pathlib import Path

    from .lesson import SCRIPTS
    text = Path(starter or SCRIPTS / "bucketed_exercise.py").read_text()
    head = text[:text.index("    def hook(self, p):")]
    launch, wait = "self.works[i] = dist.all_reduce(self.flat[i], async_op=True)", "self.works[i].wait()"
    if blocking:
        launch, wait = "dist.all_reduce(self.flat[i])", "pass"
    if waiting:
        launch, wait = "dist.all_reduce(self.flat[i], async_op=True).wait()", "pass"
    body = _BUCKETED_HOOK % (launch, wait)
    Path(path).write_text(head + body)
    return path


def bucket_layout(param_bytes, cap):
    """09: the exercise's buckets, as parameter indices: reverse registration order, a bucket
    closed once it holds >= cap bytes (the rule DDP applies to the order it measured)."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(param_bytes))):
        current.append(i)
        size += param_bytes[i]
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def check_bucketed(stage):
    """09: a stage (d) result of ddp_scratch.check_stage (the learner's Bucketed beside torch
    DDP). Returns (ok, why): the weights equal DDP's after every step; one all-reduce per
    bucket per step, of exactly the bucket's elements (the layout is computed here from the
    parameters' sizes and the cap, not read from the learner's object); each started during
    backward, which never waited for one (neither async_op=False nor a wait() in the hook)."""
    expected = sorted(sum(stage["param_bytes"][i] for i in b) // 4    # fp32 elements per bucket
                      for b in bucket_layout(stage["param_bytes"], stage["bucket_bytes"]))
    n = len(expected)
    for i, st in enumerate(stage["steps"], 1):
        if not st["allclose"]:
            return False, f"step {i}: weights differ from torch DDP by {st['max_abs_diff']:.2e}"
        if st["calls"] != n:
            return False, f"step {i}: {st['calls']} all_reduce calls, expected one per bucket ({n})"
        if st["numels"] != expected:
            return False, (f"step {i}: all-reduced tensors of {st['numels']} elements, expected the "
                           f"buckets' {expected}: one flat tensor per bucket, as laid out")
        if st["calls_in_backward"] != n:
            return False, f"step {i}: only {st['calls_in_backward']} of {n} all-reduces started during backward"
        if st["blocking_in_backward"]:
            return False, (f"step {i}: backward waited for {st['blocking_in_backward']} all-reduce(s) "
                           f"(blocking: async_op=False, or wait() in the hook); use async_op=True "
                           f"and wait in finish()")
    return True, f"equal to torch DDP for {len(stage['steps'])} steps, {n} buckets, every all-reduce async in backward"


def check_global_batch(run_dir):
    """11: every optimizer step saw the global batch the script asked for (summed over
    ranks), at the run's world size. Reads `global_batch_asked` and `micro_batch` (logged
    once, before training) and each rank's per-step count (`samples`, or `windows` in
    gpt_ddp.py). Where no whole number of micro-batches per rank gives the global batch
    (48 samples in micro-batches of 4 on 5 ranks), the right answer is to refuse: a run
    that ended before its first step with `raise SystemExit(message)` (exit status 1, the
    message and no traceback on stderr) is accepted then; any other crash is not."""
    rec = runs.load(run_dir)
    world = rec.config["world_size"]
    head = next((row for row in rec.rows if "global_batch_asked" in row), None)
    assert head, "the run did not log the global batch it asked for (global_batch_asked)"
    asked, micro = head["global_batch_asked"], head.get("micro_batch")
    per_step = defaultdict(dict)                 # step -> {rank: samples this rank used}
    for row in rec.rows:
        n = row.get("samples", row.get("windows"))
        if n is not None:
            per_step[row["step"]][row["rank"]] = n
    if rec.status != "ok":
        message = (rec.result or {}).get("message")
        assert micro and asked % (micro * world) and not per_step, f"the run ended {rec.status}: {message}"
        failure = (rec.result or {}).get("failure") or {}
        assert failure.get("exitcode") == 1 and "Traceback" not in failure.get("traceback", ""), (
            f"the run crashed, which is not a refusal (refuse with raise SystemExit(message)): {message}")
        return (f"refused before training, as it should: {asked} samples do not split into "
                f"micro-batches of {micro} on {world} ranks")
    assert per_step, "the run logged no training steps"
    for step, by_rank in sorted(per_step.items()):
        assert sorted(by_rank) == list(range(world)), f"step {step}: not every rank logged it"
        total = sum(by_rank.values())
        assert total == asked, (f"step {step}: {total} samples over {world} rank(s), not the "
                                f"{asked} asked for (ranks x micro-batch x accumulation steps)")
    return f"{len(per_step)} steps of {asked} samples each on {world} rank(s)"
