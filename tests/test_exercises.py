"""The exercise graders (ddp_lesson.notebook.graders: common.py, and lNN.py for notebook NN).
03-05's on hand-made run directories for the ways a learner can get it wrong, and one real
2-rank launch of ex_syncbn.py: an answer that
rebuilds the other ranks' x without communicating must fail. The notebooks run each checker on real runs, at 2 and
(in CI) 3 ranks: on the starter and the solution (03 cell 03-ex5, 04 cell 04-ex5, at 2 ranks or more), and 05's on
the placements run, whose strip cell (05-strip2) also asserts that no_sync around backward
alone still all-reduces every micro-batch (a real-run test of that here would repeat it).
Lesson 10's fp16-step checkers (check_train_step, check_too_small_by) run one process, no
launch: the notebook (10-25) runs them at its own settings; here each wrong answer apart."""
import json
import re

import sys
import threading

import pytest

from ddp_lesson.notebook.graders.common import attempt, grade
from ddp_lesson.notebook.graders.l00 import check_cuda_index
from ddp_lesson.notebook.graders.l01 import check_dp_chunk_sizes
from ddp_lesson.notebook.graders.l03 import check_set_epoch
from ddp_lesson.notebook.graders.l03b import check_scaled
from ddp_lesson.notebook.graders.l04 import check_global_bn
from ddp_lesson.notebook.graders.l05 import all_reduced, check_no_sync, weights_equal
from ddp_lesson.notebook.graders.l06 import check_predict
from ddp_lesson.notebook.graders.l07 import check_first_failure, check_parser
from ddp_lesson.notebook.graders.l08 import check_ranks
from ddp_lesson.notebook.graders.l10 import check_too_small_by, check_train_step


def fake_run(path, world, rows, status="ok"):
    (path / "metrics").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"world_size": world}))
    (path / "result.json").write_text(json.dumps({"status": status}))
    for r in range(world):
        with open(path / "metrics" / f"rank{r}.jsonl", "w") as f:
            for i, row in enumerate(x for x in rows if x["rank"] == r):
                f.write(json.dumps({"time": i, **row}) + "\n")
    return path


def epochs(orders, samples=4):  # orders[rank][epoch] = indices; samples = the data set's size
    return [{"rank": r, "step": 0, "samples": samples} for r in range(len(orders))] + \
        [{"rank": r, "step": e + 1, "epoch": e, "indices": idx}
         for r, per_rank in enumerate(orders) for e, idx in enumerate(per_rank)]


def test_set_epoch(tmp_path):
    good = fake_run(tmp_path / "good", 2, epochs([[[0, 2], [3, 0]], [[1, 3], [2, 1]]]))
    assert "2 epochs" in check_set_epoch(good)
    # randperm(n // world_size) instead of randperm(n): disjoint, new order, half the data unused
    half = fake_run(tmp_path / "half", 2, epochs([[[0], [1]], [[1], [0]]]))
    with pytest.raises(AssertionError, match="cover 2 of the 4 samples"):
        check_set_epoch(half)
    # each rank shuffles its fixed stripe range(rank, n, world): new order, same samples forever
    stripe = fake_run(tmp_path / "stripe", 2, epochs([[[0, 2], [2, 0]], [[1, 3], [3, 1]]]))
    with pytest.raises(AssertionError, match="same samples in epochs 0 and 1"):
        check_set_epoch(stripe)
    same = fake_run(tmp_path / "same", 2, epochs([[[0, 2], [0, 2]], [[1, 3], [3, 1]]]))
    with pytest.raises(AssertionError, match="same order in epochs 0 and 1"):
        check_set_epoch(same)
    overlap = fake_run(tmp_path / "overlap", 2, epochs([[[0, 1], [1, 0]], [[0, 1], [1, 0]]], samples=2))
    with pytest.raises(AssertionError, match="two ranks"):
        check_set_epoch(overlap)
    failed = fake_run(tmp_path / "failed", 1, epochs([[[0], [0]]]), status="failed")
    with pytest.raises(AssertionError, match="ended failed"):
        check_set_epoch(failed)


def bn_run(path, answer, world=3, hw=2, shifts=None):
    """ex_syncbn.py's two rows per rank: its x (rank r holds 3 + r samples of hw x hw values
    per channel, the ranks' means apart; plus shifts[r], the shift only rank r knows, where
    given), then the mean and var that answer(xs, rank) gives it. An answer reads the xs it
    is given: pass it the shifted ones, or the ones without the other ranks' shifts."""
    import torch
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3 + r, 2, hw, hw, generator=g, dtype=torch.float64) + 0.5 * r for r in range(world)]
    logged = [x + (shifts[r] if shifts else 0) for r, x in enumerate(xs)]
    rows = []
    for r in range(world):
        mean, var = answer(logged if shifts is None else (xs, logged), r)
        rows += [{"rank": r, "step": 0, "x": logged[r].tolist()},
                 {"rank": r, "step": 1, "mean": mean.tolist(), "var": var.tolist()}]
    return fake_run(path, world, rows)


def test_global_bn(tmp_path):
    import torch
    dims = (0, 2, 3)
    own = lambda x: (x.mean(dims), x.var(dims, unbiased=False))
    right = lambda xs, r: own(torch.cat(xs))
    ok = bn_run(tmp_path / "ok", right)
    assert "every one of 3 ranks holds the global batch's 2 means" in check_global_bn(ok)
    by_sums = lambda xs, r: (torch.cat(xs).mean(dims), (torch.cat(xs) ** 2).mean(dims) - torch.cat(xs).mean(dims) ** 2)
    assert check_global_bn(bn_run(tmp_path / "sums", by_sums))
    with pytest.raises(AssertionError, match="still holds this rank's own statistics"):
        check_global_bn(bn_run(tmp_path / "starter", lambda xs, r: own(xs[r])))
    avg_var = lambda xs, r: (torch.cat(xs).mean(dims), sum(own(x)[1] for x in xs) / len(xs))
    with pytest.raises(AssertionError, match="average of the ranks' variances"):
        check_global_bn(bn_run(tmp_path / "avg_var", avg_var))
    avg_both = lambda xs, r: (sum(own(x)[0] for x in xs) / len(xs), sum(own(x)[1] for x in xs) / len(xs))
    with pytest.raises(AssertionError, match="unweighted average of the ranks' means"):
        check_global_bn(bn_run(tmp_path / "avg_both", avg_both))
    unbiased = lambda xs, r: (torch.cat(xs).mean(dims), torch.cat(xs).var(dims))
    with pytest.raises(AssertionError, match=r"the unbiased variance \(n - 1\)"):
        check_global_bn(bn_run(tmp_path / "unbiased", unbiased))
    rank0 = lambda xs, r: own(xs[0])                                  # a broadcast of rank 0's
    with pytest.raises(AssertionError, match="the mean is off"):
        check_global_bn(bn_run(tmp_path / "rank0", rank0))
    same = [{"rank": r, "step": s, **row} for r in range(2)          # equal batches: a run that
            for s, row in ((0, {"x": [[[[1.0, 2.0]]]]}), (1, {"mean": [1.5], "var": [0.25]}))]  # cannot tell
    with pytest.raises(AssertionError, match="too alike"):
        check_global_bn(fake_run(tmp_path / "same", 2, same))
    alone = bn_run(tmp_path / "alone", right, world=1)
    with pytest.raises(AssertionError, match="run it on 2 or more"):
        check_global_bn(alone)


@pytest.mark.parametrize("world", [2, 7, 8])
def test_global_bn_rejects_the_unbiased_variance_at_any_world_size(tmp_path, world):
    # ex_syncbn.py's sizes: 16 x 16 values per channel, 3 + r images on rank r. The unbiased
    # variance is off by 1/(n - 1): 9.3e-5 at 7 ranks, 7.5e-5 at 8, under a tolerance of 1e-4
    import torch
    dims = (0, 2, 3)
    unbiased = lambda xs, r: (torch.cat(xs).mean(dims), torch.cat(xs).var(dims))
    with pytest.raises(AssertionError, match=r"the unbiased variance \(n - 1\)"):
        check_global_bn(bn_run(tmp_path / "unbiased", unbiased, world=world, hw=16))
    # ... while a float32 answer by sums, about 1e-7 off, passes
    by_sums32 = lambda xs, r: (lambda x: (x.mean(dims), (x * x).mean(dims) - x.mean(dims) ** 2))(torch.cat(xs).float())
    assert check_global_bn(bn_run(tmp_path / "sums32", by_sums32, world=world, hw=16))


def test_global_bn_rejects_an_answer_that_rebuilds_the_other_ranks_x(tmp_path):
    # every rank can rebuild every other rank's x from the data's seed and the seeded conv,
    # but not the shift each rank adds from os.urandom: an answer without communication
    # has its own shift only, and is off by the others'
    import torch
    dims = (0, 2, 3)
    g = torch.Generator().manual_seed(1)
    shifts = [0.1 * torch.randn(2, 1, 1, generator=g, dtype=torch.float64) for _ in range(3)]
    rebuilt = lambda both, r: (lambda x: (x.mean(dims), x.var(dims, unbiased=False)))(
        torch.cat([both[1][q] if q == r else both[0][q] for q in range(3)]))
    with pytest.raises(AssertionError, match="the mean is off"):
        check_global_bn(bn_run(tmp_path / "rebuilt", rebuilt, shifts=shifts))
    communicated = lambda both, r: (lambda x: (x.mean(dims), x.var(dims, unbiased=False)))(torch.cat(both[1]))
    assert check_global_bn(bn_run(tmp_path / "communicated", communicated, shifts=shifts))



def test_ex_syncbn_rebuilding_the_other_ranks_x_fails_on_a_real_run(tmp_path):
    # the launched exercise, 2 ranks: an answer that rebuilds every rank's x from the same data
    # and conv, with no collective, misses the other ranks' secret shifts; the solution passes
    from ddp_lesson.rank.bundled import script
    starter = script("ex_syncbn.py").read_text()
    lines = "    mean = x.mean(dim=(0, 2, 3))\n    var = x.var(dim=(0, 2, 3), unbiased=False)\n"
    assert lines in starter
    rebuild = (
        "    with torch.no_grad():\n"
        "        parts = [x if q == rank else conv(images[q::world_size][:3 + q]) for q in range(world_size)]\n"
        "    whole = torch.cat(parts)\n"
        "    mean = whole.mean(dim=(0, 2, 3))\n"
        "    var = whole.var(dim=(0, 2, 3), unbiased=False)\n")
    path = tmp_path / "ex_syncbn_rebuilt.py"
    path.write_text(starter.replace(lines, rebuild))
    run_dir, passed = attempt(path, check_global_bn, nproc=2)
    assert not passed
    with pytest.raises(AssertionError, match="the mean is off"):
        check_global_bn(run_dir)


RIGHT = {"backward only": [1, 2, 3, 4], "forward only": [4], "both": [4], "last only": [1, 2, 3]}


EQUAL = {"backward only": True, "forward only": True, "both": True, "last only": False}


def placement_rows(world, measured, differ_on_rank=None):
    """ex_no_sync.py's rows: one per rank, placement and micro-batch, with its all-reduce count,
    then each placement's spread of the ranks' weights after its optimizer step."""
    rows, step = [], 0
    for placement, synced in measured.items():
        for k in range(1, 5):
            step += 1
            for r in range(world):
                on = (k in synced) != (r == differ_on_rank and k == 1)
                rows.append({"rank": r, "step": step, "placement": placement, "micro_batch": k,
                             "all_reduces": 2 if on else 0})
        for r in range(world):
            spread = 0.0 if EQUAL.get(placement, True) or world == 1 else 0.03
            rows.append({"rank": r, "step": step, "placement": placement, "weights_spread": spread})
    return rows


def test_no_sync(tmp_path):
    ok = fake_run(tmp_path / "ok", 3, placement_rows(3, RIGHT))
    assert "all 4 placements" in check_no_sync(ok, RIGHT, EQUAL)
    assert all_reduced(ok)["last only"] == [[True, True, True, False]] * 3
    assert weights_equal(ok) == EQUAL
    with pytest.raises(AssertionError, match="no prediction yet"):       # the starter
        check_no_sync(ok, dict.fromkeys(RIGHT), EQUAL)
    with pytest.raises(AssertionError, match="no True or False yet"):    # the weights left out
        check_no_sync(ok, RIGHT)
    planted = {   # each wrong in one place: the verdict must not name the place, nor give the answer
        "forward only guessed": ({**RIGHT, "forward only": [1, 2, 3, 4]}, EQUAL),
        "the hint applied, weights ignored": (RIGHT, dict.fromkeys(RIGHT, True)),
        "last only guessed": ({**RIGHT, "last only": [4]}, EQUAL),
    }
    messages = set()
    for wrong, equal in planted.values():
        with pytest.raises(AssertionError, match="at least one answer differs") as e:
            check_no_sync(ok, wrong, equal)
        messages.add(str(e.value))
        assert "[4]" not in str(e.value) and "only" not in str(e.value), e.value
    assert len(messages) == 1             # one sentence whatever is wrong: guessing one at a time learns nothing
    one = fake_run(tmp_path / "one", 1, placement_rows(1, RIGHT))
    assert "not graded" in check_no_sync(one, RIGHT, dict.fromkeys(RIGHT, True))
    split = fake_run(tmp_path / "split", 2, placement_rows(2, RIGHT, differ_on_rank=1))
    with pytest.raises(AssertionError, match="ranks all-reduced at different"):
        check_no_sync(split, RIGHT, EQUAL)
    failed = fake_run(tmp_path / "failed", 1, placement_rows(1, RIGHT), status="failed")
    with pytest.raises(AssertionError, match="ended failed"):
        check_no_sync(failed, RIGHT, EQUAL)


# -- lesson 10: the fp16 step (check_train_step), one process, no launch -------------------
def _fp16_step(order):
    import torch
    import torch.nn.functional as F

    def step(model, opt, scaler, x, y, max_norm):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        if order == "no scaler":             # drops the GradScaler: fp16 gradients may underflow
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
        else:
            scaler.scale(loss).backward()
            if order == "clip, unscale":     # the notebook's starter
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                scaler.unscale_(opt)
            else:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def test_train_step_checker_accepts_unscale_then_clip():
    assert check_train_step(_fp16_step("unscale, clip"))


@pytest.mark.parametrize("order,message", [("clip, unscale", "differs from the reference"),
                                           ("no scaler", "GradScaler")])
def test_train_step_checker_rejects_clip_before_unscale_and_no_scaler(order, message):
    with pytest.raises(AssertionError, match=message):
        check_train_step(_fp16_step(order))


@pytest.mark.parametrize("answer,right", [(lambda S: S, True), (lambda S: 65536.0, False),
                                          (lambda S: 1.0, False)])
def test_too_small_by_is_checked_at_two_scales(answer, right):
    # Clipping before unscale_ clips the S-times-scaled gradient: a step S times too small.
    # A number read off one run (65536) fails at the second scale; "not clipped" (1) fails too.
    slow = _fp16_step("clip, unscale")
    if right:
        assert check_too_small_by(answer, slow)
    else:
        with pytest.raises(AssertionError, match="too small"):
            check_too_small_by(answer, slow)


@pytest.mark.parametrize("name,wrong", [
    ("lr x world size", lambda b, w, bb, lr: (b * w, lr * w)),               # ignores the base batch
    ("floor division", lambda b, w, bb, lr: (b * w, lr * (b * w // bb))),    # k = 1.5 becomes 1
    ("never scale down", lambda b, w, bb, lr: (b * w, lr * max(1, b * w / bb))),   # k = 0.5 becomes 1
    ("square-root rule", lambda b, w, bb, lr: (b * w, lr * (b * w / bb) ** 0.5)),
    ("per-device batch as the global one", lambda b, w, bb, lr: (b, lr * b * w / bb)),
    ("the notebook's own example hard-coded", lambda b, w, bb, lr: (384, 1.2)),
])
def test_scaled_checker_rejects_planted_wrong_answers(name, wrong):
    # 03b's exercise: its hidden solution cell proves the checker accepts the solution and
    # rejects the starter; the classic wrong rules are planted here
    with pytest.raises(AssertionError):
        check_scaled(wrong)


# -- the one verdict: common.grade (pure-function exercises of 00-08 and attempt's) -------
def test_grade_prints_the_verdict_and_returns_it(capsys):
    assert grade(check_scaled, lambda b, w, bb, lr: (b * w, lr * b * w / bb))
    assert capsys.readouterr().out == "correct!\n"
    # the starter's None is "not yet" (a TypeError), not a traceback
    assert not grade(check_scaled, lambda b, w, bb, lr: None)
    assert capsys.readouterr().out.startswith("not yet:")
    assert not grade(check_scaled, lambda b, w, bb, lr: (b * w, lr * w))
    assert "an epoch does not go as far" in capsys.readouterr().out
    assert grade(lambda: "what it saw")
    assert capsys.readouterr().out == "correct! what it saw\n"


def test_grade_says_not_yet_for_any_exception_of_the_learners_function(capsys):
    # a detached loss raises RuntimeError inside autograd, a typo NameError: a verdict that
    # names the error, not a traceback
    def detached(b, w, bb, lr):
        raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
    assert not grade(check_scaled, detached)
    assert capsys.readouterr().out == ("not yet: RuntimeError: element 0 of tensors does not require "
                                       "grad and does not have a grad_fn\n")
    assert not grade(check_scaled, lambda b, w, bb, lr: undefined_name)  # noqa: F821
    assert capsys.readouterr().out.startswith("not yet: NameError: ")
    with pytest.raises(KeyboardInterrupt):     # an interrupt still stops the cell
        grade(check_scaled, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))


def test_no_sync_prediction_of_the_wrong_kind_is_not_yet(tmp_path, capsys):
    ok = fake_run(tmp_path / "ok", 2, placement_rows(2, RIGHT))
    for wrong in (4, "4", [4.0]):              # 4 instead of [4]
        predicted = {**RIGHT, "forward only": wrong}
        with pytest.raises(AssertionError, match=r"forward only: say the micro-batches as a list"):
            check_no_sync(ok, predicted, EQUAL)
        assert not grade(check_no_sync, ok, predicted, EQUAL)
        assert capsys.readouterr().out.startswith("not yet: forward only: say the micro-batches")


def test_pure_checkers_accept_a_solution_and_reject_the_classic_mistake():
    # the notebooks' collapsed solution cells run each both ways; here the ones whose
    # starters do not raise by themselves
    assert check_predict(lambda n, c, g, a, b: n * c / (c + (n > 1) * (2 * (n - 1) * a + 2 * (n - 1) / n * g / b)))
    with pytest.raises(AssertionError, match="the model gives"):
        check_predict(lambda n, c, g, a, b: n)
    import argparse

    def parser(**kw):
        p = argparse.ArgumentParser()
        p.add_argument("--sync-bn", **kw)
        return p
    assert check_parser(lambda: parser(action=argparse.BooleanOptionalAction, default=False))
    with pytest.raises(AssertionError, match="refuses"):
        check_parser(lambda: parser(type=bool, default=False))
    assert check_ranks(lambda node, local, per: node * per + local, lambda env: f"cuda:{env['LOCAL_RANK']}")
    with pytest.raises(AssertionError, match="you said 'cuda:4'"):
        check_ranks(lambda node, local, per: node * per + local, lambda env: f"cuda:{env['RANK']}")
    crashed = {"status": "failed", "failure": {"rank": 1, "message": "RuntimeError: boom\nmore"}}
    assert check_first_failure(lambda r: r.get("failure") and (r["failure"]["rank"], "RuntimeError: boom"),
                                         crashed, {"status": "timeout"})
    with pytest.raises(AssertionError, match="root cause is rank 1"):
        check_first_failure(lambda r: (0, "rank 0 failed"), crashed, {"status": "timeout"})


def _cuda_index(physical, visible, repeats_first=True, plant=None):
    """00's exercise D: torch's reading of CUDA_VISIBLE_DEVICES on an 8-GPU server (the
    notebook's solution); repeats_first=False plants the answer that cuts the list at the
    first GPU the server lacks before it looks for a repeated id; plant="skip empty" skips an
    empty entry instead of stopping there, plant="no plus" reads "+2" as no number,
    plant="no minus zero" reads "-0" as no number (torch reads it as 0), plant="cut past 8"
    keeps GPU 8 (an off-by-one: x > 8), plant="repeat by text" looks for a repeated entry
    text instead of a repeated number ("0,-0" and "2gpu,2" then pass)."""
    import re
    ids = []
    for part in visible.split(","):
        sign = {"no plus": "-?", "no minus zero": r"\+?"}.get(plant, "[+-]?")
        number = re.match(sign + r"\d+", part.strip())
        if number is None or int(number.group()) < 0:    # "-0" is 0, "-1" stops the list
            if plant == "skip empty" and not part.strip():
                continue
            break
        ids.append(int(number.group()) if plant != "repeat by text" else part.strip())
    if plant == "repeat by text":
        if len(set(ids)) != len(ids):
            raise ValueError("a repeated id hides every GPU")
        ids = [int(re.match(r"[+-]?\d+", x).group()) for x in ids]
    last = 9 if plant == "cut past 8" else 8
    cut = next((i for i, x in enumerate(ids) if x >= last), len(ids))
    if plant != "repeat by text" and \
            len(set(ids if repeats_first else ids[:cut])) != len(ids if repeats_first else ids[:cut]):
        raise ValueError("a repeated id hides every GPU")
    ids = ids[:cut]
    if physical not in ids:
        raise ValueError(f"GPU {physical} is not visible")
    return ids.index(physical)


def test_cuda_index_checker_tests_the_order_the_prompt_states():
    # 00's prompt: torch looks for repeats before it cuts the list, so "0,9,0" hides every
    # GPU while "0,x,0" shows GPU 0; the checker must hold an answer to both
    from ddp_lesson.notebook import diagrams
    for visible in ("0,9,0", "0,x,0", "1,9,1", "0,9,1", "2,3,2"):
        want = diagrams.visible_ids(visible, 8)           # torch's parser (tests/test_diagrams_processes.py)
        for physical in range(8):
            try:
                got = _cuda_index(physical, visible)
            except ValueError:
                got = None
            assert got == (want.index(physical) if physical in want else None), (visible, physical)
    assert check_cuda_index(_cuda_index)
    with pytest.raises(AssertionError, match="0,9,0"):
        check_cuda_index(lambda p, v: _cuda_index(p, v, repeats_first=False))


def test_cuda_index_checker_rejects_skipping_entries_and_misreading_plus(monkeypatch):
    # the cases that tell these answers apart, read by torch's own parser, cut at 8 GPUs as
    # torch.cuda's device count cuts it (_device_count_nvml): "1,,2" and "x,1" stop at the entry
    # without a number, "+2" is 2
    import torch.cuda
    def torch_ids(visible):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        ids = torch.cuda._parse_visible_devices()
        return ids[:next((i for i, x in enumerate(ids) if x >= 8), len(ids))]
    assert torch_ids("1,,2") == [1] and torch_ids("x,1") == [] and torch_ids("+2,0") == [2, 0]
    assert torch_ids("-0,1") == [0, 1]
    # GPU 8 is the first one an 8-GPU server lacks; a repeat is of the number, not the text
    assert torch_ids("0,8,1") == [0] and torch_ids("0,-0") == [] and torch_ids("2gpu,2") == []
    for plant, visible in (("skip empty", "1,,2"), ("no plus", "+2,0"), ("no minus zero", "-0,1"),
                           ("cut past 8", "0,8,1"), ("repeat by text", "0,-0")):
        with pytest.raises(AssertionError, match=re.escape(repr(visible))):
            check_cuda_index(lambda p, v: _cuda_index(p, v, plant=plant))
    assert check_cuda_index(_cuda_index)


def test_dp_chunk_sizes_checker_wants_a_rule_not_a_call_to_chunk():
    import torch
    def rule(batch, n):
        size = -(-batch // n)
        return [min(size, batch - start) for start in range(0, batch, size)]
    assert check_dp_chunk_sizes(rule)
    for planted in (lambda b, n: [len(c) for c in torch.empty(b).chunk(n)],      # asks torch instead
                    lambda b, n: [len(c) for c in torch.chunk(torch.empty(b), n)],
                    lambda b, n: [len(c) for c in torch.empty(b).tensor_split(n)],  # as even as possible
                    lambda b, n: [b // n + (i < b % n) for i in range(n) if b // n + (i < b % n)]):
        with pytest.raises(AssertionError):
            check_dp_chunk_sizes(planted)
    from torch import chunk                                                    # bound before the check
    for route in (lambda b, n: chunk(torch.empty(b), n), lambda b, n: torch._VF.chunk(torch.empty(b), n),
                  lambda b, n: torch._C.TensorBase.chunk(torch.empty(b), n),
                  lambda b, n: torch.ops.aten.chunk(torch.empty(b), n),
                  lambda b, n: torch.empty(b).split(-(-b // n))):
        with pytest.raises(AssertionError, match="write the rule yourself"):  # every route to torch's chunk
            check_dp_chunk_sizes(lambda b, n, route=route: [len(c) for c in route(b, n)])
    from concurrent.futures import ThreadPoolExecutor                          # a thread fn starts

    def in_a_thread(b, n):
        with ThreadPoolExecutor(1) as pool:
            return [len(c) for c in pool.submit(lambda: torch.empty(b).chunk(n)).result()]

    def hook_off(b, n):                                                        # switches the watch off
        sys.setprofile(None)
        return [len(c) for c in torch.empty(b).chunk(n)]
    with pytest.raises(AssertionError, match="write the rule yourself"):
        check_dp_chunk_sizes(in_a_thread)
    with pytest.raises(AssertionError, match="leave the profile hook alone"):
        check_dp_chunk_sizes(hook_off)
    assert threading.getprofile() is None
    assert check_dp_chunk_sizes(lambda b, n: [len(x) for x in "".join(
        "a" * min(-(-b // n), b - s) + "," for s in range(0, b, -(-b // n))).split(",")[:-1]])  # str.split is fine
    assert sys.getprofile() is None                                           # the watch is gone
    assert [len(c) for c in torch.empty(6).chunk(4)] == [2, 2, 2]               # torch is itself again


# -- the layout: graders/lNN.py grades notebooks/NN_*.ipynb -------------------------------
def test_each_grader_module_is_named_by_its_notebook_and_graded_there():
    """Every graders/lNN.py names a notebook NN_*.ipynb, which imports it; a notebook imports
    no other notebook's grader (common.py is everyone's)."""
    from pathlib import Path
    import ddp_lesson.notebook.graders as graders
    root = Path(__file__).resolve().parent.parent
    modules = {p.stem for p in Path(graders.__file__).parent.glob("*.py")} - {"__init__", "common"}
    assert modules, "no grader modules found"
    imported = {}
    for nb in sorted((root / "notebooks").glob("*.ipynb")):
        code = "".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")
        names = set(re.findall(r"ddp_lesson\.notebook\.graders\.(\w+)", code))
        for group in re.findall(r"from ddp_lesson\.notebook\.graders import ([\w, ]+)", code):
            names |= {n.strip() for n in group.split(",")}
        number = nb.name.split("_")[0]
        assert names <= {"common", f"l{number}"}, f"{nb.name} imports {sorted(names)}: only common and l{number}"
        imported[f"l{number}"] = f"l{number}" in names
    for m in sorted(modules):
        assert m in imported, f"graders/{m}.py: no notebook {m[1:]}_*.ipynb"
        assert imported[m], f"graders/{m}.py: notebook {m[1:]} does not import it"
