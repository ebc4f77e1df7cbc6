"""Notebook 09's checks at a world size the notebook does not run (it runs at DDP_LESSON_NPROC,
2 in CI): 3 gloo CPU ranks, in one real torchrun run (tests/scripts/scratch_cases.py), 2 steps
each (step 1 on DDP's one first-step bucket, step 2 on its rebuilt buckets).

At the notebook's own world size these checks run in the notebook itself and are not repeated
here: the ring all-reduce against dist.all_reduce with measured bytes (cell 09-18), stages
(a)-(c) of work/ddp_scratch.py's main against torch DDP after every step, with DDP's buckets
one-then-rebuilt (09-24), the exercise checker accepting the solution and rejecting the
starter, a blocking hook, an async-then-wait hook and a hook that holds every bucket back to
the last gradient (09-31, 09-33). Added here: stage (d) with the solution at 3 ranks, a hook
that all-reduces everything in one bucket of its own (rejected: the layout is the checker's),
and stage d refused without a file."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_lesson import exercises, launch
from ddp_lesson.lesson import SCRIPTS

WORLD = 3
STEPS = 2
CASES = Path(__file__).resolve().parent / "scripts" / "scratch_cases.py"


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs09")
    good = exercises.bucketed_solution(base / "bucketed_solution.py")
    one = base / "bucketed_one.py"        # a correct hook, but everything in one bucket of its own
    one.write_text(good.read_text().replace("if size >= bucket_bytes:", "if False:"))
    files = {"solution": good, "starter": SCRIPTS / "bucketed_exercise.py", "one": one,
             "blocking": exercises.bucketed_solution(base / "bucketed_blocking.py", blocking=True),
             "waiting": exercises.bucketed_solution(base / "bucketed_waiting.py", waiting=True),
             "late": exercises.bucketed_solution(base / "bucketed_late.py", late=True)}
    run = launch.start(CASES, nproc=WORLD, cpu=True, run_dir=base / "cases", timeout=600,
                       args=["--steps", STEPS, "--bucket-kb", 8,
                             *[a for name, path in files.items() for a in ("--bucketed", f"{name}={path}")]])
    try:
        result = run.wait()
        assert result["status"] == "ok", result.get("message")
        yield json.loads((run.run_dir / "cases.json").read_text())
    finally:
        run.stop()


def layout(order, sizes, cap):
    buckets, current, size = [], [], 0
    for i in order:
        current.append(i)
        size += sizes[i]
        if size >= cap:
            buckets.append(sorted(current))
            current, size = [], 0
    return buckets + ([sorted(current)] if current else [])


@pytest.mark.parametrize("stage", "abcd")
def test_stage_equals_torch_ddp_every_step(cases, stage):
    assert cases["world_size"] == WORLD
    s = cases["bucketed"]["solution"] if stage == "d" else cases["stages"][stage]
    assert s["ranks_differed_before"] and s["equal_after_broadcast"]   # the broadcast is proven
    assert s["allclose_every_step"], s["steps"]
    assert len(s["steps"]) == STEPS
    calls = {st["calls"] for st in s["steps"]}
    expected = {"a": cases["parameters"], "b": 1, "c": cases["parameters"], "d": len(s["buckets"] or [])}
    assert calls == {expected[stage]}
    in_backward = {st["calls_in_backward"] for st in s["steps"]}
    assert in_backward == ({0} if stage in "ab" else {expected[stage]})   # c, d overlap backward
    assert {st["blocking_in_backward"] for st in s["steps"]} == {0}


def test_ddp_buckets_one_then_rebuilt_in_ready_order(cases):
    p = cases["parameters"]
    for s in list(cases["stages"].values()) + [cases["bucketed"]["solution"]]:
        assert s["steps"][0]["ddp_buckets"] == [list(range(p))]          # step 1: one bucket
        expected = layout(s["ready_order"], s["param_bytes"], s["bucket_bytes"])
        assert len(expected) > 1
        assert all(st["ddp_buckets"] == expected for st in s["steps"][1:])


def test_exercise_checker_accepts_solution_rejects_starter_one_bucket_and_blocking(cases):
    ok, why = exercises.check_bucketed(cases["bucketed"]["solution"])
    assert ok, why
    ok, why = exercises.check_bucketed(cases["bucketed"]["starter"])
    assert not ok and "weights differ" in why, why
    for name in ("blocking", "waiting"):    # async_op=False, or async_op=True and .wait() in the hook
        ok, why = exercises.check_bucketed(cases["bucketed"][name])
        assert not ok and "backward waited" in why, (name, why)
    ok, why = exercises.check_bucketed(cases["bucketed"]["one"])
    assert not ok and "expected one per bucket" in why, why   # the layout is the checker's, not the learner's


def test_exercise_checker_rejects_buckets_held_back_to_the_last_gradient(cases):
    # Async, the right buckets, all during backward, but every launch waits for the model's
    # last gradient: stage (b)'s timing. Each bucket must go out when its own last gradient is ready.
    ok, why = exercises.check_bucketed(cases["bucketed"]["late"])
    assert not ok and "gradients were ready" in why, why


def test_bucket_layout_is_reverse_registration_closed_at_the_cap():
    assert exercises.bucket_layout([4, 8, 4, 8], 12) == [[3, 2], [1, 0]]
    assert exercises.bucket_layout([4, 8, 4, 8], 100) == [[3, 2, 1, 0]]
    assert exercises.bucket_layout([4, 8, 4, 8], 1) == [[3], [2], [1], [0]]


def test_stage_d_without_a_file_is_refused_before_starting():
    # The refusal comes from argparse, before any process group: plain python is enough.
    proc = subprocess.run([sys.executable, str(SCRIPTS / "ddp_scratch.py"), "--stages", "a,d"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "stage d is the exercise: pass --bucketed FILE" in proc.stderr, proc.stderr


def test_ring_all_reduce_equals_dist_all_reduce(cases):
    rows = [row for rank_rows in cases["ring"] for row in rank_rows]
    assert len(cases["ring"]) == WORLD and len(rows) == 6 * WORLD
    for row in rows:
        assert row["allclose"], row
        assert abs(row["bytes_sent"] - row["ring_bytes"]) <= 2 * 4, row   # 2(N-1)/N x size
        # measured (/proc/self/io): the same bytes, plus a header per message
        assert row["ring_bytes"] - 8 <= row["bytes_written"] <= row["ring_bytes"] + 8 + 512 + 256 * row["messages"], row
