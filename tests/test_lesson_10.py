"""The mixed-precision, compression, sharding and checkpoint checks of notebook 10, as tests:
the same scripts, launched through ddp_lesson.launch on gloo CPU ranks (DDP_LESSON_NPROC,
else 2). Expectations come from each run's world size. All first launches start together."""
import json
import math

import pytest

from ddp_lesson import launch
from ddp_lesson.lesson import SCRIPTS


def finished(run, filename):
    result = run.wait()
    assert result["status"] == "ok", result.get("message")
    return json.loads((run.run_dir / filename).read_text())


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs10")
    ckpt = base / "ckpt"
    started = {
        "shard": launch.start(SCRIPTS / "beyond_shard.py", cpu=True, args=["--steps", "3"],
                              run_dir=base / "shard", timeout=300),
        "save": launch.start(SCRIPTS / "beyond_dcp.py", cpu=True, args=["--save", str(ckpt)],
                             run_dir=base / "save", timeout=300),
    }
    started["amp"] = launch.start(SCRIPTS / "beyond_amp.py", cpu=True, run_dir=base / "amp", timeout=300,
                                  args=["--precision", "fp16", "--steps", "2", "--batch-size", "8", "--max-norm", "0.2"])
    started["compress"] = launch.start(SCRIPTS / "beyond_compress.py", cpu=True, args=["--steps", "3"],
                                       run_dir=base / "compress", timeout=300)
    started["ckpt"] = ckpt
    yield started
    for run in started.values():
        if hasattr(run, "stop"):
            run.stop()


def test_zero_shards_the_optimizer_state_and_trains_like_ddp(launched):
    v = finished(launched["shard"], "shard.json")
    n, p = v["world_size"], v["params"]
    assert n == launched["shard"].config["world_size"]
    z = v["zero_state_floats_per_rank"]
    assert len(z) == n and sum(z) == 2 * p                       # Adam's two moments, split
    assert max(z) <= 2 * p / n + 2 * v["largest_param"]           # ~1/N, by whole parameters
    assert math.isclose(v["held"]["zero"]["optimizer"], 8 * p / n, rel_tol=0.02, abs_tol=8 * 2 * v["largest_param"])
    assert v["held"]["ddp"]["optimizer"] == 8 * p                 # DDP: all of it on every rank
    assert v["zero_max_weight_diff_vs_ddp"] < 1e-6


def test_fsdp2_shards_parameters_and_matches_ddp(launched):
    v = finished(launched["shard"], "shard.json")
    n, p = v["world_size"], v["params"]
    assert sum(v["fsdp_local_floats_per_rank"]) == p
    for name, (loc, full) in v["fsdp_local_shapes"].items():
        assert loc[1:] == full[1:] and loc[0] == math.ceil(full[0] / n), name   # rank 0's rows
    assert math.isclose(v["held"]["fsdp"]["params"], 4 * p / n, rel_tol=0.05)
    assert math.isclose(v["held"]["fsdp"]["optimizer"], 8 * p / n, rel_tol=0.05)
    assert v["fsdp_max_loss_diff_vs_ddp"] < 1e-5
    assert v["fsdp_max_weight_diff_vs_ddp"] < 1e-5


@pytest.mark.parametrize("other", ["plus_one", "one"])
def test_dcp_checkpoint_loads_at_another_world_size(launched, other, tmp_path):
    saved = finished(launched["save"], "dcp_save.json")
    n = saved["world_size"]
    assert len([f for f in saved["files"] if f.endswith(".distcp")]) == n
    nproc = n + 1 if other == "plus_one" else 1
    run = launch.start(SCRIPTS / "beyond_dcp.py", cpu=True, nproc=nproc,
                       args=["--load", str(launched["ckpt"])], run_dir=tmp_path / "load", timeout=300)
    loaded = finished(run, "dcp_load.json")
    assert loaded["world_size"] == nproc
    assert loaded["max_diff_before_load"] > 1e-3
    assert loaded["max_diff_vs_saved"] == 0.0
    assert all(s == 3 for s in loaded["adam_steps_restored"])
    assert loaded["adam_moments_restored"] and loaded["max_moment_diff_vs_saved"] == 0.0
    assert loaded["min_moment_abs_max"] > 0


def test_ddp_holds_a_bucket_copy_unless_gradients_are_bucket_views(launched):
    v = finished(launched["shard"], "shard.json")
    p = v["params"]
    assert v["held"]["ddp"]["buckets"] == 4 * p and sum(v["held"]["ddp"].values()) == 20 * p
    assert v["held"]["ddp_view"]["buckets"] == 0 and sum(v["held"]["ddp_view"].values()) == 16 * p


def test_bytes_sent_zero_is_ddp_plus_broadcasts(launched):
    v = finished(launched["shard"], "shard.json")
    n, p, sent = v["world_size"], v["params"], v["sent_per_step"]
    if n == 1:
        pytest.skip("one rank sends nothing")
    for s in sent["ddp"]:                                       # ring all-reduce of 4P bytes
        assert 2 * (n - 1) / n * 4 * p <= s <= 2 * (n - 1) / n * 4 * p * 1.02 + 4096
    ratio = sum(sent["zero"]) / sum(sent["ddp"])
    assert 1.45 <= ratio <= 1.55, ratio                         # + (N-1) x 4P of broadcasts in all
    assert 1.9 <= sum(sent["fsdp"]) / sum(sent["ddp"]) <= 2.1   # gloo's reduce-scatter is an all-reduce


def test_fp16_with_grad_scaler_clips_the_unscaled_gradient_to_max_norm(launched):
    v = finished(launched["amp"], "amp.json")
    assert v["precision"] == "fp16" and v["scaler"] and v["activation_dtype"] == "torch.float16"
    clipped = [s for s in v["steps"] if s["stepped"] and s["norm_before_clip"] > v["max_norm"]]
    assert clipped
    for s in clipped:      # clipping before unscale_ would leave max_norm / S (S = 65536)
        assert math.isclose(s["norm_after_clip"], v["max_norm"], rel_tol=1e-3), s
        assert s["same_on_all_ranks"]


def test_compress_hooks_halve_the_bytes_written(launched):
    v = finished(launched["compress"], "compress.json")
    n, r = v["world_size"], v["runs"]
    if n == 1:
        pytest.skip("one rank sends nothing")
    ring = 2 * (n - 1) / n * v["gradient_bytes"]
    assert ring <= r["fp32"]["wire_bytes_per_step"] <= 1.02 * ring + 2048
    for name in ("fp16", "bf16"):
        assert 0.45 <= r[name]["wire_bytes_per_step"] / r["fp32"]["wire_bytes_per_step"] <= 0.55, name
