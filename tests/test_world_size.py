"""World size is a parameter of the course (DESIGN.md "world size" and "evaluation rows").

DDP_LESSON_NPROC=N sets the default number of CPU ranks; every lesson script counts each
test sample exactly once at any world size. The runs are real torchrun trees at 1 and 3
gloo ranks (3 does not divide the 1024 test samples, so DistributedSampler's padding
would show as 1026), all started together so the suite pays torchrun's start-up once.
ddp_basic.py at 3 ranks is not launched here: test_timing.py's straggler run is that run
(ddp_basic.py, 3 ranks, 1 epoch) and asserts the same count on every rank.
ddp_checks.py at 3 ranks (overlap, buffers, map_location) is not launched here: notebook 03b's
3-rank rerun (conftest.py) asserts all of it on every rank, in its timeline cell."""
import json
from pathlib import Path

import pytest

from ddp_lesson import BadInput
from ddp_lesson.rank import data
from ddp_lesson.launcher import devices, launch, runs
from ddp_lesson.notebook.widgets import DevicePicker
from ddp_lesson.rank.bundled import script

TINY = ["--epochs", "1", "--train-samples", "96", "--batch-size", "16"]
TEST_SET_SIZE = len(data.shapes_split(train=False))

RUNS = {  # name: (script, nproc, args, the key of its test-accuracy row)
    "basic_1": ("ddp_basic.py", 1, TINY, "test_accuracy"),
    "accum_3": ("ddp_accum.py", 3, TINY + ["--accum-steps", "2", "--sync-bn"], "test_accuracy"),
}


def test_default_cpu_ranks_follow_ddp_lesson_nproc(monkeypatch):
    monkeypatch.delenv("DDP_LESSON_NPROC", raising=False)
    assert devices.plan(available=[]).nproc == min(2, devices.cpu_count())
    for n in (1, 3, 4):
        monkeypatch.setenv("DDP_LESSON_NPROC", str(n))
        assert devices.plan(available=[]).nproc == n
        assert DevicePicker(gpus=[]).selection() == {"nproc": n}
        assert devices.plan(nproc=2, available=[]).nproc == 2  # an explicit request wins


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_bad_ddp_lesson_nproc_is_one_sentence(monkeypatch, value):
    monkeypatch.setenv("DDP_LESSON_NPROC", value)
    with pytest.raises(BadInput, match="DDP_LESSON_NPROC"):
        devices.plan(available=[])


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    base = tmp_path_factory.mktemp("world_size")
    # below pytest's 300 s: a run that hangs ends with the launcher's timeout message, which says
    # where each rank was, instead of pytest's (as on 3.13 once, in a whole suite: issue 41)
    timeout = 240
    started = {name: launch.start(script(file), nproc=nproc, cpu=True, args=args,
                                  run_dir=base / name, timeout=timeout)
               for name, (file, nproc, args, _) in RUNS.items()}
    started["unet_4"] = launch.start(script("unet_split.py"), nproc=4, cpu=True,
                                     run_dir=base / "unet_4", timeout=timeout)
    for run in started.values():  # all finish before any test ends: conftest allows no live run
        run.wait()
    yield started
    for run in started.values():
        run.stop()


@pytest.mark.parametrize("name", list(RUNS))
def test_evaluation_counts_each_test_sample_once(launched, name):
    script, nproc, _, key = RUNS[name]
    result = launched[name].wait()
    assert result["status"] == "ok", result.get("message")
    record = runs.load(launched[name].run_dir)
    assert record.config["world_size"] == nproc
    rows = [r for r in record.rows if key in r]
    assert rows, f"{script} logged no {key} row"
    assert {r["rank"] for r in rows} == set(range(nproc))
    for row in rows:
        assert row["test_samples"] == TEST_SET_SIZE, (script, nproc, row)


def test_lesson_scripts_share_one_evaluate():
    """ddp_syncbn's evaluate() is ddp_basic's (the lessons differ by a few lines), so the runs
    above cover it without a launch of its own."""
    def evaluate_of(name):
        src = script(name).read_text()
        start = src.index("def evaluate(")
        ends = [i for i in (src.find("\ndef ", start), src.find("\n@", start)) if i != -1]
        return src[start:min(ends)]   # the function alone, whatever follows it
    assert evaluate_of("ddp_basic.py") == evaluate_of("ddp_syncbn.py") == evaluate_of("ddp_accum.py")


def test_unet_split_split_checks_hold_where_the_sampler_pads(launched):
    """Notebook 07g at 4 ranks: 102 training samples need 2 repeats to make equal shards. The
    seeded split still puts every training sample on exactly one rank (besides those repeats);
    the UNet script's unseeded split does not, and the un-wrapped copies drift apart."""
    run = launched["unet_4"]
    assert run.wait()["status"] == "ok", run.result
    unet = json.loads((run.run_dir / "unet_split.json").read_text())
    assert unet["world_size"] == 4 and unet["padding"] == 2
    assert unet["seeded_shards_disjoint"] and unet["seeded_train_in_other_valid"] == 0
    assert not unet["unseeded_shards_disjoint"] and unet["unseeded_train_in_other_valid"] > 0
    assert unet["ddp_max_weight_diff"] == 0 < unet["no_ddp_max_weight_diff"]
