"""Notebooks 03-05: what their cells do not already check.

The notebooks run under nbval at 2 ranks and again at 3 (CI), and assert every claim of
their check scripts and lesson scripts on those runs, so no test here launches them again:
- DDP's all-reduce leaves the mean of the ranks' own gradients, not their sum, on every rank
  (ddp_equivalence.py): 03b cell 03b-allreduce;
- DDP equals one process every step, DDP(...) broadcasts rank 0's weights, set_epoch and
  disjoint shards (ddp_equivalence.py): 03b cell 03-13 (03b runs its three check scripts in
  one launch, checks_03b.py); set_epoch on real samplers at the run's world size: 03 cell 03-10;
- find_unused_parameters' error (find_unused.py): 03b cell 03-15;
- which parameters land in which bucket, one bucket in the first backward (ddp_checks.py):
  03b cell 03b-buckets;
- the bucket timeline, overlap, buffers, map_location (ddp_checks.py): 03b cell 03b-timeline
  (and tests/test_world_size.py at 3 ranks); here that cell meets planted wrong results;
- the exercise's solution cell leaves the learner's `passed` alone: 03 cell 03-ex5;
The pictures of those cells are tested in tests/test_diagrams_collectives.py.
- SyncBN equals BN over the concatenated batch (syncbn_stats.py): 04 cell 04-08; the
  per-rank vs SyncBN statistics it draws: 04 cell 04-pic2;
- accumulation exact without BN and not with it, one all-reduce per step with no_sync, the
  same weights (accum_nosync.py): 05 cell 05-10; the accumulation windows of ddp_accum.py's
  own loop (its `accumulate`), measured: 05 cell 05-15, and here the same check against
  planted wrong loops, at one rank;
- the lesson scripts train, log per rank and save model.pt: ddp_basic.py 03 cells 03-06 and
  03-08, ddp_syncbn.py 04 cell 04-11, ddp_accum.py with a partial window 05 cell 05-07.
What stays: the scripts' source (small diffs, every DDP line shown), argparse, the one launcher
variant 03 does not run, the single-process starting script (and its early loss climb at 03's lr,
which 03 says is not DDP's doing), the numbers 03b's lr section relates to 03's run, the CPU
SyncBN stand-in, and syncbn_stats.py's copy of ddp_syncbn.py's loop (at one rank, in one plain
process)."""
import difflib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_lesson.launcher import launch
from ddp_lesson.notebook import syncbn_compare
from ddp_lesson.rank.bundled import script

REPO = Path(__file__).resolve().parent.parent

ROOT_NB = Path(__file__).resolve().parent.parent / "notebooks"
TINY = ["--epochs", "1", "--train-samples", "256", "--batch-size", "16"]


def test_sync_bn_flag_takes_no_value():
    # a common mistake is type=bool, where `--sync-bn False` means True
    out = subprocess.run([sys.executable, str(script("ddp_syncbn.py")), "--sync-bn", "False"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unrecognized arguments: False" in out.stderr, out.stderr


# ddp_syncbn.py: 15 lines, 3 of them the `# DDP` fallback that refuses --sync-bn on CPU ranks without the course
@pytest.mark.parametrize("old,new,max_changed", [("ddp_basic.py", "ddp_syncbn.py", 15),
                                                 ("ddp_syncbn.py", "ddp_accum.py", 40)])
def test_each_lesson_script_is_a_small_diff(old, new, max_changed):
    from ddp_lesson.notebook import lesson
    a, b = script(old).read_text().splitlines(), script(new).read_text().splitlines()
    changed = [l for l in lesson.unified_diff(a, b, old, new, 0)
               if l[:1] in "+-" and not l.startswith(("+++", "---"))]
    assert 0 < len(changed) <= max_changed, "\n".join(changed)


def test_show_diff_matches_lines_as_difflib_does_without_its_autojunk():
    # difflib's own unified_diff, but from 200 lines of the new file on, where its autojunk would
    # take the blank lines for junk and show unchanged ones as changed (ddp_accum.py has 200 lines)
    import random

    from ddp_lesson.notebook import lesson
    rng = random.Random(0)
    for _ in range(500):
        a = [rng.choice("abcde") for _ in range(rng.randint(0, 12))]
        b = [rng.choice("abcde") for _ in range(rng.randint(0, 12))]
        for n in (0, 1, 3):
            assert lesson.unified_diff(a, b, "x", "y", n) == list(difflib.unified_diff(a, b, "x", "y", lineterm="", n=n))
    a, b = script("ddp_syncbn.py").read_text().splitlines(), script("ddp_accum.py").read_text().splitlines()
    assert len(b) >= 200
    ours, theirs = (changed(d) for d in (lesson.unified_diff(a, b, "a", "b", 0),
                                         difflib.unified_diff(a, b, "a", "b", lineterm="", n=0)))
    assert len(ours) < len(theirs) and "-" in theirs and "-" not in ours   # a blank line, taken for junk


@pytest.mark.parametrize("name", ["ddp_basic.py", "ddp_syncbn.py", "ddp_accum.py"])
def test_lesson_scripts_show_every_ddp_line(name):
    # the one deliberate source test: the lesson is these lines, written out in the script
    src = script(name).read_text()
    for needle in ("init_process_group", '"nccl" if use_cuda else "gloo"', 'os.environ["RANK"]',
                   'os.environ["LOCAL_RANK"]', 'os.environ["WORLD_SIZE"]', "MASTER_ADDR", "MASTER_PORT",
                   "set_device", "DistributedSampler", "set_epoch", "DDP(", "model.module.state_dict()",
                   "barrier()", "map_location", "destroy_process_group", "metrics.log(", "if rank == 0"):
        assert needle in src, f"{name} lacks {needle}"


def test_launch_use_env_variant():
    # notebook 03 runs the three launchers at 2 ranks (started in cell 03-01, read in 03-20); --use-env is the one it leaves out
    variants = script("launch_variants")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.launch", "--nproc-per-node", "2",
                          "--master-port", str(launch.free_port()), "--use-env",
                          str(variants / "hello_launch.py")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("sum 2") == 2, out.stdout
    assert "from the environment" in out.stdout      # --use-env: LOCAL_RANK in the env
    assert "deprecated" in out.stderr


def test_convert_sync_batchnorm_follows_where_the_model_lives(monkeypatch):
    import torch
    from ddp_lesson.rank import models, syncbn
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # a GPU machine, CPU ranks
    model = syncbn.convert_sync_batchnorm(models.SmallCNN())
    kinds = {type(m) for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    assert kinds == {syncbn.CPUSyncBatchNorm}


def test_single_process_script_trains_and_counts_every_test_sample(tmp_path):
    # notebook 03's diff starts from this script: it must run as it is, in one plain process
    env = dict(os.environ, DDP_LESSON_RUN_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(REPO))
    (tmp_path / "metrics").mkdir()
    out = subprocess.run([sys.executable, str(script("train_single.py")), *TINY], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "test accuracy" in out.stdout and (tmp_path / "model.pt").exists()


def test_single_to_ddp_diff_is_the_ddp_lines():
    a = script("train_single.py").read_text().splitlines()
    b = script("ddp_basic.py").read_text().splitlines()
    diff = [l for l in difflib.unified_diff(a, b, lineterm="", n=0) if not l.startswith(("+++", "---"))]
    added = "\n".join(l for l in diff if l.startswith("+"))
    removed = "\n".join(l for l in diff if l.startswith("-"))
    for needle in ("init_process_group", "DistributedSampler(", "DDP(model", "set_epoch", "barrier()",
                   "destroy_process_group", "dist.all_reduce(counts)", "@record", "if rank == 0"):
        assert needle in added and needle not in removed, needle
    assert "shuffle=True" in removed          # the sampler shuffles instead of the loader
    # the DDP lines, the course's `# course` lines, and the docstring
    assert sum(l[:1] in "+-" for l in diff) <= 84


LESSON_DIFFS = (("train_single.py", "ddp_basic.py"), ("ddp_basic.py", "ddp_syncbn.py"),
                ("ddp_syncbn.py", "ddp_accum.py"))   # the diffs notebooks 03, 04 and 05 show


def changed(diff):
    return [l for l in diff if l[:1] in "+-" and l[:3] not in ("+++", "---")]


@pytest.mark.parametrize("old,new", LESSON_DIFFS)
def test_course_false_hides_exactly_the_course_lines_and_no_ddp_line(old, new):
    from ddp_lesson.notebook import lesson
    full = changed(lesson.script_diff(old, script(new), context=0))
    shown = changed(lesson.script_diff(old, script(new), context=0, course=False))
    hidden = [l for l in full if l not in shown]
    assert all(lesson.course_line(l) for l in hidden)                   # only `# course` lines go ...
    assert not any(lesson.course_line(l) for l in shown)                # ... and all of them
    assert not any("# DDP" in l for l in hidden)                        # no DDP line is hidden
    assert [l for l in full if "# DDP" in l] == [l for l in shown if "# DDP" in l]
    for name in (old, new):                                             # a `# course` line is never DDP
        assert not any(lesson.course_line(l) and "# DDP" in l for l in script(name).read_text().splitlines())


def test_course_marker_is_a_comment_not_a_mention():
    from ddp_lesson.notebook import lesson
    for line in ("    timer = metrics.StepTimer(model)  # course", "    # course: the StepTimer times",
                 "    row.update(timer.lap())  # course: + data_s"):
        assert lesson.course_line(line), line
    for line in ("Lines marked # course are the course's", "    loss.backward()  # DDP: the course",
                 "    else:  # it refuses CPU tensors; the course's CPU version", "x = 1  # courses"):
        assert not lesson.course_line(line), line


def test_03_diff_without_course_lines_is_only_what_makes_it_distributed(capsys):
    from ddp_lesson.notebook import lesson
    lesson.show_diff("train_single.py", script("ddp_basic.py"), context=0, course=False)
    out = capsys.readouterr().out
    code = "\n".join(l for l in changed(out.splitlines()) if l[1:5] == "    ")   # not the docstring
    for plumbing in ("StepTimer", "slow", "timer", "shard=", "sleep"):
        assert plumbing not in code, plumbing
    ours, hidden = (sum(map(lesson.course_line, script(n).read_text().splitlines())) for n in ("train_single.py", "ddp_basic.py"))
    assert hidden >= 8 and f"left out: {ours} of train_single.py's, {hidden} of ddp_basic.py's" in out
    assert len(changed(out.splitlines())) <= 75      # the DDP lines and the docstring


def test_show_script_without_course_lines_is_the_script_less_exactly_those(capsys):
    # 03 cell 03-diff shows ddp_basic.py this way, open: every other line, DDP ones included, stays
    from ddp_lesson.notebook import lesson
    path = script("ddp_basic.py")
    lines = path.read_text().splitlines()
    lesson.show_script(path, course=False)
    out = capsys.readouterr().out.splitlines()
    hidden = [l for l in lines if lesson.course_line(l)]
    assert out[:len(lines) - len(hidden)] == [l for l in lines if not lesson.course_line(l)]
    assert not any(lesson.course_line(l) for l in out)
    assert sum("# DDP" in l for l in out) == sum("# DDP" in l for l in lines) >= 15
    assert f"left out: {len(hidden)}." in out[-1]
    lesson.show_script(path)                                  # course=True: the file as it is
    assert capsys.readouterr().out.splitlines() == lines


def _folded(monkeypatch, capsys, show, fold):
    """What show(..., fold=fold) displays, checked to be the printed text (show(...) without fold)
    in one closed <details>, escaped; returns the text."""
    import html
    import IPython.display
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append((obj, raw)))
    show()
    printed = capsys.readouterr().out.rstrip("\n")
    show(fold=fold)
    assert capsys.readouterr().out == "" and len(shown) == 1      # displayed, not printed
    (bundle, raw), = shown
    assert raw and bundle["text/plain"] == printed                  # the same text as printed
    page = bundle["text/html"]
    assert page.startswith(f"<details><summary>{html.escape(fold)}</summary><pre>")   # closed: no `open`
    assert page.endswith("</pre></details>") and "<details open" not in page
    assert any(ch in printed for ch in "<>&\"'")                  # text that escaping changes
    assert page[page.index("<pre>") + 5:page.index("</pre>")] == html.escape(printed)   # escaped, exactly
    return printed


def test_show_script_in_a_fold_is_the_same_listing_in_a_closed_details(monkeypatch, capsys):
    import functools
    from ddp_lesson.notebook import lesson
    show = functools.partial(lesson.show_script, script("ddp_basic.py"), course=False)
    printed = _folded(monkeypatch, capsys, show, "the <whole> script")
    assert "left out:" in printed.splitlines()[-1]


def test_show_diff_in_a_fold_is_the_same_diff_in_a_closed_details(monkeypatch, capsys):
    # 03 cell 03-full: the diff from train_single.py, without `# course` lines, behind one click
    import functools
    from ddp_lesson.notebook import lesson
    show = functools.partial(lesson.show_diff, "train_single.py", script("ddp_basic.py"), course=False)
    printed = _folded(monkeypatch, capsys, show, "the <diff> from one process")
    assert printed.startswith("--- train_single.py") and "left out:" in printed.split("\n\n")[-1]
    assert "\n+    dist.barrier()" in printed
    show = functools.partial(lesson.show_diff, "ddp_basic.py", script("ddp_syncbn.py"))   # course=True
    assert "+++" in _folded(monkeypatch, capsys, show, "04's diff")


def _cells03():
    return {c["id"]: c for c in json.loads((ROOT_NB / "03_ddp_torchrun.ipynb").read_text())["cells"]}


DDP_NAME = re.compile(r"\b(rank|local_rank|world_size|dist|DDP|DistributedSampler|sampler|no_sync|syncbn|"
                      r"SyncBatchNorm|record|RANK|LOCAL_RANK|WORLD_SIZE|MASTER_ADDR|MASTER_PORT)\b"
                      r"|\.module\b|os\.environ|barrier|set_device")
COVERING = ("if ", "elif ", "else", "with ")   # a `# DDP` on these covers their block (the docstrings say so)


def ddp_coverage(text):
    """{line number: marked} for each line of code in `text`, a script: marked is True where
    the line is marked `# DDP`, is part of a statement so marked, or is inside the block of an
    `if`/`with` so marked. A comment on the line above does not count; docstrings are left out."""
    import ast
    import io
    import tokenize
    docs = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    logical, current = [], []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER):
            continue
        if tok.type == tokenize.NL and not current:
            continue
        if tok.type == tokenize.COMMENT and not current:   # a comment on a line of its own
            continue
        current.append(tok)
        if tok.type == tokenize.NEWLINE:
            logical.append(current)
            current = []
    lines = text.splitlines()
    out, stack = {}, []          # stack: (indent, covers) of the enclosing block headers
    for toks in logical:
        first, last = toks[0].start[0], toks[-1].start[0]
        if first in docs:
            continue
        indent = len(lines[first - 1]) - len(lines[first - 1].lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        marked = any(t.type == tokenize.COMMENT and t.string.startswith("# DDP") for t in toks)
        covered = marked or any(covers for _, covers in stack)
        for n in range(first, last + 1):
            out[n] = covered
        code = [t for t in toks if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE)]
        if code and code[-1].string == ":":
            stack.append((indent, covered and lines[first - 1].lstrip().startswith(COVERING)))
    return out


def unmarked_ddp_lines(text):
    """The lines of code in `text` that name something distributed and are not marked `# DDP`."""
    from ddp_lesson.notebook import lesson
    lines = text.splitlines()
    return [lines[n - 1] for n, marked in ddp_coverage(text).items()
            if not marked and not lesson.course_line(lines[n - 1])
            and DDP_NAME.search(lines[n - 1].split("  #")[0])]


@pytest.mark.parametrize("name", ["ddp_basic.py", "ddp_syncbn.py", "ddp_accum.py"])
def test_every_line_that_names_something_distributed_is_marked_ddp(name):
    # the docstrings and 03 say it: every line that makes it distributed is marked `# DDP`
    text = script(name).read_text()
    assert unmarked_ddp_lines(text) == []
    for line in ('    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")',
                 "    torch.manual_seed(args.seed + rank)",
                 "    shard = Subset(test_set, range(rank, len(test_set), world_size))",
                 "    if rank == 0:", "import torch.distributed as dist"):
        marked = next(l for l in text.splitlines() if l.startswith(line))
        assert "  # DDP" in marked, marked
        planted = text.replace(marked, line)          # the mark taken off: the check sees it
        assert line in unmarked_ddp_lines(planted), line
    body = '        torch.save(model.module.state_dict(), ckpt)'
    assert body in text and body not in unmarked_ddp_lines(text)          # under a marked `if`
    off = text.replace('    if rank == 0:  # DDP: one writer', '    if rank == 0:  # one writer')
    assert body in unmarked_ddp_lines(off)                                  # ... and not without it
    comment = "    # DDP: every rank needs at least one test batch"
    assert comment in text                             # a `# DDP` comment above a line does not cover it
    bare = text.replace("world_size))  # DDP: each sample once, no padding", "world_size))")
    assert "    shard = Subset(test_set, range(rank, len(test_set), world_size))" in unmarked_ddp_lines(bare)


def test_03_every_line_added_to_the_single_process_script_is_marked_ddp():
    # the diff from train_single.py: each added line of code is marked `# DDP` (or covered by a
    # marked `if`), but for these, which change a comment or a help text, or open the marked set_device
    from ddp_lesson.notebook import lesson
    not_ddp = {'p.add_argument("--batch-size", type=int, default=32, help="per process")',
               "counts = torch.zeros(2, device=device)  # [correct, seen] on this rank",
               "plain.load_state_dict(state)  # loads into a plain model: no DDP needed to use it",
               "if use_cuda:"}
    single = script("train_single.py").read_text().splitlines()
    text = script("ddp_basic.py").read_text()
    coverage = ddp_coverage(text)
    plain = [(n, l) for n, l in enumerate(text.splitlines(), 1) if not lesson.course_line(l)]
    matcher = difflib.SequenceMatcher(a=single, b=[l for _, l in plain], autojunk=False)
    added = [plain[j] for op, _, _, j1, j2 in matcher.get_opcodes() if op in ("replace", "insert")
             for j in range(j1, j2)]
    code = [(n, l) for n, l in added if n in coverage]               # not the docstring, not blank
    assert len(code) >= 30
    unmarked = [l.strip() for n, l in code if not coverage[n]]
    assert [l for l in unmarked if l not in not_ddp] == []
    assert unmarked.count("if use_cuda:") == 1 and "set_device(local_rank)" in text.split("if use_cuda:\n")[1].split("\n")[0]


def test_03_listing_is_the_whole_script_with_every_ddp_line(capsys):
    # 03's main listing is the whole ddp_basic.py, open, without `# course` lines: every `# DDP`
    # line is in it; 03 says how many `# course` lines it hid, and it names nothing met only later
    from ddp_lesson.notebook import lesson
    cells = {k: "".join(c["source"]) for k, c in _cells03().items()}
    call = 'show_script(script("ddp_basic.py"), course=False)'
    assert call in cells["03-diff"] and "fold=" not in cells["03-diff"]
    assert not _cells03()["03-diff"]["metadata"].get("jupyter", {}).get("source_hidden")   # open
    lesson.show_script(script("ddp_basic.py"), course=False)   # as the cell calls it
    out = capsys.readouterr().out.splitlines()
    lines = script("ddp_basic.py").read_text().splitlines()
    plain = [l for l in lines if not lesson.course_line(l)]
    ddp = [l for l in lines if "# DDP" in l]
    assert len(ddp) >= 25 and [l for l in out if "# DDP" in l] == ddp   # every DDP line, in order
    assert not any(lesson.course_line(l) for l in out)
    hidden = len(lines) - len(plain)
    assert hidden >= 8 and f"The listing leaves out the script's {hidden} lines marked `# course`" in cells["03-diff2"]
    assert "The lines marked `# DDP` are everything that makes it distributed" in cells["03-diff2"]
    assert "The training step itself is unchanged" in cells["03-diff2"]
    assert "**Every rank\nneeds at least one test batch**" in cells["03-diff2"]
    for later in ("03b's", "buffer rule", "comm hook", "StepTimer", "timer", "slow", "shard="):
        assert not any(later in l for l in out), later  # nothing the learner meets only later


def test_03_diff_from_one_process_is_right_after_in_a_collapsed_fold(capsys):
    # the diff from train_single.py, the one-process script, in a closed fold of a collapsed
    # cell right after the listing's text: every `# DDP` line is in it as added, none hidden
    from ddp_lesson.notebook import lesson
    ids = list(_cells03())
    cells = {k: "".join(c["source"]) for k, c in _cells03().items()}
    assert ids.index("03-full") == ids.index("03-diff2") + 1 == ids.index("03-diff") + 2
    assert _cells03()["03-full"]["metadata"]["jupyter"]["source_hidden"] is True
    assert 'show_diff("train_single.py", script("ddp_basic.py"), course=False,\n' in cells["03-full"]
    assert "fold=" in cells["03-full"] and "show_script" not in cells["03-full"]
    assert "`+` are what DDP adds" in cells["03-diff2"] and "`-` what it removes" in cells["03-diff2"]
    lesson.show_diff("train_single.py", script("ddp_basic.py"), course=False)   # the fold's text
    out = capsys.readouterr().out.split("\n\n(Lines marked")[0].splitlines()      # the diff, not its footnote
    added = [l[1:] for l in out if l.startswith("+") and not l.startswith("+++")]
    ddp = [l for l in script("ddp_basic.py").read_text().splitlines() if "# DDP" in l]
    assert [l for l in added if "# DDP" in l] == ddp                    # every DDP line, as added
    assert not any(lesson.course_line(l) for l in out)


def test_03_loss_climb_comes_from_the_lr_not_from_ddp(tmp_path):
    # 03 says the loss may climb above its start in the first steps, and that train_single.py,
    # one process without DDP, climbs too at 03's settings (lr 0.05, batch 32): the lr overshoots.
    # At a quarter of that lr the same steps, from the same start, do not climb far.
    from ddp_lesson.launcher import runs
    started = {lr: launch.start(script("train_single.py"), nproc=1, cpu=True, run_dir=tmp_path / str(lr),
                                args=["--epochs", "1", "--batch-size", "32", "--train-samples", "512",
                                      "--lr", str(lr)])
               for lr in (0.05, 0.0125)}
    _all_ok(started, timeout=300)
    loss = {lr: [v for _, v in runs.load(tmp_path / str(lr)).series("loss", rank=0)] for lr in started}
    assert len(loss[0.05]) == 16
    assert max(loss[0.05][:10]) > 1.5 * loss[0.05][0], loss[0.05]          # climbs, without DDP
    assert max(loss[0.0125][:10]) < 1.4 * loss[0.0125][0], loss[0.0125]    # a smaller lr: no far climb
    assert max(loss[0.05][:10]) > 2 * max(loss[0.0125][:10])               # (seed 0: 3.4x and 1.2x its start)
    cells = {k: "".join(c["source"]) for k, c in _cells03().items()}
    panel = cells["03-05"]
    assert '"batch-size": 32' in panel and '"lr": 0.05' in panel            # the settings tested here


def test_03b_relates_its_lr_experiment_to_03s_run():
    # 03b's sentence, in the fold after the experiment (03-18u2): 03's lr 0.05 is half the full
    # linear lr, and at 2 ranks its global batch of 64 is half the experiment's, so the lr per
    # sample is the same
    import re
    nb03 = {k: "".join(c["source"]) for k, c in _cells03().items()}
    nb03b = {c["id"]: "".join(c["source"])
             for c in json.loads((ROOT_NB / "03b_ddp_equals_one_process.ipynb").read_text())["cells"]}
    lr03 = float(re.search(r'"lr": ([0-9.]+)', nb03["03-05"]).group(1))
    batch03 = int(re.search(r'"batch-size": (\d+)', nb03["03-05"]).group(1))
    base_batch, base_lr, per_device, world = eval(
        re.search(r"base_batch, base_lr, per_device, world = (.*)", nb03b["03-17"]).group(1))
    global_b = per_device * world
    lr_linear = base_lr * global_b / base_batch
    assert lr03 == 0.05 and lr_linear == 2 * lr03 and global_b == 2 * (2 * batch03)
    assert lr03 / (2 * batch03) == lr_linear / global_b                       # the same lr per sample
    text = " ".join(nb03b["03-18u2"].split())
    assert "Notebook 03's run used lr 0.05, half this full lr, and at 2 ranks a global batch of 64" in text
    epochs, samples = eval(re.search(r"epochs, samples = ([0-9, ]+)", nb03b["03-17"]).group(1))
    assert epochs * (samples // global_b) == 16 and "64 steps or more, not 16" in text   # 03 takes >= 64
    assert "max(s for s, _ in rec.series(\"loss\", rank=0)) >= 64" in nb03["03-06"]


def test_03b_buffer_rule_is_short_in_the_lesson_and_exact_in_its_fold():
    # other notebooks point to "03b's buffer rule": a bold lead in 03b's lesson text, the rule in
    # at most three sentences after it; the exact table follows in the fold right below
    import importlib.util
    import re
    spec = importlib.util.spec_from_file_location("prose", REPO / "tools" / "prose.py")
    prose = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prose)
    cells = json.loads((ROOT_NB / "03b_ddp_equals_one_process.ipynb").read_text())["cells"]
    i = next(i for i, c in enumerate(cells) if "**The buffer rule.**" in "".join(c["source"]))
    lesson = "".join(cells[i]["source"])
    assert not lesson.startswith("<details>")                       # on the main thread
    paragraph = lesson[lesson.index("**The buffer rule.**"):].split("\n\n")[0]
    rule = prose.sentences(prose.lesson_text(paragraph))
    assert rule[0] == "**The buffer rule." and len(rule[1:]) <= 3, rule    # the measure splits off the lead
    assert "**Buffers**" in paragraph and "collective" in paragraph
    assert "every rank must run the same forwards, the evaluation included" in " ".join(paragraph.split())
    fold = "".join(cells[i + 1]["source"])
    assert fold.startswith("<details><summary>Under the hood: the exact buffer rule")
    rows = re.findall(r"^\| ([^|]+) \| (yes|no) \|$", fold, flags=re.M)
    assert [(w.strip(), v) for w, v in rows] == [("none: this is the first forward", "yes"),
                                                 ("a forward with gradients on", "yes"),
                                                 ("a forward under `torch.no_grad()`", "no")], rows
    for name in ("_check_sync_bufs_pre_fwd", "_check_sync_bufs_post_fwd", "require_forward_param_sync",
                 "no_sync()"):
        assert name in fold, name


def _all_ok(started, timeout):
    """Wait for every run of {name: run} to end ok (its stderr tail if not); stop them all anyway."""
    from ddp_lesson.launcher import runs
    try:
        for name, run in started.items():
            result = run.wait(timeout=timeout)
            assert result and result["status"] == "ok", (name, result, runs.log_tail(run.run_dir, 0, 30, "stderr"))
    finally:
        for run in started.values():
            run.stop()


def test_ddp_basic_without_its_course_lines_trains_the_same(tmp_path, monkeypatch):
    # its docstring and 03 say the `# course` lines are not needed: without them the script runs
    # and ends with the same weights, bit for bit (the StepTimer only watches). It then saves
    # model.pt in the folder it runs in, as under plain torchrun, not in its run folder.
    import torch
    from ddp_lesson.launcher import runs
    from ddp_lesson.notebook import lesson
    full = script("ddp_basic.py")
    plain = tmp_path / "plain.py"
    plain.write_text("\n".join(l for l in full.read_text().splitlines() if not lesson.course_line(l)) + "\n")
    monkeypatch.chdir(tmp_path)   # the ranks' folder
    started = {name: launch.start(path, nproc=2, cpu=True, run_dir=tmp_path / name, args=TINY)
               for name, path in (("full", full), ("plain", plain))}
    _all_ok(started, timeout=300)
    rows = {name: runs.load(tmp_path / name).rows for name in started}
    assert any("compute_s" in r for r in rows["full"]) and not any("compute_s" in r for r in rows["plain"])
    assert any("shard" in r for r in rows["full"]) and not any("shard" in r for r in rows["plain"])
    weights = {name: torch.load(where, weights_only=True)
               for name, where in (("full", tmp_path / "full" / "model.pt"), ("plain", tmp_path / "model.pt"))}
    assert weights["full"].keys() == weights["plain"].keys()
    diff = max((weights["full"][k].float() - weights["plain"][k].float()).abs().max().item() for k in weights["full"])
    assert diff == 0, diff


def test_course_false_counts_both_scripts_hidden_lines_and_the_ones_gone(capsys, tmp_path):
    # 05's diff must not hide silently that ddp_accum.py dropped ddp_syncbn.py's straggler lines
    from ddp_lesson.notebook import lesson
    old = script("ddp_syncbn.py").read_text()
    mine = tmp_path / "mine.py"
    kept = [l for l in old.splitlines() if "slow" not in l]      # drops course lines, no DDP line
    mine.write_text("\n".join(kept) + "\n")
    n_old = sum(map(lesson.course_line, old.splitlines()))
    n_new = sum(map(lesson.course_line, kept))
    assert 0 < n_new < n_old
    lesson.show_diff("ddp_syncbn.py", mine, course=False)
    out = capsys.readouterr().out
    assert f"left out: {n_old} of ddp_syncbn.py's, {n_new} of mine.py's." in out, out
    gone = [l.strip() for l in old.splitlines() if "slow" in l and lesson.course_line(l)]
    named = f"These {n_old - n_new} `# course` lines of ddp_syncbn.py are not in mine.py:\n"
    assert named + "\n".join("    " + l for l in gone) in out, out   # each dropped line, by name
    lesson.show_diff("ddp_syncbn.py", script("ddp_syncbn.py"), course=False)
    assert "are not in" not in capsys.readouterr().out           # the same script: nothing gone
    lesson.show_diff("ddp_basic.py", script("ddp_syncbn.py"), course=False)
    assert "not in" not in capsys.readouterr().out               # 04's diff: ddp_syncbn.py keeps them all


def test_04_and_05_say_what_their_diffs_hide(capsys):
    # 04's diff shows the SyncBN import as a `# DDP` line and drops no `# course` line; 05's names
    # the three it drops, as 05 says
    from ddp_lesson.notebook import lesson

    def text(name, cell):
        cells = json.loads((ROOT_NB / name).read_text())["cells"]
        return " ".join("".join(next(c for c in cells if c["id"] == cell)["source"]).split())
    lesson.show_diff("ddp_basic.py", script("ddp_syncbn.py"), course=False)
    out = capsys.readouterr().out
    assert "\n+    from ddp_lesson.rank import syncbn  # DDP\n" in out and "are not in" not in out
    assert "The diff shows its import, marked `# DDP`, in a `try`." in text("04_sync_batchnorm.ipynb", "04-02")
    lesson.show_diff("ddp_syncbn.py", script("ddp_accum.py"), course=False)
    gone = capsys.readouterr().out.split("are not in ddp_accum.py:\n")[1].splitlines()
    assert len(gone) == 3 and all("slow" in line for line in gone), gone
    assert "Its footnote names the three that `ddp_accum.py` drops" in text("05_gradient_accumulation.ipynb", "05-02")


def test_cpu_syncbn_stand_in_keeps_every_bn_shape_in_eval():
    # it replaces BatchNorm1d/2d/3d alike: eval() must still accept their 2D..5D inputs
    import torch
    from ddp_lesson.rank import syncbn
    for bn, x in ((torch.nn.BatchNorm1d(4), torch.randn(5, 4)), (torch.nn.BatchNorm1d(4), torch.randn(5, 4, 3)),
                  (torch.nn.BatchNorm2d(4), torch.randn(2, 4, 3, 3)), (torch.nn.BatchNorm3d(4), torch.randn(2, 4, 2, 2, 2))):
        model = syncbn.convert_sync_batchnorm(torch.nn.Sequential(bn)).eval()
        assert isinstance(model[0], syncbn.CPUSyncBatchNorm)
        assert model(x).shape == x.shape


def test_cpu_syncbn_trains_without_running_stats_and_without_a_warning():
    """A BN layer with track_running_stats=False trains (nn.SyncBatchNorm handles it too), and
    the stand-in's all-reduce warns nothing (torch.distributed.nn.functional's warns
    FutureWarning in torch 2.x). One gloo rank in this process; 04 runs the 2-rank case."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch import nn

    from ddp_lesson.rank import syncbn
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for track in (True, False):
            model = syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3, track_running_stats=track)))
            ref = nn.BatchNorm2d(3, track_running_stats=track)
            x = torch.randn(4, 3, 5, 5, requires_grad=True)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                model(x).pow(2).sum().backward()
            grad, x.grad = x.grad, None
            ref(x).pow(2).sum().backward()
            assert torch.allclose(grad, x.grad, atol=1e-4)
    finally:
        dist.destroy_process_group()


PIN_SYNCBN_COPY = r"""
import json, os, sys, tempfile
import torch, torch.distributed as dist
sys.path[:0] = sys.argv[1].split(os.pathsep)   # the lesson script's folder and the check's
import ddp_syncbn, syncbn_stats
opts = sys.argv[2:]
sys.argv = ["ddp_syncbn.py", *opts]
ddp_syncbn.main()                                   # the reference script, one rank, plain BN
sys.argv = ["syncbn_stats.py", *opts]
args = syncbn_stats.parse_args()
store = os.path.join(os.environ["DDP_LESSON_RUN_DIR"], "store")
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
print(json.dumps(syncbn_stats.reference_runs(args, 0, 1, torch.device("cpu"), None)))
dist.destroy_process_group()
"""


def test_syncbn_stats_reference_runs_copy_ddp_syncbn_loop(tmp_path):
    # Notebook 04 compares ddp_syncbn.py --sync-bn with two runs of syncbn_stats.train, a copy
    # of ddp_syncbn.py's loop. One plain process (no torchrun; the notebook runs 2 and 3 ranks):
    # at one rank all three see the same batches, so a copy with another seed, lr, warm-up,
    # sampler or evaluation than the reference script differs here, step by step.
    opts = ["--epochs", "2", "--batch-size", "8", "--lr", "0.07", "--warmup-steps", "3",
            "--train-samples", "96", "--seed", "3"]
    env = dict(os.environ, DDP_LESSON_RUN_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES="",
               RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(launch.free_port()), PYTHONPATH=str(REPO))
    folders = os.pathsep.join(str(script(name).parent) for name in ("ddp_syncbn.py", "syncbn_stats.py"))
    out = subprocess.run([sys.executable, "-c", PIN_SYNCBN_COPY, folders, *opts], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    ref = json.loads(out.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (tmp_path / "metrics" / "rank0.jsonl").read_text().splitlines()]
    loss = [r["loss"] for r in rows if "loss" in r]
    accuracy = [r["test_accuracy"] for r in rows if "test_accuracy" in r]
    assert len(loss) == 2 * 96 // 8
    for name, run in ref.items():
        assert len(run["loss"]) == len(loss), name
        assert max(abs(a - b) for a, b in zip(run["loss"], loss)) < 1e-5, name
        assert run["test_accuracy"] == pytest.approx(accuracy, abs=1e-6), name


def loop_problems(win):
    """Notebook 05 cell 05-15's checks of a measured accumulation loop: what is wrong, if anything."""
    n, k = win["n"], win["k"]
    last = [(i + 1) % k == 0 or i + 1 == n for i in range(n)]
    problems = []
    for rows, steps in zip(win["rows"], win["steps"]):
        if [r["all_reduces"] > 0 for r in rows] != last:
            problems.append("all-reduces")
        if [s["micro_batches"] for s in steps] != [4, 4, 2]:
            problems.append("windows")
        if any(s["grad_rel_err"] > 1e-4 for s in steps):
            problems.append("gradient")
    if win["weights_spread"] > 1e-6:
        problems.append("ranks apart")
    return problems


PLANTED_LOOPS = {   # a wrong edit of ddp_accum.py's loop -> what the check must notice
    "no_sync around backward only": (
        """        with contextlib.nullcontext() if last else model.no_sync():  # DDP
            out = model(x)
            loss = F.cross_entropy(out, y)
            (loss / window).backward()""",
        """        out = model(x)
        loss = F.cross_entropy(out, y)
        with contextlib.nullcontext() if last else model.no_sync():  # DDP
            (loss / window).backward()""", "all-reduces"),
    "no no_sync": ("with contextlib.nullcontext() if last else model.no_sync():",
                   "with contextlib.nullcontext():", "all-reduces"),
    "no_sync on the last only": ("with contextlib.nullcontext() if last else model.no_sync():",
                                 "with model.no_sync() if last else contextlib.nullcontext():", "all-reduces"),
    "zero_grad every micro-batch": ("        window = min(", "        opt.zero_grad()\n        window = min(",
                                    "gradient"),
    "no zero_grad": ("        opt.zero_grad(set_to_none=True)\n", "", "gradient"),
    "divided by k": ("(loss / window).backward()", "(loss / k).backward()", "gradient"),
    "a step every micro-batch": ("        if not last:\n            continue\n", "", "windows"),
}


def loop_from(source):
    namespace = {"__name__": "ddp_accum_planted"}
    exec(compile(source, "ddp_accum_planted.py", "exec"), namespace)
    return namespace["accumulate"]


def test_window_rows_and_first_bn_picture_at_one_rank(monkeypatch):
    """The numbers notebooks 04 and 05 draw (diagrams.bn_statistics, accumulation_windows),
    at one gloo rank in this process; the notebooks assert them at 2 and 3 ranks. The
    accumulation check runs ddp_accum.py's own loop: each planted wrong loop must fail it."""
    import argparse

    import torch
    import torch.distributed as dist

    from ddp_lesson.rank import models
    monkeypatch.syspath_prepend(str(script("accum_nosync.py").parent))
    import accum_nosync
    import syncbn_stats
    source = script("ddp_accum.py").read_text()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        base = models.SmallCNN(norm=False)
        win = accum_nosync.window_rows(base, loop_from(source), n=10, k=4)
        rows = win["rows"][0]
        assert [r["window"] for r in rows] == [4] * 8 + [2] * 2
        assert [r["step"] for r in rows] == [1] * 4 + [2] * 4 + [3] * 2
        assert [r["all_reduces"] > 0 for r in rows] == [i in (4, 8, 10) for i in range(1, 11)]
        assert [s["divided_by"] for s in win["steps"][0]] == [4, 4, 2]
        assert loop_problems(win) == []
        for name, (old, new, problem) in PLANTED_LOOPS.items():
            assert source.count(old) == 1, name
            planted = accum_nosync.window_rows(base, loop_from(source.replace(old, new)), n=10, k=4)
            assert problem in loop_problems(planted), (name, loop_problems(planted))
        divided = accum_nosync.window_rows(base, loop_from(source.replace(*PLANTED_LOOPS["divided by k"][:2])), n=10, k=4)
        assert [s["divided_by"] for s in divided["steps"][0]] == [4, 4, 4]
        args = argparse.Namespace(seed=0, train_samples=64, batch_size=4)
        pic = syncbn_stats.first_bn_picture(args, torch.device("cpu"))
        values = torch.tensor(pic["values"], dtype=torch.float64)
        assert len(values) == 4 * 16 * 16                         # 4 images of 16x16, one channel
        for stats in (pic["rank_stats"], pic["sync_stats"]):     # one rank: both are its own batch's
            assert abs(stats[0] - values.mean()) < 1e-5
            assert abs(stats[1] / values.var(unbiased=False) - 1) < 1e-4
    finally:
        dist.destroy_process_group()


def _set_epoch_run(path, shards_per_epoch, n):
    """A finished run directory as ex_set_epoch.py writes it, built by hand (no launch):
    shards_per_epoch[e][r] = the indices rank r trained on in epoch e."""
    world = len(shards_per_epoch[0])
    (path / "metrics").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"world_size": world}))
    (path / "result.json").write_text(json.dumps({"status": "ok"}))
    for r in range(world):
        rows = [{"time": 0, "rank": r, "step": 0, "samples": n}]
        rows += [{"time": e + 1, "rank": r, "step": e + 1, "epoch": e, "indices": shards[r]}
                 for e, shards in enumerate(shards_per_epoch)]
        (path / "metrics" / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    return path


@pytest.mark.parametrize("world", [1, 2, 3])
def test_set_epoch_checker_compares_every_pair_of_epochs(tmp_path, world):
    import torch
    from ddp_lesson.notebook.graders.l03 import check_set_epoch
    n, epochs = 96, 3
    # the notebook's solution: a permutation from seed + epoch, every world-th index from the rank
    solution = [[torch.randperm(n, generator=torch.Generator().manual_seed(e)).tolist()[r::world]
                 for r in range(world)] for e in range(epochs)]
    assert "3 epochs" in check_set_epoch(_set_epoch_run(tmp_path / "ok", solution, n))
    # two orders taken in turn: neighbouring epochs differ, epoch 2 repeats epoch 0
    with pytest.raises(AssertionError, match="same order in epochs 0 and 2"):
        check_set_epoch(_set_epoch_run(tmp_path / "alternating", solution[:2] + solution[:1], n))
    if world == 1:
        return
    # one fixed shuffle whose shards rotate over the ranks: every rank's order and set change
    # from epoch to epoch, but the shards are only handed on
    fixed = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    rotating = [[fixed[(r + e) % world::world] for r in range(world)] for e in range(epochs)]
    for a, b in zip(rotating, rotating[1:]):                  # what the old checker compared
        assert all(a[r] != b[r] and set(a[r]) != set(b[r]) for r in range(world))
    with pytest.raises(AssertionError, match="epochs 0 and 1 split the samples into the same shards"):
        check_set_epoch(_set_epoch_run(tmp_path / "rotating", rotating, n))
    # only some rank gets new samples: rank 0 keeps its shard, reordered; the others share the
    # rest anew every epoch (the old checker asked only that some rank's set changed)
    mine = fixed[0::world]
    rest = sorted(set(range(n)) - set(mine))
    keep = [[mine[e:] + mine[:e]] + [[rest[i] for i in torch.randperm(len(rest), generator=torch.Generator()
                                                                      .manual_seed(e))][r - 1::world - 1]
                                     for r in range(1, world)] for e in range(epochs)]
    with pytest.raises(AssertionError, match="rank 0 trained on the same samples in epochs 0 and 1"):
        check_set_epoch(_set_epoch_run(tmp_path / "keep", keep, n))


def test_step_timer_leaves_the_comm_hook_free(monkeypatch):
    # 03 says: the StepTimer registers no comm hook, so DDP averages with its built-in code and a
    # learner's own register_comm_hook works beside the timer; a second one raises, so this can fail
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from ddp_lesson.rank import metrics
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(launch.free_port()))
    monkeypatch.setenv("DDP_LESSON_STEP_TIMES", "1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        timer = metrics.StepTimer(model, opt)
        assert model._get_ddp_logging_data().get("comm_hook") is None   # what 03b's check reads ...
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        assert model._get_ddp_logging_data().get("comm_hook") == "allreduce_hook"   # ... names a hook
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        assert model.module.weight.grad is not None and timer.lap()["wait_s"] >= 0
        with pytest.raises(RuntimeError, match="can only be called once"):
            model.register_comm_hook(None, default_hooks.allreduce_hook)
    finally:
        dist.destroy_process_group()


def test_04_step_by_step_check_rejects_a_script_that_never_converts(tmp_path):
    # 04 cell 04-11 always compares a CPU run with section 1's reference runs; here its check
    # meets ddp_syncbn.py with the conversion planted out: --sync-bn then trains plain BN.
    from ddp_lesson.notebook import plots
    from ddp_lesson.launcher import runs
    opts = ["--epochs", "1", "--batch-size", "4", "--lr", "0.02", "--train-samples", "64", "--seed", "0"]
    text = script("ddp_syncbn.py").read_text()
    convert = "    if args.sync_bn:  # DDP: BatchNorm2d -> SyncBatchNorm, before wrapping in DDP\n"
    assert convert in text
    planted = tmp_path / "no_convert.py"
    planted.write_text(text.replace(convert, "    if False:  # planted: never converts\n"))
    started = {"ref": launch.start(script("syncbn_stats.py"), nproc=2, cpu=True, run_dir=tmp_path / "ref",
                                   args=opts),
               "planted": launch.start(planted, nproc=2, cpu=True, run_dir=tmp_path / "planted",
                                       args=opts + ["--sync-bn"])}
    _all_ok(started, timeout=400)
    ref = json.loads((tmp_path / "ref" / "reference_runs.json").read_text())
    _, (_, loss) = plots.series(runs.load(started["planted"].run_dir).rows, "loss")
    cell = next(c for c in json.loads((ROOT_NB / "04_sync_batchnorm.ipynb").read_text())["cells"]
                if c.get("id") == "04-11")
    assert "syncbn_compare.compare(panel, ref, small," in "".join(cell["source"])   # the cell's check
    one, plain = ref["runs"]["1 process"]["loss"], ref["runs"]["DDP, BN"]["loss"]
    assert max(abs(a - b) for a, b in zip(loss, plain)) < 1e-5       # the planted run is plain BN
    with pytest.raises(AssertionError, match="SyncBN vs one process"):
        syncbn_compare.check_step_by_step(loss, one, plain, 2)
    with pytest.raises(AssertionError, match="SyncBN vs one process"):   # the cell's own call, planted run
        syncbn_compare.compare(started["planted"], ref, {k[2:]: v for k, v in zip(opts[::2], opts[1::2])},
                               {"ms_per_step_bn": 1.0, "ms_per_step_syncbn": 2.0}, script=planted)


def test_04_compare_knows_a_run_unlike_the_reference_runs():
    # 04 cell 04-11 launches its own CPU run when the panel's is not like the reference runs
    from types import SimpleNamespace as Rec
    ref = {"world_size": 2, "args": {"epochs": 2, "batch_size": 4, "lr": 0.02}}
    options = {"epochs": 2, "batch-size": 4, "lr": 0.02}
    assert syncbn_compare.like_the_reference(Rec(gpus=[], config={"world_size": 2}), ref, options) == ""
    assert "GPUs" in syncbn_compare.like_the_reference(Rec(gpus=[0, 1], config={"world_size": 2}), ref, options)
    assert "3 rank" in syncbn_compare.like_the_reference(Rec(gpus=[], config={"world_size": 3}), ref, options)
    assert "options" in syncbn_compare.like_the_reference(Rec(gpus=[], config={"world_size": 2}), ref,
                                                          {**options, "lr": 0.1})


def test_04_lesson_text_says_what_the_curve_check_asserts_and_the_draw_order():
    # 04 cell 04-09 tells the learner: SyncBN's line is drawn over the one process's, and the two
    # agree in the first 5 steps; its fold 04-09b gives the bound, 1e-5, and that plain BN's first
    # loss differs unless one rank. Each claim, held to the code it describes.
    import inspect
    cells = {c.get("id"): "".join(c["source"])
             for c in json.loads((ROOT_NB / "04_sync_batchnorm.ipynb").read_text())["cells"]}
    text, fold = cells["04-09"], cells["04-09b"]
    assert "first 5 steps" in text and "drawn first and SyncBN's on top" in text
    assert fold.startswith("<details>") and "first 5 steps" in fold and "within 1e-5" in fold
    assert "plain BN's first loss differs from SyncBN's, unless there is one rank" in fold.replace("\n", " ")
    one = [2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4]
    plain = [v + 0.1 for v in one]
    near = [v + 9e-6 for v in one[:5]] + [v + 0.5 for v in one[5:]]   # agrees for 5 steps only
    syncbn_compare.check_step_by_step(near, one, plain, 2)
    long = [2.0 - 0.05 * i for i in range(20)]
    with pytest.raises(AssertionError, match="median distance"):   # planted: agrees 5 steps, then drifts past plain BN
        syncbn_compare.check_step_by_step(long[:5] + [v + 0.5 for v in long[5:]], long, [v + 0.1 for v in long], 2)
    with pytest.raises(AssertionError, match="SyncBN vs one process"):   # step 5 off by 2e-5
        syncbn_compare.check_step_by_step(one[:4] + [one[4] + 2e-5] + one[5:], one, plain, 2)
    with pytest.raises(AssertionError, match="equals plain BN"):          # plain BN's step 1 the same
        syncbn_compare.check_step_by_step(one, one, one, 2)
    syncbn_compare.check_step_by_step(one, one, one, 1)                   # one rank: not asserted
    code = inspect.getsource(syncbn_compare.compare)
    first = code.index('others = {f"1 process, batch')       # the one process first in `others`
    assert first < code.index('f"DDP {world}x{b}, BN"') and code.index(
        "for label, r in others.items():\n        ax.plot(") < code.index("ax.plot(steps, loss")


@pytest.mark.parametrize("mistake", [None, "two seeds", "no set_epoch"])
def test_03_shard_check_rejects_a_seed_per_rank_and_a_missing_set_epoch(tmp_path, mistake):
    # 03 cell 03-06 checks the shards ddp_basic.py logs; here it meets each mistake, planted
    from ddp_lesson.launcher import runs
    text = script("ddp_basic.py").read_text()
    old, new = {None: ("", ""),
                "two seeds": ("seed=args.seed)  # DDP: a shard", "seed=args.seed + rank)  # DDP: a shard"),
                "no set_epoch": ("        sampler.set_epoch(epoch)", "        pass")}[mistake]
    assert mistake is None or text.count(old) == 1
    planted = tmp_path / "planted.py"
    planted.write_text(text.replace(old, new))
    run = launch.start(planted, nproc=2, cpu=True, run_dir=tmp_path / "run",
                       args=["--epochs", "2", "--train-samples", "128", "--batch-size", "16"])
    try:
        result = run.wait(timeout=300)
    finally:
        run.stop()
    assert result and result["status"] == "ok", (result, runs.log_tail(run.run_dir, 0, 30, "stderr"))
    cell = next(c for c in json.loads((ROOT_NB / "03_ddp_torchrun.ipynb").read_text())["cells"]
                if c.get("id") == "03-06")
    text = "".join(cell["source"])
    ns = {}
    exec(text[text.index("def check_shards("):text.index("\n\n\n")], ns)
    rows = runs.load(run.run_dir).rows
    if mistake is None:                          # the lesson's script passes the same check
        ns["check_shards"](rows, 2, 128)
        return
    with pytest.raises(AssertionError, match="overlap or miss" if mistake == "two seeds" else "set_epoch"):
        ns["check_shards"](rows, 2, 128)


def test_03b_timeline_cell_fails_on_planted_wrong_results(monkeypatch, tmp_path):
    # 03b cell 03b-timeline, run on ddp_checks.py's real results at one rank, passes; it fails
    # when the one-bucket run has several buckets, and when a GPU rank's checkpoint lands on
    # another GPU (a load without map_location); on CPU ranks it checks no map_location
    import importlib.util
    import torch
    import torch.distributed as dist
    spec = importlib.util.spec_from_file_location("ddp_checks_planted", script("ddp_checks.py"))
    ddp_checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ddp_checks)
    nb = json.loads((ROOT_NB / "03b_ddp_equals_one_process.ipynb").read_text())
    source = next("".join(c["source"]) for c in nb["cells"] if c.get("id") == "03b-timeline")
    monkeypatch.setenv("DDP_LESSON_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(launch.free_port()))

    def results(one_bucket_cap):
        real = ddp_checks.overlap
        monkeypatch.setattr(ddp_checks, "overlap", lambda device, ids, bucket_cap_mb: real(
            device, ids, one_bucket_cap if bucket_cap_mb == 1000 else bucket_cap_mb))
        ddp_checks.check(torch.device("cpu"), None)
        return json.loads((tmp_path / "ddp_checks.json").read_text())

    def run_cell(dc):
        from ddp_lesson.notebook import diagrams
        exec(source, {"written": lambda run, name: dc, "ddp_run": None, "show": lambda fig: None,
                      "diagrams": diagrams})

    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        good, planted = results(1000), results(1)
    finally:
        dist.destroy_process_group()
    run_cell(good)
    assert planted[0]["overlap_one_bucket"]["buckets"] > 1
    with pytest.raises(AssertionError):
        run_cell(planted)
    gpu = json.loads(json.dumps(good))
    gpu[0].update(device="cuda:1", map_location={"saved_on": ["cuda:0"], "loaded_on": ["cuda:1"]})
    run_cell(gpu)
    gpu[0]["map_location"]["loaded_on"] = ["cuda:0"]
    with pytest.raises(AssertionError, match="cuda:0"):
        run_cell(gpu)


def test_04_text_states_the_tutorials_numbers_its_curves_give():
    # 04-csdn's sentence is the tutorial's best and final epochs; 04-csdn2 holds its two curves
    import ast
    cells = {c["id"]: "".join(c["source"]) for c in json.loads((ROOT_NB / "04_sync_batchnorm.ipynb").read_text())["cells"]}
    curves = {t.id: ast.literal_eval(node.value) for node in ast.parse(cells["04-csdn2"]).body
              if isinstance(node, ast.Assign) for t in node.targets
              if isinstance(t, ast.Name) and t.id in ("no_sync_bn", "sync_bn")}
    plain, sync = curves["no_sync_bn"], curves["sync_bn"]
    assert len(plain) == len(sync) == 30
    text = " ".join(cells["04-csdn"].split())
    assert f"{max(sync):.3f} against {max(plain):.3f}" in text and max(sync) > max(plain)       # best: SyncBN ahead
    assert f"{sync[-1]:.3f} against {plain[-1]:.3f}" in text and sync[-1] < plain[-1]          # final: not


def _visible_markdown(name):
    "The markdown a learner reads with every fold closed, cell by cell."
    nb = json.loads((Path(__file__).resolve().parent.parent / "notebooks" / name).read_text())
    out = []
    for c in nb["cells"]:
        text = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        if c["cell_type"] == "markdown" and not text.lstrip().startswith("<details>"):
            out.append(text)
    return out


@pytest.mark.parametrize("name,term", [
    ("03b_ddp_equals_one_process.ipynb", "no_sync"),        # taught in 05
    ("01_data_parallel.ipynb", "buffer rule"),              # taught in 03b
    ("05_gradient_accumulation.ipynb", "unscale_"),         # GradScaler comes in 10
])
def test_no_term_in_the_lesson_text_before_the_notebook_that_teaches_it(name, term):
    assert not [t for t in _visible_markdown(name) if term in t], (name, term)


@pytest.mark.parametrize("name,term", [
    ("00_start_here.ipynb", "panel"), ("03_ddp_torchrun.ipynb", "sampler")])
def test_a_term_is_first_used_where_it_is_defined(name, term):
    # the first visible use of the word is its bold definition
    first = next(t for t in _visible_markdown(name) if term in t.lower())
    i = first.lower().index(term)
    assert "**" in first[max(0, i - 20):i + len(term) + 3], first[max(0, i - 80):i + 80]
