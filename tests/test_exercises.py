"""The exercise checkers of 03-05 (ddp_lesson.exercises): on hand-made run directories for
the ways a learner can get it wrong, and one real 2-rank run of the classic no_sync mistake
(wrapping only backward). The notebooks run each checker on the starter and the solution."""
import json

import pytest

from ddp_lesson import exercises, launch
from ddp_lesson.lesson import SCRIPTS


def fake_run(path, world, rows, status="ok"):
    (path / "metrics").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"world_size": world}))
    (path / "result.json").write_text(json.dumps({"status": status}))
    for r in range(world):
        with open(path / "metrics" / f"rank{r}.jsonl", "w") as f:
            for i, row in enumerate(x for x in rows if x["rank"] == r):
                f.write(json.dumps({"time": i, **row}) + "\n")
    return path


def epochs(orders):  # orders[rank][epoch] = indices
    return [{"rank": r, "step": e, "epoch": e, "indices": idx}
            for r, per_rank in enumerate(orders) for e, idx in enumerate(per_rank)]


def test_set_epoch(tmp_path):
    good = fake_run(tmp_path / "good", 2, epochs([[[0, 2], [2, 0]], [[1, 3], [3, 1]]]))
    assert "2 epochs" in exercises.check_set_epoch(good)
    same = fake_run(tmp_path / "same", 2, epochs([[[0, 2], [0, 2]], [[1, 3], [3, 1]]]))
    with pytest.raises(AssertionError, match="same order in epochs 0 and 1"):
        exercises.check_set_epoch(same)
    overlap = fake_run(tmp_path / "overlap", 2, epochs([[[0, 1], [1, 0]], [[0, 1], [1, 0]]]))
    with pytest.raises(AssertionError, match="two ranks"):
        exercises.check_set_epoch(overlap)
    failed = fake_run(tmp_path / "failed", 1, epochs([[[0], [0]]]), status="failed")
    with pytest.raises(AssertionError, match="ended failed"):
        exercises.check_set_epoch(failed)


def bn_rows(types, means):
    return [{"rank": r, "step": 4, "bn_types": types, "running_mean": [m], "running_var": [[1.0]]}
            for r, m in enumerate(means)]


def test_syncbn(tmp_path):
    ok = fake_run(tmp_path / "ok", 3, bn_rows(["SyncBatchNorm"], [[0.5]] * 3))
    assert "equal on 3 rank(s)" in exercises.check_syncbn(ok)
    plain = fake_run(tmp_path / "plain", 1, bn_rows(["BatchNorm2d"], [[0.5]]))  # 1 rank: by type
    with pytest.raises(AssertionError, match="still BatchNorm2d"):
        exercises.check_syncbn(plain)
    differ = fake_run(tmp_path / "differ", 2, bn_rows(["CPUSyncBatchNorm"], [[0.5], [0.6]]))
    with pytest.raises(AssertionError, match="differ by up to 0.1"):
        exercises.check_syncbn(differ)


def micro_rows(world, all_reduces, k=2, sums=None):
    rows = [{"rank": r, "step": i, "k": k, "all_reduces": n}
            for r in range(world) for i, n in enumerate(all_reduces)]
    return rows + [{"rank": r, "step": 99, "weights_sum": (sums or [1.0] * world)[r]} for r in range(world)]


def test_no_sync(tmp_path):
    ok = fake_run(tmp_path / "ok", 3, micro_rows(3, [0, 1, 0, 1, 0, 1]))
    assert "3 windows" in exercises.check_no_sync(ok)
    every = fake_run(tmp_path / "every", 2, micro_rows(2, [1, 1, 1, 1]))
    with pytest.raises(AssertionError, match="2 of them all-reduced"):
        exercises.check_no_sync(every)
    early = fake_run(tmp_path / "early", 2, micro_rows(2, [1, 0, 1, 0]))
    with pytest.raises(AssertionError, match="not at its last"):
        exercises.check_no_sync(early)
    never = fake_run(tmp_path / "never", 1, micro_rows(1, [0, 0, 0, 0]))
    with pytest.raises(AssertionError, match="0 of them"):
        exercises.check_no_sync(never)
    drift = fake_run(tmp_path / "drift", 2, micro_rows(2, [0, 1], sums=[1.0, 2.0]))
    with pytest.raises(AssertionError, match="weights differ"):
        exercises.check_no_sync(drift)


def test_no_sync_around_backward_only_still_all_reduces(tmp_path):
    """DDP decides in forward whether the backward all-reduces: no_sync around backward alone
    changes nothing, and the checker says so on a real 2-rank run."""
    src = (SCRIPTS / "ex_no_sync.py").read_text()
    old = ("        loss.backward()  # gradients add up in .grad over the window\n")
    assert old in src
    script = tmp_path / "backward_only.py"
    script.write_text(src.replace(old, "        with contextlib.nullcontext() if last else model.no_sync():\n"
                                       "            loss.backward()\n"))
    run = launch.start(script, nproc=2, cpu=True, run_dir=tmp_path / "run", timeout=120)
    assert run.wait()["status"] == "ok", run.result
    with pytest.raises(AssertionError, match="4 of them all-reduced"):
        exercises.check_no_sync(run.run_dir)
