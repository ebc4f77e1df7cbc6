"""Notebook 03c (averaging in DDP): its claims checked without a kernel, the exercise's
solution, and the one claim the notebook only computes in arithmetic, checked on 2 real gloo
ranks: a loss all-reduced by hand before backward gives gradients divided twice."""
import json
import math
import os
import re
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

from conftest import plain_torchrun
from ddp_lesson.rank.bundled import script

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "03c_averaging_in_ddp.ipynb"


def cells():
    return json.loads(NOTEBOOK.read_text())["cells"]


def source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _ddp_gradient(net, X, Y, sizes, rank_loss):
    grads = []
    for xs, ys in zip(X.split(sizes), Y.split(sizes)):
        net.zero_grad()
        rank_loss(F.mse_loss(net(xs), ys, reduction="none").flatten(), len(X), len(sizes)).backward()
        grads.append(torch.cat([p.grad.flatten() for p in net.parameters()]))
    return torch.stack(grads).mean(0)        # what DDP's all-reduce average produces


def test_ddp_gradient_average_exact_when_even_biased_when_uneven_fixed_by_weighting():
    torch.manual_seed(0)
    X, Y = torch.randn(10, 4, dtype=torch.float64), torch.randn(10, 1, dtype=torch.float64)
    net = nn.Linear(4, 1).double()
    net.zero_grad()
    F.mse_loss(net(X), Y).backward()
    want = torch.cat([p.grad.flatten() for p in net.parameters()])
    mean = lambda losses, n, world: losses.mean()
    weighted = lambda losses, n, world: losses.sum() * world / n
    assert torch.allclose(_ddp_gradient(net, X, Y, [5, 5], mean), want)
    assert not torch.allclose(_ddp_gradient(net, X, Y, [6, 4], mean), want)
    assert torch.allclose(_ddp_gradient(net, X, Y, [6, 4], weighted), want)
    assert torch.allclose(_ddp_gradient(net, X, Y, [5, 2, 2, 1], weighted), want)


# -- 02: metrics ------------------------------------------------------------------------------

def test_padded_sampler_accuracy_is_wrong_and_summed_counts_are_right():
    n, world = 10, 4
    right = torch.tensor([1, 1, 0, 0, 0, 1, 0, 0, 1, 1], dtype=torch.bool)
    data = TensorDataset(torch.arange(n))
    samplers = [DistributedSampler(data, num_replicas=world, rank=r, shuffle=False) for r in range(world)]
    padded_way = sum(right[list(s)].sum().item() for s in samplers) / samplers[0].total_size
    assert samplers[0].total_size == 12 and padded_way == 7 / 12
    shards = [list(range(r, n, world)) for r in range(world)]
    assert sorted(i for s in shards for i in s) == list(range(n))      # every sample once
    mean_of_accuracies = sum(right[s].float().mean().item() for s in shards) / world
    counts = torch.tensor([[right[s].sum().item(), len(s)] for s in shards]).sum(0)
    assert not math.isclose(mean_of_accuracies, 0.5)
    assert (counts[0] / counts[1]).item() == 0.5 == right.float().mean().item()


def test_distributed_sampler_pads_with_duplicates_and_drop_last_does_not():
    nine = TensorDataset(torch.arange(9))
    padded = [list(DistributedSampler(nine, num_replicas=2, rank=r, shuffle=False)) for r in range(2)]
    assert sorted(padded[0] + padded[1]).count(0) == 2
    dropped = [list(DistributedSampler(nine, num_replicas=2, rank=r, shuffle=False, drop_last=True))
               for r in range(2)]
    assert sorted(dropped[0] + dropped[1]) == list(range(8))



def test_exercise_with_checker_and_solution():
    texts = [source(c) for c in cells() if c["cell_type"] == "code"]
    assert any("# your answer here" in t and "def check_" in t and "grade(check_" in t for t in texts)
    solutions = [c for c in cells() if "solution" in c.get("metadata", {}).get("tags", [])]
    assert solutions and all(c["metadata"]["jupyter"]["source_hidden"] for c in solutions)
    assert all("check_" in source(c) and "starter" in source(c) for c in solutions)


def test_exercise_comes_before_the_cells_that_would_give_it_away():
    # The learner works the weighting out from section 1: no cell before the exercise states the
    # answer, and section 3 (which says DDP divides by the world size a second time) comes after.
    c = cells()
    start = next(i for i, x in enumerate(c) if source(x).startswith("### Exercise: weight the loss"))
    twice = next(i for i, x in enumerate(c) if x.get("id") == "03c-twice")
    assert start < twice
    before = "\n".join(source(x) for x in c[:start]).replace(" ", "")
    for answer in ("*world_size/global_count", "world_size/global_count", "*world/n_global", "1/(globalcount)"):
        assert answer not in before, answer


def test_links_previous_03b_next_04():
    last = source(cells()[-1])
    assert "(03b_ddp_equals_one_process.ipynb)" in last and "(04_sync_batchnorm.ipynb)" in last
    for name in ("03b_ddp_equals_one_process.ipynb", "04_sync_batchnorm.ipynb"):
        assert (ROOT / "notebooks" / name).is_file()


def test_script_seeds_and_evaluates_as_notebook_03s():
    # the learner meets one rule for both scripts: seed + rank, evaluation through DDP's forward
    mine, basic = script("loss_averaging.py").read_text(), script("ddp_basic.py").read_text()
    for needle in ("torch.manual_seed(args.seed + rank)", 'os.environ["RANK"]', 'os.environ["LOCAL_RANK"]',
                   'os.environ["WORLD_SIZE"]', "@record", "set_epoch", "destroy_process_group"):
        assert needle in mine and needle in basic, needle
    assert "count_correct(model.module" not in mine and "count_correct(model," in mine



def test_script_model_has_no_buffers_so_ddp_forward_sends_nothing(monkeypatch):
    # 03c says: SmallCNN(norm=False) has no buffers, so loss_averaging.py's test forwards through
    # DDP send nothing; with BatchNorm, as in 03's script, the first forward after training would
    from ddp_lesson.launcher import launch
    from ddp_lesson.rank import models
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    assert "models.SmallCNN(norm=False, width=8)" in script("loss_averaging.py").read_text()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(launch.free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        for norm in (False, True):
            model = DDP(models.SmallCNN(norm=norm, width=8))
            model(torch.randn(4, 3, 16, 16)).sum().backward()
            assert (len(list(model.module.buffers())) > 0) == norm
            assert model.will_sync_module_buffers() == norm   # the next forward broadcasts, or not
    finally:
        dist.destroy_process_group()

HAND_REDUCED = textwrap.dedent("""
    import warnings, torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    X, Y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    net = DDP(nn.Linear(4, 1).double())
    loss = nn.functional.mse_loss(net(X.chunk(world)[rank]), Y.chunk(world)[rank])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.all_reduce(loss)          # the mistake: the loss reduced by hand before backward
        loss = loss / world
        loss.backward()
    one = nn.Linear(4, 1).double()
    one.load_state_dict(net.module.state_dict())
    nn.functional.mse_loss(one(X), Y).backward()
    if rank == 0:
        print("RATIO", (one.weight.grad / net.module.weight.grad).flatten().tolist())
        print("WARNED", any("autograd kernel was not registered" in str(w.message) for w in caught))
    dist.barrier()
    dist.destroy_process_group()
    import os, sys; sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)  # skip finalization: it races gloo's worker thread and can abort (SIGABRT); see guard._exit_rank
""")


def test_loss_reduced_by_hand_divides_the_gradients_twice(tmp_path):
    script = tmp_path / "hand_reduced.py"
    script.write_text(HAND_REDUCED)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    out = plain_torchrun(script, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    ratio = json.loads(out.stdout.split("RATIO", 1)[1].splitlines()[0].strip())
    assert all(math.isclose(r, 2.0, rel_tol=1e-9) for r in ratio), ratio      # 2 ranks: half of one process's
    assert "WARNED True" in out.stdout, out.stdout




def _notebook_function(cell_id, name, **namespace):
    "Define one function from a notebook cell's source, the code the learner runs."
    cell = next(c for c in cells() if c.get("id") == cell_id)
    text = source(cell)
    start = text.index(f"def {name}(")
    end = text.find("\n\n\n", start)
    namespace = {"math": math, **namespace}
    exec(text[start:end if end != -1 else None], namespace)
    return namespace[name]


def _rows(losses_per_step):
    "Rows as loss_averaging.py logs them: each rank's own loss, rank 0's reduced loss."
    rows = []
    for step, losses in enumerate(losses_per_step, 1):
        rows += [{"step": step, "rank": r, "loss": v} for r, v in enumerate(losses)]
        rows.append({"step": step, "rank": 0, "loss_reduced": sum(losses) / len(losses)})
    return rows


def test_log_check_proves_own_losses_and_their_mean():
    check = _notebook_function("da005b13", "check_logged_losses")
    own = [[2.3, 2.1, 2.2], [2.0, 1.9, 2.05]]
    assert check(_rows(own), 3) == 2
    averaged = [[sum(s) / 3] * 3 for s in own]            # every rank logs the mean: not its own loss
    with pytest.raises(AssertionError):
        check(_rows(averaged), 3)
    wrong_mean = _rows(own)
    wrong_mean[3]["loss_reduced"] = 2.3                   # reduced loss not the mean
    with pytest.raises(AssertionError):
        check(wrong_mean, 3)
    assert check(_rows([[2.3], [2.0]]), 1) == 2           # one rank: nothing differs, nothing to plant


# Section 3's mistake planted in the real script: the loss all-reduced in place before backward.
MISTAKE = ("            loss.backward()                        # DDP: the gradients are averaged here\n",
           "            dist.all_reduce(loss)\n            loss = loss / world_size\n"
           "            loss.backward()                        # DDP: the gradients are averaged here\n")


def test_gradient_check_rejects_the_real_mistake_on_2_ranks(tmp_path):
    from ddp_lesson.rank import data, models
    from ddp_lesson.launcher import launch, runs
    from torch.utils.data.distributed import DistributedSampler as Sampler
    text = script("loss_averaging.py").read_text()
    assert MISTAKE[0] in text
    mistake = tmp_path / "mistake.py"
    mistake.write_text(text.replace(MISTAKE[0], MISTAKE[1]))
    run = launch.start(mistake, nproc=2, cpu=True, run_dir=tmp_path / "run",
                       args=["--epochs", "1", "--batch-size", "16", "--n-train", "96", "--n-test", "40"])
    try:
        result = run.wait(timeout=240)
    finally:
        run.stop()
    assert result and result["status"] == "ok", (result, runs.log_tail(run.run_dir, 0, 30, "stderr"))
    rec = runs.load(run.run_dir)
    world = rec.config["world_size"]
    first = _notebook_function("da005b13", "one_process_first_gradient", argparse=__import__("argparse"),
                               torch=torch, F=F, models=models, data=data, DistributedSampler=Sampler)
    check = _notebook_function("da005b13", "check_gradients")
    want = first(rec.config)
    with pytest.raises(AssertionError, match="step 1: gradient norm"):
        check(rec.rows, world, want, 1e-4)              # the notebook's check fails on the mistake
    # and only because of the mistake's factor: undone, the same rows pass the same check
    undone = [dict(r, grad_norm=r["grad_norm"] * world) if "grad_norm" in r else r for r in rec.rows]
    assert check(undone, world, want, 1e-4) == 3
    # the loss log cannot tell: every rank logged the same, averaged loss, which the safe pattern can too
    losses = {r["step"]: set() for r in rec.rows if "loss" in r}
    for r in rec.rows:
        if "loss" in r:
            losses[r["step"]].add(r["loss"])
    assert all(len(v) == 1 for v in losses.values())


def test_ddp_divides_before_the_all_reduce_as_the_notebooks_say():
    # the built-in path: the division fused with the copy into the bucket, then a plain sum
    import inspect
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    include = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed" / "c10d"
    assert "without division inside the hook" in (include / "default_comm_hooks.hpp").read_text()
    assert "div_factor_" in (include / "reducer.hpp").read_text()
    code = inspect.getsource(default_hooks._allreduce_fut)
    assert code.index("div_(") < code.index("all_reduce(")
    for name in ("01_data_parallel.ipynb", "03c_averaging_in_ddp.ipynb"):
        text = (ROOT / "notebooks" / name).read_text()
        assert "then divided by the number of GPUs" not in text and "and divides by\\n" not in text, name


def test_tf32_rounding_moves_smallcnn_outputs_well_inside_the_near_tie_margin():
    # 03c's accuracy check allows, on GPUs, the near-ties: top two outputs closer than 0.3% of the
    # largest output. Emulated TF32 (inputs of each convolution rounded to 10 mantissa bits) must
    # move the outputs by far less than half that margin, or a non-tie could flip.
    from ddp_lesson.rank import data, models
    assert torch.backends.cudnn.allow_tf32                       # the default the notebook names

    def tf32(t):
        i = t.contiguous().view(torch.int32)
        return ((i + 0x1000) & ~0x1FFF).view(torch.float32)

    torch.manual_seed(0)
    model = models.SmallCNN(norm=False, width=8).eval()
    images = data.shapes(256, seed=1).tensors[0]
    with torch.no_grad():
        exact = model.double()(images.double())
        model.float()
        x = images
        for layer in model.features:
            x = (torch.nn.functional.conv2d(tf32(x), tf32(layer.weight), layer.bias, layer.stride, layer.padding)
                 if isinstance(layer, nn.Conv2d) else layer(x))
        emulated = model.classifier(x.flatten(1))
    error = (emulated.double() - exact).abs().max().item()
    margin = 0.003 * exact.abs().max().item()
    assert 0 < error < margin / 4, (error, margin)


def _run_twice_cell(planted=None):
    "Section 3's cell run after section 1's, with its all_reduce stand-in replaced by `planted`."
    ns = {"print": lambda *a, **k: None}
    for cell_id in ("03c-01", "903f13ff"):          # imports, then section 1's net and `even`
        exec(source(next(c for c in cells() if c.get("id") == cell_id)), ns)
    text = source(next(c for c in cells() if c.get("id") == "03c-twice"))
    call = "by_hand = reduced_by_hand(sizes, all_reduce_in_place)"
    assert call in text
    if planted is not None:
        ns["planted"] = planted
        text = text.replace(call, "by_hand = reduced_by_hand(sizes, planted)")
    exec(text, ns)
    return ns


def test_twice_cell_measures_autograd_and_fails_when_the_all_reduce_is_seen_or_missing():
    ns = _run_twice_cell()
    assert torch.allclose(ns["by_hand"] * 2, ns["even"])

    def recorded(losses):           # an all-reduce autograd sees, as torch.distributed.nn's: d total / d own = world
        world, total = len(losses), sum(loss.detach() for loss in losses)
        losses[:] = [world * loss - (world * loss).detach() + total for loss in losses]

    def missing(losses):            # no all-reduce at all: each rank logs its own loss / world
        pass

    for planted in (recorded, missing):   # the first fails the gradient check, the second the value check
        with pytest.raises(AssertionError):
            _run_twice_cell(planted)
    # the recorded one is what makes the gradient right: the check's claim is about autograd
    ns = _run_twice_cell()
    assert torch.allclose(ns["reduced_by_hand"]([5, 5], recorded), ns["even"])


def test_appendix_quotes_the_scripts_lines_that_matter():
    # the script's cell is collapsed; the appendix's text quotes its lines, so they must be the script's
    text = source(next(c for c in cells() if c.get("id") == "c686473c"))
    quoted = text.split("```python\n", 1)[1].split("```", 1)[0].splitlines()
    lines = {line.strip() for line in script("loss_averaging.py").read_text().splitlines()}
    mine = [q.strip() for q in quoted if q.strip() != "..."]
    assert len(mine) == 6 and all(q in lines for q in mine), [q for q in mine if q not in lines]
    for cell_id in ("4d514f39", "da005b13", "942695e9"):   # the script, the log check, the recount
        assert next(c for c in cells() if c.get("id") == cell_id)["metadata"]["jupyter"]["source_hidden"]


def test_padding_of_the_1003_test_images_is_at_most_5_at_1_to_8_ranks():
    # 03c: the padded accuracy is close to the right one in the appendix's run, since the sampler
    # repeats at most 5 of the 1003 test images at any world size from 1 to 8
    data = TensorDataset(torch.arange(1003))
    repeats = [DistributedSampler(data, num_replicas=w, rank=0).total_size - 1003 for w in range(1, 9)]
    assert max(repeats) == 5 and min(repeats) == 0, repeats


def test_join_rule_is_in_the_lesson_text_not_only_in_a_fold():
    lesson = "\n".join(source(c) for c in cells()
                       if c["cell_type"] == "markdown" and not source(c).startswith("<details>"))
    assert "with model.join():" in lesson and "with model.join(throw_on_early_termination=True):" in lesson


def test_real_run_is_an_optional_appendix_after_the_main_path():
    # the real run re-proves sections 3 and 4: an optional appendix after section 4 and the
    # exercise, with its panel, run and checks inside it, and no "section 5" left to point at
    c = cells()
    ids = [x.get("id") for x in c]
    headings = [(i, line) for i, x in enumerate(c) if x["cell_type"] == "markdown"
                for line in source(x).splitlines() if line.startswith("## ")]
    appendix = ids.index("c686473c")
    assert source(c[appendix]).startswith("## Appendix (optional): a real run")
    assert [line[:5] for i, line in headings if i < appendix] == ["## 1.", "## 2.", "## 3.", "## 4."]
    assert [i for i, _ in headings if i > appendix] == []                 # nothing of the lesson after it
    exercise = next(i for i, x in enumerate(c) if source(x).startswith("### Exercise: weight the loss"))
    assert exercise < ids.index("03c-metrics") < appendix
    for cell_id in ("a30a8b46", "71a02cf5", "438ba6ab", "da005b13", "942695e9"):   # panel, run, checks
        assert appendix < ids.index(cell_id) < ids.index("03c-where"), cell_id
    text = "\n".join(source(x) for x in c)
    assert "section 5" not in text.lower() and "sections 3 to 5" not in text.lower()
    assert "appendix" in source(c[0]).lower() and "Sections 3 and 4" in source(c[0])


def test_check_cells_are_collapsed_and_the_text_before_them_says_what_they_do():
    # a collapsed cell's first comment is hidden: the markdown before it, or its own output, says it
    c = cells()
    checks = [i for i, x in enumerate(c) if x["cell_type"] == "code" and source(x).startswith("# Just run it")]
    assert len(checks) >= 7
    for i in checks:
        assert c[i]["metadata"].get("jupyter", {}).get("source_hidden") is True, c[i]["id"]
        before = next(source(x) for x in reversed(c[:i])       # what the learner reads: folds show one line
                      if x["cell_type"] == "markdown" and not source(x).startswith("<details>"))
        says = re.sub(r"\s+", " ", before.lower())
        assert re.search(r"((next|collapsed|following) cells?|cells? (below|after))\b[^.]*\b(checks?|draws?|prints?|shows?|recounts?|reads?|makes?|runs?)\b", says), \
            (c[i]["id"], says[-200:])                                  # names the cell and what it does


def _rank_loss_checker():
    "The exercise's checker, check_rank_loss, defined from the notebook's cells with its helpers."
    ns = {"torch": torch, "F": F, "nn": nn}
    helpers = next(source(c) for c in cells() if "def ddp_gradient(" in source(c))
    exec(helpers[helpers.index("X, Y = "):helpers.index("one_process = ")], ns)
    text = next(source(c) for c in cells() if "def check_rank_loss(" in source(c))
    start = text.index("def check_rank_loss(")
    exec(text[start:text.index("\n\n\n", start)], ns)
    return ns["check_rank_loss"]


def test_rank_loss_checker_names_the_missing_world_size_factor():
    check = _rank_loss_checker()
    assert check(lambda losses, n, world: losses.sum() * world / n)            # the solution
    with pytest.raises(AssertionError, match="times too small, the world size"):
        check(lambda losses, n, world: losses.sum() / n)                      # planted: the likely miss
    with pytest.raises(AssertionError, match="off by"):                        # other mistakes: the plain message
        check(lambda losses, n, world: losses.mean())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("planted", [False, True])
def test_join_run_ends_with_join_and_times_out_without(tmp_path, planted):
    # 03c's Join run on 2 real gloo ranks; planted: the `with model.join():` taken out, so the
    # second part is as uneven as the first and must fail on rank 1 (a timeout, not a hang)
    from ddp_lesson.launcher import launch, runs
    text = script("join_uneven.py").read_text()
    assert "    with model.join():" in text
    path = tmp_path / "join_uneven.py"
    path.write_text(text.replace("    with model.join():", "    if True:") if planted else text)
    run = launch.start(path, nproc=2, cpu=True, run_dir=tmp_path / "run")
    try:
        result = run.wait(timeout=240)
    finally:
        run.stop()
    assert result and result["status"] == "ok", (result, runs.log_tail(run.run_dir, 0, 30, "stderr"))
    ranks = json.loads((Path(run.run_dir) / "join.json").read_text())
    assert ranks[0]["without_join"]["error"] is None and ranks[0]["without_join"]["steps"] == 2
    assert ranks[1]["without_join"]["error"] and ranks[1]["without_join"]["steps"] == 2   # waited for rank 0
    assert ranks[1]["without_join"]["seconds"] >= 0.9 * ranks[1]["timeout_s"]
    if planted:
        assert ranks[1]["with_join"]["error"] and ranks[1]["with_join"]["steps"] == 2
    else:
        assert [r["with_join"]["steps"] for r in ranks] == [2, 3] and all(r["weights_equal"] for r in ranks)
        assert not any(r["weights_equal_inside"] for r in ranks)   # equal only after the with: Join's copy
