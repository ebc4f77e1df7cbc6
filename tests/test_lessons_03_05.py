"""The checks of notebooks 03-05, as tests: the same check scripts, launched through
ddp_lesson.launch on 2 gloo CPU ranks; they write verdicts as JSON into their run directory.
All launches start together (module fixture) so the suite pays torchrun's start-up once."""
import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_lesson import launch, runs

SCRIPTS = Path(launch.__file__).parent / "scripts"
TINY = ["--epochs", "1", "--train-samples", "256", "--batch-size", "16"]

CHECKS = {
    "equivalence": ("ddp_equivalence.py", []),
    "find_unused": ("find_unused.py", []),
    "syncbn": ("syncbn_stats.py", ["4"]),
    "accum": ("accum_nosync.py", []),
    "basic": ("ddp_basic.py", TINY),
    "syncbn_train": ("ddp_syncbn.py", TINY + ["--sync-bn"]),
    "accum_train": ("ddp_accum.py", TINY + ["--accum-steps", "3"]),
    "checks": ("ddp_checks.py", []),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs03_05")
    started = {name: launch.start(SCRIPTS / script, nproc=2, cpu=True, args=args,
                                  run_dir=base / name, timeout=600)
               for name, (script, args) in CHECKS.items()}
    for run in started.values():  # all finish before any test ends: conftest allows no live run
        run.wait()
    yield started
    for run in started.values():
        run.stop()


def finished(run, filename=None):
    result = run.wait()
    assert result["status"] == "ok", result.get("message")
    return json.loads((run.run_dir / filename).read_text()) if filename else runs.load(run.run_dir)


def test_ddp_equals_one_process_every_step(launched):
    v = finished(launched["equivalence"], "equivalence.json")
    assert v["world_size"] == 2
    assert v["allclose_every_step"], v["steps"]
    assert len(v["steps"]) >= 5


def test_ddp_constructor_broadcasts_rank0_weights(launched):
    v = finished(launched["equivalence"], "equivalence.json")
    assert not v["weights_equal_before_ddp"] and v["weights_equal_after_ddp"]


def test_set_epoch_changes_the_shuffle(launched):
    v = finished(launched["equivalence"], "equivalence.json")
    assert v["epochs_repeat_without_set_epoch"] and v["epochs_differ_with_set_epoch"]
    assert v["shards_disjoint"]


def test_find_unused_parameters(launched):
    v = finished(launched["find_unused"], "find_unused.json")
    assert "find_unused_parameters" in (v["error_without_flag"] or "")
    assert v["ms_per_step_flag_on"] > 0 and v["ms_per_step_flag_off"] > 0


def test_syncbn_equals_bn_over_concatenated_batch(launched):
    ranks = finished(launched["syncbn"], "syncbn.json")
    assert len(ranks) == 2
    for r in ranks:
        assert r["sync_mean_matches_big_batch"] and r["sync_var_matches_big_batch"]
        assert r["sync_output_matches_big_batch"] and r["sync_input_grad_matches_big_batch"]
        assert not r["plain_bn_mean_matches_big_batch"]


def test_accumulation_exact_without_bn_and_not_with_bn(launched):
    v = finished(launched["accum"], "accum.json")
    assert v["no_bn_exact"]
    assert not v["bn_exact"] and v["bn_max_abs_diff"] > 1e-4


def test_no_sync_one_allreduce_per_step_same_weights(launched):
    v = finished(launched["accum"], "accum.json")
    c = v["counts"]
    assert c["no_sync"]["calls_per_optimizer_step"] == 1
    assert c["sync_every_micro_batch"]["calls_per_optimizer_step"] == v["k"]
    assert c["no_sync"]["bytes"] * v["k"] == c["sync_every_micro_batch"]["bytes"]
    assert v["same_weights"]


@pytest.mark.parametrize("name", ["basic", "syncbn_train", "accum_train"])
def test_lesson_scripts_train_and_log_per_rank(launched, name):
    rec = finished(launched[name])
    assert rec.ranks() == [0, 1]
    assert rec.series("loss", rank=0) and rec.series("train_accuracy", rank=1)
    assert rec.series("test_accuracy", rank=0)
    assert (rec.path / "model.pt").exists()


def test_accum_script_steps_once_per_window_including_partial(launched):
    rec = finished(launched["accum_train"])
    # 256 samples / 2 ranks / batch 16 = 8 micro-batches; k = 3 -> windows 3, 3, 2
    assert len(rec.series("loss", rank=0)) == 3


def test_sync_bn_flag_takes_no_value():
    # a common mistake is type=bool, where `--sync-bn False` means True
    out = subprocess.run([sys.executable, str(SCRIPTS / "ddp_syncbn.py"), "--sync-bn", "False"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unrecognized arguments: False" in out.stderr, out.stderr


@pytest.mark.parametrize("old,new,max_changed", [("ddp_basic.py", "ddp_syncbn.py", 12),
                                                 ("ddp_syncbn.py", "ddp_accum.py", 30)])
def test_each_lesson_script_is_a_small_diff(old, new, max_changed):
    a, b = (SCRIPTS / old).read_text().splitlines(), (SCRIPTS / new).read_text().splitlines()
    changed = [l for l in difflib.unified_diff(a, b, lineterm="", n=0)
               if l[:1] in "+-" and not l.startswith(("+++", "---"))]
    assert 0 < len(changed) <= max_changed, "\n".join(changed)


@pytest.mark.parametrize("name", ["ddp_basic.py", "ddp_syncbn.py", "ddp_accum.py"])
def test_lesson_scripts_show_every_ddp_line(name):
    # the one deliberate source test: the lesson is these lines, written out in the script
    src = (SCRIPTS / name).read_text()
    for needle in ("init_process_group", '"nccl" if use_cuda else "gloo"', 'os.environ["RANK"]',
                   'os.environ["LOCAL_RANK"]', 'os.environ["WORLD_SIZE"]', "MASTER_ADDR", "MASTER_PORT",
                   "set_device", "DistributedSampler", "set_epoch", "DDP(", "model.module.state_dict()",
                   "barrier()", "map_location", "destroy_process_group", "metrics.log(", "if rank == 0"):
        assert needle in src, f"{name} lacks {needle}"


def test_launch_variants():
    variants = SCRIPTS / "launch_variants"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=str(SCRIPTS.parent.parent))
    commands = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", "2", str(variants / "hello_torchrun.py")],
        "launch": [sys.executable, "-m", "torch.distributed.launch", "--nproc-per-node", "2",
                   "--master-port", str(launch.free_port()), "--use-env", str(variants / "hello_launch.py")],
        "spawn": [sys.executable, str(variants / "hello_spawn.py")],
    }
    procs = {k: subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, c in commands.items()}
    out = {k: p.communicate(timeout=300) for k, p in procs.items()}
    for k, p in procs.items():
        assert p.returncode == 0, out[k][1][-2000:]
        assert out[k][0].count("sum 2") == 2, out[k]
    assert "from the environment" in out["launch"][0]     # --use-env: LOCAL_RANK in the env
    assert "deprecated" in out["launch"][1]


def test_convert_sync_batchnorm_follows_where_the_model_lives(monkeypatch):
    import torch
    from ddp_lesson import models, syncbn
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # a GPU machine, CPU ranks
    model = syncbn.convert_sync_batchnorm(models.SmallCNN())
    kinds = {type(m) for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    assert kinds == {syncbn.CPUSyncBatchNorm}


def test_ddp_checks_timeline_is_the_measured_overlap(launched):
    # notebook 03b draws this: one bar per bucket all-reduce, the first inside backward
    for r in finished(launched["checks"], "ddp_checks.json"):
        small, one = r["overlap_small_buckets"], r["overlap_one_bucket"]
        for o in (small, one):
            assert len(o["timeline"]["all_reduces"]) == o["buckets"]
            assert all(0 <= start <= end for start, end in o["timeline"]["all_reduces"])
        assert small["timeline"]["all_reduces"][0][0] < small["timeline"]["backward_end"]
        assert one["timeline"]["all_reduces"][0][0] >= one["timeline"]["backward_end"]
        if r["world_size"] > 1:   # a no_grad forward turns the next forward's buffer broadcast off
            assert not r["buffers_equal_after_no_grad_forward"]


def test_single_process_script_trains_and_counts_every_test_sample(tmp_path):
    # notebook 03's diff starts from this script: it must run as it is, in one plain process
    env = dict(os.environ, DDP_LESSON_RUN_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(SCRIPTS.parent.parent))
    (tmp_path / "metrics").mkdir()
    out = subprocess.run([sys.executable, str(SCRIPTS / "train_single.py"), *TINY], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "test accuracy" in out.stdout and (tmp_path / "model.pt").exists()


def test_single_to_ddp_diff_is_the_ddp_lines():
    a = (SCRIPTS / "train_single.py").read_text().splitlines()
    b = (SCRIPTS / "ddp_basic.py").read_text().splitlines()
    diff = [l for l in difflib.unified_diff(a, b, lineterm="", n=0) if not l.startswith(("+++", "---"))]
    added = "\n".join(l for l in diff if l.startswith("+"))
    removed = "\n".join(l for l in diff if l.startswith("-"))
    for needle in ("init_process_group", "DistributedSampler(", "DDP(model", "set_epoch", "barrier()",
                   "destroy_process_group", "dist.all_reduce(counts)", "@record", "if rank == 0"):
        assert needle in added and needle not in removed, needle
    assert "shuffle=True" in removed          # the sampler shuffles instead of the loader
    assert sum(l[:1] in "+-" for l in diff) <= 80


def test_cpu_syncbn_stand_in_keeps_every_bn_shape_in_eval():
    # it replaces BatchNorm1d/2d/3d alike: eval() must still accept their 2D..5D inputs
    import torch
    from ddp_lesson import syncbn
    for bn, x in ((torch.nn.BatchNorm1d(4), torch.randn(5, 4)), (torch.nn.BatchNorm1d(4), torch.randn(5, 4, 3)),
                  (torch.nn.BatchNorm2d(4), torch.randn(2, 4, 3, 3)), (torch.nn.BatchNorm3d(4), torch.randn(2, 4, 2, 2, 2))):
        model = syncbn.convert_sync_batchnorm(torch.nn.Sequential(bn)).eval()
        assert isinstance(model[0], syncbn.CPUSyncBatchNorm)
        assert model(x).shape == x.shape
