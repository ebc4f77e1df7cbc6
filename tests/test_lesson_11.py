"""Notebook 11's claims at a world size it does not run (3 ranks, resumed on 1), on a tiny
model and a 30-window epoch so that epochs turn over: every window once per epoch from the
window ids the script logs, the step-1 gradient against one computed here in one piece,
1 rank == 3 ranks after resuming mid-epoch, bf16 autocast near fp32, the FLOPs-per-token
formula against torch's FlopCounterMode, the datasheet lookup on real device names, DDP's
bucket layout that the scaling prediction assumes, and the global-batch checker both ways
(refusals and crashes as the rank's guard records them)."""
import contextlib
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from conftest import child_env
from ddp_lesson import exercises, failures, launch, runs
from ddp_lesson.lesson import SCRIPTS, load_script

pytestmark = pytest.mark.timeout(600)   # three small launches, two at once; a busy machine slows each
gpt = load_script(SCRIPTS / "gpt_ddp.py")
G, BLOCK, WINDOWS = 12, 32, 30           # 2 steps per epoch, 6 windows left out each epoch
TINY = ["--layers=1", "--heads=2", "--width=32", f"--block={BLOCK}", f"--global-batch={G}", "--micro-batch=1",
        "--steps=5", "--warmup-steps=2", "--lr=1e-2", "--eval-every=100", "--eval-windows=8",
        "--sample-bytes=0", f"--train-windows={WINDOWS}"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}   # a tiny model: more threads only cost time on a busy machine


@pytest.mark.parametrize("layers,heads,width,block", [(1, 2, 32, 16), (3, 4, 96, 48)])
def test_flops_per_token_matches_flop_counter(layers, heads, width, block):
    model = gpt.GPT(layers, heads, width, block)
    x = torch.randint(0, 256, (3, block))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x).view(-1, 256), x.view(-1)).backward()
    counted = counter.get_total_flops() / x.numel()
    assert abs(counted - gpt.flops_per_token(model, layers, width, block)) / counted < 1e-6


# names as torch.cuda.get_device_name() (the CUDA driver's) reports them, upper and lower case as
# the boards give them: the A100 80GB PCIe says "PCIe", the 40GB one "PCIE"
REAL_NAMES = {
    "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12, "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12, "NVIDIA L4": 121e12,
    "NVIDIA L40": 181e12, "NVIDIA L40S": 362e12, "NVIDIA A10": 125e12, "Tesla T4": 65e12,
    "Tesla V100-SXM2-16GB": 125e12, "Tesla V100-SXM2-32GB": 125e12, "Tesla V100-PCIE-16GB": 112e12,
    "Tesla V100S-PCIE-32GB": 130e12, "NVIDIA GeForce RTX 4090": 165e12, "NVIDIA GeForce RTX 3090": 71e12,
    # not in the table, or another device than the entry it resembles: no datasheet peak
    "NVIDIA A10G": None, "NVIDIA GeForce RTX 4090 D": None, "NVIDIA GeForce RTX 3090 Ti": None,
    "NVIDIA H800": None, "NVIDIA A800-SXM4-80GB": None, "NVIDIA GH200 480GB": None, "NVIDIA RTX A6000": None,
    "NVIDIA RTX 6000 Ada Generation": None, "NVIDIA A100-SXM4-40GB MIG 1g.5gb": None, "NVIDIA B200": None,
    "NVIDIA GeForce RTX 4080": None, "": None}


def test_datasheet_peak_of_real_device_names():
    assert {name: gpt.datasheet_peak(name) for name in REAL_NAMES} == REAL_NAMES
    assert gpt.datasheet_peak("nvidia a100 80gb pcie") == 312e12                # any case
    for name in ("Tesla T4", "Tesla V100-PCIE-16GB", "Tesla V100S-PCIE-32GB"):   # no bf16 tensor cores
        assert gpt.datasheet_peak(name, torch.bfloat16) is None
    assert gpt.datasheet_peak("NVIDIA A100 80GB PCIe", torch.bfloat16) == 312e12


def test_reference_rate_on_a_gpu_in_the_table_is_its_datasheet_peak(monkeypatch):
    """The datasheet branch reads only the device's name: it runs here without a GPU."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100 80GB PCIe")
    peak, source, remeasure = gpt.reference_rate(torch.device("cuda", 0), torch.float16)
    assert peak == 312e12 and source.startswith("datasheet (NVIDIA A100 80GB PCIe"), source
    assert remeasure is None   # a datasheet peak is not timed again after each step


def test_ddp_buckets_are_one_then_rebuilt_as_the_notebook_predicts():
    """11's prediction (cells 20-21) rests on DDP's bucket layout: the first step all-reduces
    every gradient in one bucket; from the second on, buckets rebuilt in backward's order, the
    first closed past 1 MiB, the others past 25 MiB, which for this GPT is reverse parameter
    order. One gloo rank in this process, the notebook's model and micro-batches (no_sync on
    all but the last), a comm hook noting each bucket's bytes: what a torch upgrade could change."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def predicted(params, first=2 ** 20, cap=25 * 2 ** 20):          # cell 21's buckets()
        out, size = [], 0
        for p in reversed(list(params)):
            size += p.numel() * 4
            if size >= (first if not out else cap):
                out.append(size)
                size = 0
        return out + ([size] if size else [])

    seen = []
    def hook(_, bucket):
        seen[-1].append(bucket.buffer().numel() * bucket.buffer().element_size())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    torch.manual_seed(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DDP(gpt.GPT(2, 4, 192, 64))
        model.register_comm_hook(None, hook)
        x = torch.randint(0, 256, (2, 64))
        for _ in range(3):
            seen.append([])
            for last in (False, True):
                with model.no_sync() if not last else contextlib.nullcontext():
                    F.cross_entropy(model(x).view(-1, 256), x.view(-1)).backward()
    finally:
        dist.destroy_process_group()
    total = sum(p.numel() * 4 for p in model.parameters())
    assert seen[0] == [total], seen
    assert seen[1] == seen[2] == predicted(model.parameters()) and len(seen[1]) > 1, seen   # 1.13, 2.50 MiB


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    """a: 3 ranks, 5 steps (epochs 0, 0, 1, 1, 2), checkpoint at 3. bf16: 1 rank, 2 steps, at
    the same time. c: a's step-3 checkpoint resumed on 1 rank for steps 4-5."""
    base = tmp_path_factory.mktemp("runs11")
    a = launch.start(SCRIPTS / "gpt_ddp.py", nproc=3, cpu=True, args=TINY + ["--amp=off", "--save-at=3"],
                     run_dir=base / "a", timeout=300, env=ONE_THREAD)
    bf16 = launch.start(SCRIPTS / "gpt_ddp.py", nproc=1, cpu=True, run_dir=base / "bf16", timeout=300, env=ONE_THREAD,
                        args=TINY + ["--amp=bf16", "--stop-at=2", "--sample-bytes=8"])
    started = [a, bf16]
    try:
        assert a.wait()["status"] == "ok", a.result.get("message")
        c = launch.start(SCRIPTS / "gpt_ddp.py", nproc=1, cpu=True, run_dir=base / "c", timeout=300, env=ONE_THREAD,
                         args=TINY + ["--amp=off", f"--resume={base / 'a' / 'ckpt_3.pt'}"])
        started.append(c)
        assert c.wait()["status"] == "ok", c.result.get("message")
        assert bf16.wait()["status"] == "ok", bf16.result.get("message")
        yield {k: runs.load(r.run_dir) for k, r in zip(["a", "bf16", "c"], started)}
    finally:
        for r in started:
            r.stop()


def windows_per_step(rec):
    """step -> {rank: the window ids that rank trained on}, from the script's own log."""
    out = {}
    for row in rec.rows:
        if "window_ids" in row:
            out.setdefault(row["step"], {})[row["rank"]] = row["window_ids"]
    return out


def series(rec, key):
    return dict(rec.series(key, rank=0))


def test_every_window_once_per_epoch_from_the_log(trio):
    steps = windows_per_step(trio["a"])
    assert sorted(steps) == [1, 2, 3, 4, 5] and all(sorted(s) == [0, 1, 2] for s in steps.values())
    assert all(len(ids) == G // 3 for s in steps.values() for ids in s.values())
    for epoch in ([1, 2], [3, 4]):
        used = [i for s in epoch for ids in steps[s].values() for i in ids]
        assert len(used) == len(set(used)) == 2 * G and set(used) <= set(range(WINDOWS))
    step = {s: sorted(i for ids in steps[s].values() for i in ids) for s in steps}
    assert step[1] != step[3] and step[2] != step[4]                 # set_epoch: a new order each epoch
    assert dict(trio["a"].series("epoch", rank=0)) == {1: 0, 2: 0, 3: 1, 4: 1, 5: 2}


def test_step_one_gradient_is_the_mean_over_the_global_batch(trio):
    ids = sorted(i for ids in windows_per_step(trio["a"])[1].values() for i in ids)
    train, _ = gpt.split(gpt.stdlib_bytes()[0])
    windows = gpt.Windows(train[:WINDOWS * BLOCK + 1], BLOCK)
    torch.manual_seed(0)                                              # the script's --seed, before GPT(...)
    model = gpt.GPT(1, 2, 32, BLOCK)
    x, y = torch.stack([windows[i][0] for i in ids]), torch.stack([windows[i][1] for i in ids])
    F.cross_entropy(model(x).view(-1, 256), y.view(-1)).backward()
    here = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    logged = series(trio["a"], "grad_norm")[1]
    assert abs(logged - here) / here < 1e-5, (logged, here)           # 4 micro-batches per rank, 3 ranks


def test_resumed_on_one_rank_continues_the_three_rank_run(trio):
    a, c = trio["a"], trio["c"]
    assert c.config["world_size"] == 1 and sorted(series(c, "loss")) == [4, 5]
    wa, wc = windows_per_step(a), windows_per_step(c)
    assert all(sorted(wc[s][0]) == sorted(i for ids in wa[s].values() for i in ids) for s in (4, 5))
    for key, tol in (("loss", 1e-5), ("grad_norm", 1e-4)):
        ra, rc = series(a, key), series(c, key)
        assert all(abs(ra[s] - rc[s]) <= tol * abs(ra[s]) for s in (4, 5)), (key, ra, rc)


def test_rows_carry_tokens_per_s_and_mfu(trio):
    rec = trio["a"]
    head = {r["rank"]: r for r in rec.rows if "peak_source" in r}
    rows = [r for r in rec.rows if "mfu" in r]
    t = {(r["rank"], r["step"]): r["time"] for r in rows}
    # FLOPs per token from the formula on TINY's model, not the value the run logged
    fpt = gpt.flops_per_token(gpt.GPT(1, 2, 32, BLOCK), 1, 32, BLOCK)
    for r in rows:                          # a step is timed inside the gap since the rank's last row
        if r["step"] > 1:
            assert r["step_s"] <= t[r["rank"], r["step"]] - t[r["rank"], r["step"] - 1] + 1e-6
        assert abs(r["tokens_per_s"] * r["step_s"] - r["windows"] * BLOCK) < 1e-6 * r["windows"] * BLOCK
        assert head[r["rank"]]["flops_per_token"] == fpt
        # each row's reference: the matmul timed right after that step
        assert abs(r["mfu"] - fpt * r["tokens_per_s"] / r["peak_flops"]) <= 1e-9 * r["mfu"]
    assert "after each step" in head[0]["peak_source"] and len({r["peak_flops"] for r in rows}) > 1
    mfus = sorted(r["mfu"] for r in rows)   # 3 ranks on 2 cores: load hits the step and the matmul alike
    assert 0 < mfus[len(mfus) // 2] <= 1, mfus
    assert exercises.check_global_batch(rec.path)                   # 12 windows per step, summed


def test_bf16_autocast_trains_near_fp32_and_samples(trio):
    bf16, fp32 = trio["bf16"], trio["a"]
    for key, tol in (("loss", 0.02), ("grad_norm", 0.05)):
        rb, rf = series(bf16, key), series(fp32, key)
        assert sorted(rb) == [1, 2] and all(abs(rb[s] - rf[s]) < tol * rf[s] for s in rb), (key, rb, rf)
    # ... but not equal to it: autocast really ran in bf16 (fp32 at 1 vs 3 ranks differs ~1e-6)
    rb, rf = series(bf16, "loss"), series(fp32, "loss")
    assert any(abs(rb[s] - rf[s]) > 1e-4 * rf[s] for s in rb), (rb, rf)
    # the prompt, then 8 generated bytes decoded with errors="replace": 2 to 8 characters (a
    # character is 1 to 4 bytes; an invalid byte becomes one U+FFFD)
    sample = bf16.last("sample", rank=0)
    assert sample.startswith("def ") and 2 <= len(sample) - len("def ") <= 8, repr(sample)


# How a learner's ex_global_batch.py may end before training at 5 ranks (48 samples, micro-batches
# of 4): the rank's last lines, run under the course's guard as a real rank is (no torch, no
# torchrun: a second each), so the checker reads the failure record a real run leaves.
MAIN = "GLOBAL, MICRO, world_size = 48, 4, 5\n\ndef main():\n{}\n\nmain()\n"
REFUSALS = {   # clear refusals, accepted
    "exit_text": "    raise SystemExit(f'{GLOBAL} samples do not split into micro-batches on {world_size} ranks')",
    "sys_exit_text": "    import sys\n    sys.exit(f'no whole number of micro-batches on {world_size} ranks')",
    "value_error": ("    if GLOBAL % (MICRO * world_size):\n"
                    "        raise ValueError(\n            f'{world_size} ranks do not fit')"),   # a two-line raise
    "assert_text": "    assert GLOBAL % (MICRO * world_size) == 0, f'{world_size} ranks do not fit'",
}
CRASHES = {    # crashes for another reason, or refusals that do not say why: rejected, and the reply says so
    "name_error": ("    ACCUM = GLOBAL // (MICRO * world_sz)", "crashed with NameError"),
    "import_error": ("    from math import accumulate_steps", "crashed with ImportError"),
    "in_a_library": ("    import json\n    json.loads('{')", "crashed with JSONDecodeError"),   # json's raise
    "bare_exit": ("    import sys\n    sys.exit(1)", "status 1 and no message"),
    "bare_assert": ("    assert GLOBAL % (MICRO * world_size) == 0", "AssertionError without a message"),
}


def guarded_failure(run_dir, body):
    """Run `body` as rank 0's script under the guard; the failure record it leaves (root_cause)."""
    script = run_dir / "ex_global_batch.py"
    run_dir.mkdir(parents=True)
    script.write_text(MAIN.format(body))
    subprocess.run([sys.executable, "-m", "ddp_lesson.guard", str(script)], cwd=run_dir, timeout=60,
                   env=child_env(DDP_LESSON_RUN_DIR=run_dir, RANK="0"), capture_output=True)
    return failures.root_cause(run_dir), script


def fake_run(tmp_path, per_rank_samples, asked=8, micro=2, world=None, status="ok", failure=None,
             script="ex_global_batch.py", head=True):
    world = world or len(per_rank_samples)
    (tmp_path / "metrics").mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps({"world_size": world, "script": str(script)}))
    (tmp_path / "result.json").write_text(json.dumps({"status": status, "message": "failed", "failure": failure}))
    for rank in range(world):
        samples = per_rank_samples[rank] if rank < len(per_rank_samples) else []
        rows = [{"rank": rank, "step": 0, "time": 0, "global_batch_asked": asked, "micro_batch": micro}] if head else []
        rows += [{"rank": rank, "step": s, "time": s, "samples": n} for s, n in enumerate(samples, 1)]
        (tmp_path / "metrics" / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_check_global_batch_accepts_the_sum_and_rejects_other_counts(tmp_path):
    assert exercises.check_global_batch(fake_run(tmp_path / "ok", [[4, 4], [4, 4]]))
    with pytest.raises(AssertionError, match="not the 8 asked"):
        exercises.check_global_batch(fake_run(tmp_path / "bad", [[8, 8], [8, 8]]))
    with pytest.raises(AssertionError, match="not every rank"):
        exercises.check_global_batch(fake_run(tmp_path / "gap", [[4, 4], [4]]))
    with pytest.raises(AssertionError, match="not the 48 asked"):    # 48 on 5 ranks: 40 is no answer
        exercises.check_global_batch(fake_run(tmp_path / "forty", [[8]] * 5, asked=48, micro=4))


def test_check_global_batch_accepts_a_refusal_that_says_why_and_no_other_failure(tmp_path):
    for name, body in REFUSALS.items():
        failure, script = guarded_failure(tmp_path / name, body)
        run = fake_run(tmp_path / name, [], asked=48, micro=4, world=5, status="failed", failure=failure, script=script)
        assert "refused" in exercises.check_global_batch(run), (name, failure)
    for name, (body, why) in CRASHES.items():
        failure, script = guarded_failure(tmp_path / name, body)
        run = fake_run(tmp_path / name, [], asked=48, micro=4, world=5, status="failed", failure=failure, script=script)
        with pytest.raises(AssertionError, match="not with a refusal") as e:
            exercises.check_global_batch(run)
        assert why in str(e.value), (name, str(e.value))
    refusal, script = guarded_failure(tmp_path / "fits", REFUSALS["exit_text"])
    with pytest.raises(AssertionError, match="ended failed, but 48 samples split"):   # 4 ranks fit: no excuse
        exercises.check_global_batch(fake_run(tmp_path / "fits", [], asked=48, micro=4, world=4, status="failed",
                                              failure=refusal, script=script))
    with pytest.raises(AssertionError, match="not before training"):
        exercises.check_global_batch(fake_run(tmp_path / "late", [[12]] * 5, asked=48, micro=4, status="failed",
                                              failure=refusal, script=script))
    with pytest.raises(AssertionError, match="before it logged the global batch"):  # refused above metrics.log(0, ...)
        exercises.check_global_batch(fake_run(tmp_path / "early", [], asked=48, micro=4, world=5, status="failed",
                                              failure=refusal, script=script, head=False))
