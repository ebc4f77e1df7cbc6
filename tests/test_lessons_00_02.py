"""The key claims of notebooks 00-02, checked without a kernel, and an exercise with a
checker and a solution in each. Their DDP counterparts (notebook 03c): tests/test_lesson_03c.py."""
import json
import re
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ddp_lesson.notebook import simulate

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ["00_start_here.ipynb", "01_data_parallel.ipynb", "02_loss_averaging.ipynb"]


def cells(name):
    return json.loads((ROOT / "notebooks" / name).read_text())["cells"]


def source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


# -- form (outputs, ids and %%writefile cells: tests/test_notebooks_check.py) ---------------

@pytest.mark.parametrize("name", NOTEBOOKS)
def test_exercise_with_checker_and_solution(name):
    # the convention of 00-05: a starter marked `# your answer here` that the learner runs
    # through the checker (grade prints "correct!" or "not yet:"); a collapsed
    # <details> solution; a hidden solution cell that proves the checker accepts the solution
    # and rejects the starter
    texts = [source(c) for c in cells(name) if c["cell_type"] == "code"]
    assert any("# your answer here" in t and "grade(check_" in t for t in texts)
    assert any(c["cell_type"] == "markdown" and source(c).startswith("<details>") for c in cells(name))
    solutions = [c for c in cells(name) if "solution" in c.get("metadata", {}).get("tags", [])]
    assert solutions and all(c["metadata"]["jupyter"]["source_hidden"] for c in solutions)
    assert all("check_" in source(c) and "starter" in source(c) for c in solutions)


# -- 00: the fast path, its script, the lesson text and the glossary ------------------------

from ddp_lesson.notebook.lesson import load_script, script  # noqa: E402

FIRST_RUN = script("first_run.py")


def _train_by_hand(script, world, average=True, divide=True, steps=None):
    """first_run.py's loop for every rank in one process: shards, one gradient all-reduce.
    divide=False plants the bug of a deleted `p.grad /= world`: the ranks sum their gradients."""
    x, y = script.make_data()
    models = []
    for _ in range(world):
        torch.manual_seed(0)
        models.append(nn.Linear(2, 1))
    opts = [torch.optim.SGD(m.parameters(), lr=script.LR) for m in models]
    for _ in range(steps or script.STEPS):
        for rank, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            F.mse_loss(m(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        if average:   # the all_reduce (a sum on every rank), then / world
            for ps in zip(*(m.parameters() for m in models)):
                total = sum(p.grad for p in ps)
                for p in ps:
                    p.grad = total / world if divide else total.clone()
        for o in opts:
            o.step()
    return [torch.cat([p.detach().flatten() for p in m.parameters()]) for m in models]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_first_run_averaged_shards_equal_one_process_on_all_data(world):
    script = load_script(FIRST_RUN)
    alone = _train_by_hand(script, 1)[0]
    ranks = _train_by_hand(script, world)
    assert all(torch.allclose(w, alone, rtol=1e-4, atol=1e-5) for w in ranks)
    if world > 1:   # without the all_reduce the copies drift apart: the check can fail
        drifted = _train_by_hand(script, world, average=False)
        assert not torch.allclose(drifted[0], drifted[1], atol=1e-4)


@pytest.mark.parametrize("lr", [0.1, 0.3])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_first_run_step_one_check_catches_a_sum_instead_of_an_average(world, lr):
    # 00's check cell compares the weights after step 1 with one process on all the data; a
    # deleted `p.grad /= world` fails it at any LR, while at LR 0.3 and 2 ranks the last step's
    # weights match anyway (both runs converge): that is why the first-step check exists
    script = load_script(FIRST_RUN)
    script.LR = lr
    alone = _train_by_hand(script, 1, steps=1)[0]
    assert all(torch.allclose(w, alone, rtol=1e-4, atol=1e-6) for w in _train_by_hand(script, world, steps=1))
    summed = _train_by_hand(script, world, divide=False, steps=1)
    assert not torch.allclose(summed[0], alone, rtol=1e-4, atol=1e-6)
    if world == 2 and lr == 0.3:
        assert torch.allclose(_train_by_hand(script, 2, divide=False)[0], _train_by_hand(script, 1)[0],
                              rtol=1e-4, atol=1e-5)
    check = next(source(c) for c in cells("00_start_here.ipynb") if c.get("id") == "cc6125a4")
    assert "if step == 0" in check and "allclose(weights[0][0], alone" in check


def _losses_by_rank(script, world, lr):
    """[step][rank]: each rank's loss on its own shard as first_run.py logs it, before the
    step's update. The ranks hold one process's weights on all the data (tested above), so one
    process trains them here."""
    x, y = script.make_data()
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for _ in range(script.STEPS):
        with torch.no_grad():
            out.append([F.mse_loss(model(xs), ys).item() for xs, ys in zip(x.chunk(world), y.chunk(world))])
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return out


@pytest.mark.parametrize("world", range(1, 9))
def test_00_step_one_says_what_the_plot_shows(world):
    # step 1 of 00, in its fold: the curves look flat on the plot's linear scale once every rank's loss is
    # below 2% of the plot's top (the largest step-0 loss): after about 3 steps at LR 0.3, about
    # 10 at LR 0.1. Every rank gets within twice the floor, 0.02, after 5 steps at LR 0.3 and
    # 17 to 20 at LR 0.1, and both end near 0.01
    text = next(source(c) for c in cells("00_start_here.ipynb") if c.get("id") == "00-panel-hood")
    assert "a loss of about 0.01" in text
    assert "A loss that falls a hundredfold or more is drawn on a log axis" in "\n".join(
        source(c) for c in cells("00_start_here.ipynb"))
    assert "within twice the floor after 5 steps at LR 0.3, and after 17 to 20 at LR 0.1" in text
    script = load_script(FIRST_RUN)
    near = {}
    for lr, flat_steps, near_steps in ((0.3, range(2, 5), range(0, 6)), (0.1, range(9, 12), range(17, 21))):
        losses = _losses_by_rank(script, world, lr)
        top = max(losses[0])
        flat = next(s for s, ls in enumerate(losses) if max(ls) < 0.02 * top)
        near[lr] = next(s for s, ls in enumerate(losses) if max(ls) < 2 * 0.01)
        assert flat in flat_steps and near[lr] in near_steps, (lr, flat, near[lr])
        assert all(0.005 < l < 0.015 for l in losses[-1]), (lr, losses[-1])   # the floor, about 0.01
        assert top >= 100 * min(losses[-1])   # a hundredfold fall: the panel draws it on a log axis
    assert near[0.1] > 3 * near[0.3]          # still falling long after it looks flat at LR 0.1


def test_00_the_panel_line_of_30_steps_is_the_plain_mean():
    # 00's fold says the thick line is averaged over neighbouring steps only on runs of 40 steps
    # or more, so first_run.py's line is the plain mean over ranks
    from ddp_lesson.notebook.plots import smooth
    text = next(source(c) for c in cells("00_start_here.ipynb") if c.get("id") == "00-panel-hood")
    assert "On a run of 40 steps or more" in text and "the ranks' plain average" in text
    ys = [float((7 * i) % 11) for i in range(60)]
    assert load_script(FIRST_RUN).STEPS < 40
    assert all(smooth(ys[:n]) == ys[:n] for n in range(1, 40))
    assert smooth(ys[:40]) != ys[:40]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_00_panel_draws_first_run_on_a_log_axis_with_each_rank_visible_and_no_smoothed_label(world):
    # what the panel draws for first_run.py's 30 steps: a log axis (the loss falls a
    # hundredfold), per-rank lines not faint, and a legend that does not say "smoothed"
    from matplotlib.figure import Figure
    from ddp_lesson.notebook import plots
    losses = _losses_by_rank(load_script(FIRST_RUN), world, 0.3)
    rows = [{"rank": r, "step": s, "loss": ls[r]} for s, ls in enumerate(losses) for r in range(world)]
    ax = Figure().subplots()
    plots.draw_metric(ax, rows, "loss")
    assert ax.get_yscale() == "log"
    labels = [line.get_label() for line in ax.get_lines()]
    assert not any("smoothed" in l or "raw" in l for l in labels), labels
    assert all(line.get_alpha() is None or line.get_alpha() >= 0.7 for line in ax.get_lines())
    flat = [{"rank": 0, "step": s, "loss": 2.3 - 0.01 * s} for s in range(60)]   # a narrow loss stays linear
    plots.draw_metric(ax, flat, "loss")
    assert ax.get_yscale() == "linear" and "smoothed" in ax.get_lines()[-1].get_label()


def test_a_diverged_run_does_not_say_ok():
    # LR = 1.5 in 00: the processes end without an error, the loss reaches 1e22; the panel's
    # title and status line must not say "ok"
    from pathlib import Path as P
    from types import SimpleNamespace
    from ddp_lesson.launcher import monitor
    run = SimpleNamespace(config={"nproc": 2, "backend": "gloo", "label": "first_run"}, elapsed=3.0,
                          run_dir=P("r"), result={"status": "ok", "duration_s": 3.0})
    good = [{"rank": r, "step": s, "loss": 20.0 / (s + 1)} for s in range(30) for r in range(2)]
    bad = good + [{"rank": 1, "step": 30, "loss": 1.3e22}]
    assert "first_run: ok" in monitor.title(run, good)
    assert monitor.result_text(run, good).startswith("Finished ok")
    assert ": ok" not in monitor.title(run, bad) and "diverged" in monitor.title(run, bad)
    text = monitor.result_text(run, bad)
    assert "diverged" in text and "loss 1.3e+22" in text and not text.startswith("Finished ok"), text
    assert "diverged" in monitor.title(run, good + [{"rank": 0, "step": 30, "loss": float("nan")}])


def _weights_via_autograd(batch, n_devices):
    # planted: lets autograd find the weights instead of predicting them (passed before issue 45)
    losses = torch.rand(batch, dtype=torch.float64, requires_grad=True)
    torch.stack([c.mean() for c in losses.chunk(n_devices)]).mean().backward()
    return losses.grad.tolist()


def _weights_via_hidden_autograd(batch, n_devices):
    # planted: the same, with the word hidden from a source check
    losses = torch.rand(batch, dtype=torch.float64)
    getattr(losses, "requires" + "_grad_")(True)
    getattr(torch.stack([c.mean() for c in losses.chunk(n_devices)]).mean(), "back" + "ward")()
    return losses.grad.tolist()


def _weights_via_func_grad(batch, n_devices):
    # planted (expert review, issue 45): torch.func.grad ignores the checker's outer no_grad
    import torch.func as tf
    return tf.grad(lambda l: torch.stack([c.mean() for c in l.chunk(n_devices)]).mean())(torch.rand(batch)).tolist()


def _weights_via_set_grad_enabled(batch, n_devices):
    # planted: autograd switched back on by a name a word list missed, backward reached by getattr
    on = getattr(torch, "set_" + "grad_enabled")
    with on(True):
        losses = torch.rand(batch, dtype=torch.float64).requires_grad_()
        getattr(torch.stack([c.mean() for c in losses.chunk(n_devices)]).mean(), "back" "ward")()
    return losses.grad.tolist()


def _weights_explained_in_a_comment(batch, n_devices):
    # a correct answer whose comment and string name backward and autograd: accepted
    size = -(-batch // n_devices)   # as backward would find it
    chunks = [min(size, batch - start) for start in range(0, batch, size)]
    note = "no autograd here"
    return [1 / (len(chunks) * c) for c in chunks for _ in range(c)] if note else None


def test_02_checker_accepts_the_prediction_and_refuses_autograd():
    from ddp_lesson.notebook.graders.l02 import check_weights
    assert check_weights(_mean_of_means_weights)
    assert check_weights(_weights_explained_in_a_comment)     # names in comments and strings do not count
    for planted in (_weights_via_autograd, _weights_via_hidden_autograd, _weights_via_func_grad,
                    _weights_via_set_grad_enabled):
        with pytest.raises(AssertionError, match="autograd"):
            check_weights(planted)
    # the run-time watch alone, with no source to read: a lambda built by eval
    hidden = eval("lambda b, n: __import__('torch').func.grad(lambda l: l.sum())(__import__('torch').rand(b)).tolist()")
    with pytest.raises(AssertionError, match="called torch's autograd"):
        check_weights(hidden)


@pytest.mark.timeout(120)
def test_00_check_says_why_the_weights_differ_without_the_all_reduce(tmp_path):
    # step 6 of 00: the learner deletes the all_reduce line and runs the check cell; it fails on
    # the weights with one sentence naming the step and the cause, not a bare tuple
    from types import SimpleNamespace
    from ddp_lesson.launcher import launch

    text = FIRST_RUN.read_text()
    line = next(l for l in text.splitlines(keepends=True) if "dist.all_reduce(p.grad)" in l)
    planted = tmp_path / "first_run.py"
    planted.write_text(text.replace(line, "").replace("LR = 0.1 ", "LR = 0.3 "))
    run = launch.start(planted, nproc=2, cpu=True, run_dir=tmp_path / "run")
    try:
        result = run.wait(timeout=90)
    finally:
        run.stop()
    check = next(source(c) for c in cells("00_start_here.ipynb") if c.get("id") == "cc6125a4")
    ns = {"print": lambda *a, **k: None, "panel": SimpleNamespace(run_dir=run.run_dir), "result": result}
    exec("from pathlib import Path\nimport torch\nfrom torch import nn\n", ns)
    with pytest.raises(AssertionError) as failed:
        exec(check, ns)
    message = str(failed.value)
    assert message.startswith("the ranks' weights differ at step 0: without the all_reduce each rank trains "
                              "on its own shard only (rank 0: ["), message
    assert "; rank 1: [" in message and len(message) < 300, message


def test_first_run_shows_the_averaging_and_no_ddp_yet():
    text = FIRST_RUN.read_text()
    assert text.count("dist.all_reduce(") == 1 and "/= world" in text
    assert not any(use in text for use in ("DistributedDataParallel(", "DDP(", "DistributedSampler("))
    assert any(line.startswith("LR = ") and "EDIT ME" in line for line in text.splitlines())
    assert len(load_script(FIRST_RUN).make_data()[0]) % math.lcm(*range(1, 9)) == 0  # even shards, 1-8 ranks


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_where_this_comes_from_is_a_fold(name):
    # the torch source table stays, folded: a learner on the lesson path skips it
    folds = [source(c) for c in cells(name) if c["cell_type"] == "markdown"
             and source(c).startswith("<details><summary>Where this comes from: ")]
    assert len(folds) == 1 and "| statement | file | function |" in folds[0] and "torch 2." in folds[0]
    assert not any(source(c).startswith("## Where this comes from") for c in cells(name))


def test_00_fast_path_first_and_no_ddp_before_03():
    c = cells("00_start_here.ipynb")
    top = source(c[0])
    assert "[glossary](../docs/glossary.md)" in top and "Fast path" in top
    code = [source(x) for x in c if x["cell_type"] == "code"]
    first_panel = next(i for i, t in enumerate(code) if "RunPanel(" in t)
    assert "work/first_run.py" in code[first_panel] and first_panel <= 8   # within the first cells
    assert sum("RunPanel(" in t for t in code) == 1                         # one launch from a panel
    assert not any(use in t for t in code for use in ("DistributedDataParallel(", "DDP(", "DistributedSampler("))
    headings = [source(x).split("\n")[0] for x in c if x["cell_type"] == "markdown"]
    assert "## Credits" in headings
    assert any(h.startswith("<details><summary>Where this comes from: ") for h in headings)   # a fold a learner skips
    assert not any("Where the course comes from" in h for h in headings)


GLOSSARY_TERMS = ["agent", "all-reduce", "backend", "bucket", "collective", "DataParallel", "DDP",
                  "device picker", "DistributedSampler", "gloo", "global batch", "gradient accumulation",
                  "Join", "live world", "local rank", "micro-batch", "nccl", "no_sync", "node",
                  "process group", "process tree", "rank", "rendezvous", "run directory", "run panel",
                  "set_epoch", "store", "SyncBatchNorm", "torchrun", "world size"]


def test_glossary_alphabetical_complete_and_linked():
    text = (ROOT / "docs" / "glossary.md").read_text()
    entries = re.findall(r"^\*\*(.+?)\*\* · (.+?)(?=^\*\*|\Z)", text, flags=re.M | re.S)
    names = [n.strip("`") for n, _ in entries]
    assert names == sorted(names, key=lambda n: re.sub(r"[^a-z ]", "", n.lower())), names
    assert set(GLOSSARY_TERMS) <= set(names), set(GLOSSARY_TERMS) - set(names)
    for name, body in entries:
        links = re.findall(r"\]\(\.\./notebooks/([^)]+)\)", body)
        assert links, name                                                     # says where it is taught
        assert all((ROOT / "notebooks" / link).exists() for link in links), (name, links)
        # "[00](...), sections 1 and 3" / "section 1 and appendix B": each named part exists there
        for link, where in re.findall(r"\]\(\.\./notebooks/([^)]+)\),? ((?:(?:sections?|appendix) [0-9A-Z]+(?:,| and| or)? ?)+)", body):
            headings = [line for cell in json.loads((ROOT / "notebooks" / link).read_text())["cells"]
                        if cell["cell_type"] == "markdown" for line in "".join(cell["source"]).splitlines()
                        if line.startswith("#")]
            for kind, number in re.findall(r"(section|appendix)s? ((?:[0-9A-Z]+(?:,| and| or)? ?)+)", where):
                for n in re.findall(r"[0-9A-Z]+", number):
                    pattern = rf"^##+ {n}(\.| ·) " if kind == "section" else rf"^###+ {n}\. "
                    assert any(re.match(pattern, h) for h in headings), (name, link, kind, n)
    assert "per-rank batch × world size × accumulation steps" in text and "effective batch" not in text


# -- 02: loss averaging ----------------------------------------------------------------------

PER_SAMPLE = torch.tensor([0.3, 0.2, 0.8])


class MeanLoss(nn.Module):
    def forward(self, losses):
        return losses.mean()


class SumAndCount(nn.Module):
    def forward(self, losses):
        return {"sum": losses.sum().view(1), "count": torch.tensor([float(len(losses))])}


def dp(module, n):
    return simulate.DataParallel(module, device_ids=list(range(n)))


def test_common_loss_averaging_mistake_exactly():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = {n: dp(MeanLoss(), n)(PER_SAMPLE) for n in (1, 2, 3)}
    assert round(results[1].mean().item(), 3) == 0.433
    assert [round(v, 3) for v in results[2].tolist()] == [0.25, 0.8]
    assert round(results[2].mean().item(), 3) == 0.525
    assert round(results[3].mean().item(), 3) == 0.433


@pytest.mark.parametrize("batch", [3, 5, 7, 13])
def test_sum_then_divide_does_not_depend_on_device_count(batch):
    torch.manual_seed(batch)
    losses = PER_SAMPLE if batch == 3 else torch.rand(batch)
    values = []
    for n in range(1, 9):
        out = dp(SumAndCount(), n)(losses)
        values.append((out["sum"].sum() / out["count"].sum()).item())
    assert max(values) - min(values) < 1e-6
    assert math.isclose(values[0], losses.mean().item(), rel_tol=1e-6)


def _mean_of_means_weights(batch, n_devices):
    # 02's exercise solution: k chunks of DP's sizes, a sample in a chunk of c weighs 1 / (k * c)
    size = -(-batch // n_devices)
    chunks = [min(size, batch - start) for start in range(0, batch, size)]
    return [1 / (len(chunks) * c) for c in chunks for _ in range(c)]


@pytest.mark.parametrize("batch,n", [(3, 2), (5, 4), (6, 4), (7, 3), (1, 8), (24, 8)])
def test_mean_of_means_weights_match_autograd(batch, n):
    losses = torch.rand(batch, dtype=torch.float64, requires_grad=True)
    torch.stack([c.mean() for c in losses.chunk(n)]).mean().backward()
    assert torch.allclose(torch.tensor(_mean_of_means_weights(batch, n), dtype=torch.float64), losses.grad)
    if batch == 5 and n == 4:       # an idle device: dividing by n_devices instead of 3 chunks is wrong
        assert not math.isclose(losses.grad[-1].item(), 1 / (n * 1))


def test_02_uses_no_ddp_before_notebook_03():
    # DDP, its sampler and torch.distributed are introduced in 03; their averaging is 03c's
    nb = cells("02_loss_averaging.ipynb")
    code = "".join(source(c) for c in nb if c["cell_type"] == "code")
    prose = "".join(source(c) for c in nb[:-1] if c["cell_type"] == "markdown")   # the Next link aside
    for word in ("DistributedDataParallel", "DDP(", "DistributedSampler", "torch.distributed", "dist.",
                 "set_epoch", "Join", "%%writefile", "RunPanel", "all_reduce"):
        assert word not in code and word not in prose, word
    assert "03_ddp_torchrun.ipynb" in source(cells("02_loss_averaging.ipynb")[-1])   # Next: 03


# -- 01: DataParallel claims that need no GPU ---------------------------------------------------

def test_dp_state_dict_prefix_and_optimizer_wrapping():
    wrapped = nn.DataParallel(nn.Linear(10, 1))
    assert all(k.startswith("module.") for k in wrapped.state_dict())
    with pytest.raises(RuntimeError):
        nn.Linear(10, 1).load_state_dict(wrapped.state_dict())
    nn.Linear(10, 1).load_state_dict({k.removeprefix("module."): v.cpu() for k, v in wrapped.state_dict().items()})
    if torch.cuda.device_count() == 1:
        pytest.skip("on a 1-GPU machine nn.DataParallel(optimizer) fails at construction")
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    wrapped_opt = nn.DataParallel(opt)
    assert wrapped_opt.module is opt and len(wrapped_opt.state_dict()) == 0
    with pytest.raises(AttributeError):
        wrapped_opt.step()


@pytest.mark.parametrize("batch,devices", [(5, 4), (6, 4), (3, 2), (1, 2)])
def test_dp_chunk_sizes_solution(batch, devices):
    size = -(-batch // devices)
    expected = [min(size, batch - start) for start in range(0, batch, size)]
    assert expected == [len(c) for c in torch.empty(batch).chunk(devices)]


# -- form: lesson first, fine print folded -----------------------------------------------------



def _run_cells(notebook, ids, line, planted=None, prelude="", extra=None):
    """Run a notebook's cells `ids` in order in one namespace (prints silenced), `extra` added
    before the last; `line` must be in one of them, and is replaced there by `planted` if given."""
    by_id = {c.get("id"): source(c) for c in cells(notebook)}
    texts = [by_id[i] for i in ids]
    assert sum(line in t for t in texts) == 1
    if planted:
        texts = [t.replace(line, planted) for t in texts]
    ns = {"print": lambda *a, **k: None}
    exec(prelude, ns)
    for text in texts[:-1]:
        exec(text, ns)
    ns.update(extra or {})
    exec(texts[-1], ns)
    return ns


def _run_02_weights_cell(planted=None):
    "02's cells up to the weights picture, with sum_then_divide's last line replaced by `planted`."
    return _run_cells("02_loss_averaging.ipynb", ["dbecf065", "6b116ce2", "d17e063d", "1f3aea3a"],
                      'return out["sum"].sum() / out["count"].sum()', planted, extra={"show": lambda fig: None})


def test_02_sum_then_divide_weights_come_from_the_fix_itself():
    assert torch.allclose(_run_02_weights_cell()["w_fix"], torch.full((3,), 1 / 3, dtype=torch.float64))
    # the fix's own mistakes make the weights check fail: a mean of the devices' means, a count of devices
    for planted in ('return (out["sum"] / out["count"]).mean()', 'return out["sum"].sum() / len(out["count"])'):
        with pytest.raises(AssertionError):
            _run_02_weights_cell(planted)


def _run_01_wrapped_optimizer_cell(planted=None):
    "01's wrapped-optimizer cell; `planted` replaces what net_b steps through."
    return _run_cells("01_data_parallel.ipynb", ["a5c0ccc9"], "(net_b, wrapped_opt.module)", planted,
                      prelude="import copy, torch\nimport torch.nn.functional as F\nfrom torch import nn\n")


def test_01_wrapped_optimizer_cell_steps_through_the_wrapper():
    if torch.cuda.device_count() == 1:
        pytest.skip("on a 1-GPU machine nn.DataParallel(optimizer) fails at construction")
    assert _run_01_wrapped_optimizer_cell()["wrapped_opt"] is not None
    # a wrapper holding a copy of the optimizer would step other tensors: the check sees it
    with pytest.raises(AssertionError):
        _run_01_wrapped_optimizer_cell("(net_b, copy.deepcopy(wrapped_opt.module))")


@pytest.mark.timeout(200)
def test_00_doctor_keeps_a_failed_smoke_run_and_shows_the_failing_rank(tmp_path, monkeypatch):
    # 00 appendix C: doctor's smoke test failed once with only "Rank 1 failed first", and its run
    # folder was deleted. Planted: rank 1 raises; doctor must keep the folder and show the traceback.
    import io
    import shutil
    from ddp_lesson.launcher import doctor
    planted = tmp_path / "allreduce_check.py"
    planted.write_text("import os\nif os.environ['RANK'] == '1':\n"
                       "    raise RuntimeError('planted failure on rank 1')\n")
    monkeypatch.setattr(doctor, "script", lambda name: planted)
    out = io.StringIO()
    assert doctor.check_allreduce(out) == ["fail"]
    text = out.getvalue()
    kept = re.search(r"its files are kept in (\S+)\)", text)
    assert kept and Path(kept.group(1)).is_dir(), text
    try:
        assert "Rank 1 failed first" in text and "planted failure on rank 1" in text, text
        assert all(line.startswith(("fail", " ")) for line in text.splitlines()), text   # details indented
    finally:
        shutil.rmtree(Path(kept.group(1)).parent, ignore_errors=True)
