"""The equivalence checks of notebook 09 as tests: DDP built from scratch, stages (a)-(d),
against torch's DDP step by step, on 2 and 3 gloo CPU ranks (real torchrun runs), plus the
ring all-reduce against dist.all_reduce. All launches start together to share start-up."""
import ast
import json

import pytest

from ddp_lesson import exercises, launch
from ddp_lesson.lesson import SCRIPTS

WORLDS = (2, 3)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs09")
    good = exercises.bucketed_solution(base / "bucketed_solution.py")
    blocking = exercises.bucketed_solution(base / "bucketed_blocking.py", blocking=True)
    waiting = exercises.bucketed_solution(base / "bucketed_waiting.py", waiting=True)   # async, then wait()
    one = base / "bucketed_one.py"        # a correct hook, but everything in one bucket of its own
    one.write_text(good.read_text().replace("if size >= bucket_bytes:", "if False:"))
    started = {n: launch.start(SCRIPTS / "ddp_scratch.py", nproc=n, cpu=True, run_dir=base / f"scratch{n}",
                               args=["--stages", "a,b,c,d", "--bucketed", str(good),
                                     "--steps", "3", "--time-steps", "0", "--bucket-kb", "8"], timeout=600)
               for n in WORLDS}
    for name, path in (("starter", SCRIPTS / "bucketed_exercise.py"), ("blocking", blocking),
                       ("waiting", waiting), ("one", one)):
        started[name] = launch.start(SCRIPTS / "ddp_scratch.py", nproc=2, cpu=True, run_dir=base / name,
                                     args=["--stages", "d", "--bucketed", str(path), "--steps", "2",
                                           "--time-steps", "0", "--bucket-kb", "8"], timeout=600)
    started.update({("ring", n): launch.start(SCRIPTS / "ring_allreduce.py", nproc=n, cpu=True,
                                              run_dir=base / f"ring{n}", timeout=600) for n in WORLDS})
    yield started
    for run in started.values():
        run.stop()


def verdict(run):
    result = run.wait()
    assert result["status"] == "ok", result.get("message")
    return json.loads((run.run_dir / "scratch.json").read_text())


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", "abcd")
def test_stage_equals_torch_ddp_every_step(launched, world, stage):
    v = verdict(launched[world])
    assert v["world_size"] == world
    s = v["stages"][stage]
    assert s["ranks_differed_before"] and s["equal_after_broadcast"]   # the broadcast is proven
    assert s["allclose_every_step"], s["steps"]
    assert len(s["steps"]) == 3
    calls = {st["calls"] for st in s["steps"]}
    expected = {"a": v["parameters"], "b": 1, "c": v["parameters"], "d": len(s["buckets"] or [])}
    assert calls == {expected[stage]}
    in_backward = {st["calls_in_backward"] for st in s["steps"]}
    assert in_backward == ({0} if stage in "ab" else {expected[stage]})   # c, d overlap backward
    assert {st["blocking_in_backward"] for st in s["steps"]} == {0}


def layout(order, sizes, cap):
    buckets, current, size = [], [], 0
    for i in order:
        current.append(i)
        size += sizes[i]
        if size >= cap:
            buckets.append(sorted(current))
            current, size = [], 0
    return buckets + ([sorted(current)] if current else [])


@pytest.mark.parametrize("world", WORLDS)
def test_ddp_buckets_one_then_rebuilt_in_ready_order(launched, world):
    v = verdict(launched[world])
    p = v["parameters"]
    for s in v["stages"].values():
        assert s["steps"][0]["ddp_buckets"] == [list(range(p))]          # step 1: one bucket
        expected = layout(s["ready_order"], v["param_bytes"], v["bucket_bytes"])
        assert len(expected) > 1
        assert all(st["ddp_buckets"] == expected for st in s["steps"][1:])


def test_exercise_checker_accepts_solution_rejects_starter_and_blocking(launched):
    for world in WORLDS:
        ok, why = exercises.check_bucketed(verdict(launched[world])["stages"]["d"])
        assert ok, why
    ok, why = exercises.check_bucketed(verdict(launched["starter"])["stages"]["d"])
    assert not ok and "weights differ" in why, why
    for name in ("blocking", "waiting"):    # async_op=False, or async_op=True and .wait() in the hook
        ok, why = exercises.check_bucketed(verdict(launched[name])["stages"]["d"])
        assert not ok and "backward waited" in why, (name, why)
    ok, why = exercises.check_bucketed(verdict(launched["one"])["stages"]["d"])
    assert not ok and "expected one per bucket" in why, why   # the layout is the checker's, not the learner's


def test_bucket_layout_is_reverse_registration_closed_at_the_cap():
    assert exercises.bucket_layout([4, 8, 4, 8], 12) == [[3, 2], [1, 0]]
    assert exercises.bucket_layout([4, 8, 4, 8], 100) == [[3, 2, 1, 0]]
    assert exercises.bucket_layout([4, 8, 4, 8], 1) == [[3], [2], [1], [0]]


def test_stage_d_without_a_file_is_refused_before_starting(tmp_path):
    run = launch.start(SCRIPTS / "ddp_scratch.py", nproc=1, cpu=True, run_dir=tmp_path / "r",
                       args=["--stages", "d"], timeout=120)
    result = run.wait()
    assert result["status"] != "ok"


@pytest.mark.parametrize("world", WORLDS)
def test_ring_all_reduce_equals_dist_all_reduce(launched, world):
    run = launched[("ring", world)]
    assert run.wait()["status"] == "ok"
    rows = []
    for rank in range(world):
        text = (run.run_dir / "logs" / f"rank{rank}.stdout.log").read_text()
        rows += [ast.literal_eval(l.split(": ", 1)[1]) for l in text.splitlines() if "'size'" in l]
    assert len(rows) == 7 * world
    for row in rows:
        assert row["allclose"], row
        assert abs(row["bytes_sent"] - row["ring_bytes"]) <= 2 * 4, row   # 2(N-1)/N x size
        # measured (/proc/self/io): the same bytes, plus a header per message
        assert row["ring_bytes"] - 8 <= row["bytes_written"] <= row["ring_bytes"] + 8 + 512 + 256 * row["messages"], row
