"""Notebook 11's claims on a tiny model: windows sharded once per epoch at any world size,
the FLOPs-per-token formula against torch's FlopCounterMode, 1 rank == N ranks at a fixed
global batch, resuming at another world size, and the global-batch checker both ways.
Launches go through ddp_lesson.launch on gloo CPU ranks (DDP_LESSON_NPROC, else 2)."""
import json

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler
from torch.utils.flop_counter import FlopCounterMode

from ddp_lesson import exercises, launch, runs
from ddp_lesson.lesson import SCRIPTS, load_script

pytestmark = pytest.mark.timeout(600)   # four small launches, two after one another; a busy machine slows each
gpt = load_script(SCRIPTS / "gpt_ddp.py")
TINY = ["--layers=1", "--heads=2", "--width=32", "--block=32", "--global-batch=12", "--micro-batch=1",
        "--steps=4", "--warmup-steps=2", "--lr=1e-2", "--eval-every=100", "--eval-windows=8",
        "--sample-bytes=0", "--amp=off"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}   # a tiny model: more threads only cost time on a busy machine


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_window_once_per_epoch_and_the_same_windows_per_step(world):
    windows = gpt.Windows(torch.arange(5000) % 256, 16)      # 312 windows
    G = 12
    steps = len(windows) // G                                # the script's steps per epoch
    shards = [list(DistributedSampler(windows, num_replicas=world, rank=r, shuffle=True, seed=3))
              for r in range(world)]
    per = G // world
    epoch = [[i for r in range(world) for i in shards[r][s * per:(s + 1) * per]] for s in range(steps)]
    flat = [i for step in epoch for i in step]
    assert len(flat) == len(set(flat)) == steps * G and len(windows) - len(flat) < G
    single = list(DistributedSampler(windows, num_replicas=1, rank=0, shuffle=True, seed=3))
    assert all(sorted(epoch[s]) == sorted(single[s * G:(s + 1) * G]) for s in range(steps))


@pytest.mark.parametrize("layers,heads,width,block", [(1, 2, 32, 16), (3, 4, 96, 48)])
def test_flops_per_token_matches_flop_counter(layers, heads, width, block):
    model = gpt.GPT(layers, heads, width, block)
    x = torch.randint(0, 256, (3, block))
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(x).view(-1, 256), x.view(-1)).backward()
    counted = counter.get_total_flops() / x.numel()
    assert abs(counted - gpt.flops_per_token(model, layers, width, block)) / counted < 1e-3


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    """A: N ranks, 4 steps, checkpoint at 2. B: 1 rank, steps 1-3. C: A's step-2 checkpoint
    resumed on another world size for steps 3-4. bf16: 1 rank, 2 steps. A, B and bf16 run at once."""
    base = tmp_path_factory.mktemp("runs11")
    a = launch.start(SCRIPTS / "gpt_ddp.py", cpu=True, args=TINY + ["--save-at=2"], run_dir=base / "a", timeout=300,
                     env=ONE_THREAD)
    b = launch.start(SCRIPTS / "gpt_ddp.py", nproc=1, cpu=True, args=TINY + ["--stop-at=3"],
                     run_dir=base / "b", timeout=300, env=ONE_THREAD)
    bf16 = launch.start(SCRIPTS / "gpt_ddp.py", nproc=1, cpu=True, run_dir=base / "bf16", timeout=300, env=ONE_THREAD,
                        args=TINY[:-1] + ["--amp=bf16", "--stop-at=2", "--sample-bytes=8"])
    started = [a, b]
    try:
        assert a.wait()["status"] == "ok", a.result.get("message")
        assert b.wait()["status"] == "ok", b.result.get("message")
        other = 1 if a.config["world_size"] > 1 else 2
        c = launch.start(SCRIPTS / "gpt_ddp.py", nproc=other, cpu=True, run_dir=base / "c", timeout=300, env=ONE_THREAD,
                         args=TINY + [f"--resume={base / 'a' / 'ckpt_2.pt'}"])
        started.append(c)
        assert c.wait()["status"] == "ok", c.result.get("message")
        assert bf16.wait()["status"] == "ok", bf16.result.get("message")
        started.append(bf16)
        yield {k: runs.load(r.run_dir) for k, r in zip(["a", "b", "c", "bf16"], started)}
    finally:
        for r in started + [bf16]:
            r.stop()


def losses(rec):
    return dict(rec.series("loss", rank=0))


def test_one_rank_equals_n_ranks_at_a_fixed_global_batch(trio):
    a, b = losses(trio["a"]), losses(trio["b"])
    assert sorted(b) == [1, 2, 3]
    assert all(abs(a[s] - b[s]) < 2e-3 for s in b), (a, b)
    assert abs(b[3] - b[1]) > 0.02                                  # it trained meanwhile


def test_resume_at_another_world_size_continues_the_curve(trio):
    a, c = losses(trio["a"]), losses(trio["c"])
    assert trio["c"].config["world_size"] != trio["a"].config["world_size"]
    assert sorted(c) == [3, 4]
    assert all(abs(a[s] - c[s]) < 2e-3 for s in c), (a, c)


def test_rows_carry_tokens_per_s_and_mfu(trio):
    rec = trio["a"]
    rows = [r for r in rec.rows if "mfu" in r]
    assert len(rows) == 4 * rec.config["world_size"]
    assert all(0 < r["mfu"] <= 1 and r["tokens_per_s"] > 0 for r in rows)
    assert exercises.check_global_batch(rec.path)                   # 12 windows per step, summed


def fake_run(tmp_path, per_rank_samples, asked=8):
    (tmp_path / "metrics").mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps({"world_size": len(per_rank_samples)}))
    (tmp_path / "result.json").write_text(json.dumps({"status": "ok"}))
    for rank, samples in enumerate(per_rank_samples):
        rows = [{"rank": rank, "step": 0, "time": 0, "global_batch_asked": asked}]
        rows += [{"rank": rank, "step": s, "time": s, "samples": n} for s, n in enumerate(samples, 1)]
        (tmp_path / "metrics" / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_check_global_batch_accepts_the_sum_and_rejects_a_growing_batch(tmp_path):
    assert exercises.check_global_batch(fake_run(tmp_path / "ok", [[4, 4], [4, 4]]))
    with pytest.raises(AssertionError, match="not the 8 asked"):
        exercises.check_global_batch(fake_run(tmp_path / "bad", [[8, 8], [8, 8]]))
    with pytest.raises(AssertionError, match="not every rank"):
        exercises.check_global_batch(fake_run(tmp_path / "gap", [[4, 4], [4]]))


def test_bf16_autocast_trains_and_samples(trio):
    rec = trio["bf16"]
    assert rec.last("amp", rank=0) == "bf16"
    assert all(0 < loss < 6 for _, loss in rec.series("loss", rank=0))   # finite, near ln 256 at the start
    assert len(rec.last("sample", rank=0)) >= 8
