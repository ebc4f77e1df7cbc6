"""The equivalence checks of notebook 09 as tests: DDP built from scratch, stages (a)-(d),
against torch's DDP step by step, on 2 and 3 gloo CPU ranks (real torchrun runs), plus the
ring all-reduce against dist.all_reduce. All launches start together to share start-up."""
import ast
import json

import pytest

from ddp_lesson import launch
from ddp_lesson.lesson import SCRIPTS

WORLDS = (2, 3)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs09")
    started = {n: launch.start(SCRIPTS / "ddp_scratch.py", nproc=n, cpu=True, run_dir=base / f"scratch{n}",
                               args=["--steps", "3", "--time-steps", "0", "--bucket-kb", "8"], timeout=600)
               for n in WORLDS}
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
    expected = {"a": v["parameters"], "b": 1, "c": v["parameters"], "d": len(s["bucket_sizes"] or [])}
    assert calls == {expected[stage]}
    in_backward = {st["calls_in_backward"] for st in s["steps"]}
    assert in_backward == ({0} if stage in "ab" else {expected[stage]})   # c, d overlap backward


@pytest.mark.parametrize("world", WORLDS)
def test_buckets_match_torch_ddp_after_its_rebuild(launched, world):
    s = verdict(launched[world])["stages"]["d"]
    assert len(s["bucket_sizes"]) > 1
    assert [st["ddp_calls"] for st in s["steps"][1:]] == [len(s["bucket_sizes"])] * 2


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
