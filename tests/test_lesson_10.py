"""Notebook 10's compile, sharding and checkpoint checks at a world size the notebook does not
run (it runs at DDP_LESSON_NPROC, 2 in CI): 3 gloo CPU ranks, a real torchrun launch through
ddp_lesson.launcher.launch, the smallest runs that can fail (2-3 steps). As in the notebook, one launch
runs the scripts in turn in the same ranks (--then, ddp_lesson/rank/chain.py): beyond_amp.py with
its all-reduce planted away (no_sync() over every micro-batch: the ranks really differ, and the
amp check must say so), compile, shard, then the DCP save; the checkpoint is then loaded at
1 rank (the notebook loads at N + 1).

torch.compile's graph split (cell 10-13) is mirrored here at 3 ranks in a short run (3 steps):
the graphs handed to aot_eager, AOTAutograd's forward and backward graphs, DDP's rebuilt
buckets in the compiled run, the counting backend's orders. The ring all-reduce's 2(N-1)/N at
3 ranks, which the compress hooks' bytes checks rest on, is checked here on the sharding run's
DDP bytes (test_bytes_sent_zero_is_ddp_plus_broadcasts).

The notebook's checks of sections 1, 2, 3 and 5 are the scripts' check() functions (cells
10-05, 10-09, 10-13, 10-21 call them). Each is shown here to fail on a planted bug: the
scripts of sections 1 and 2 run in this process, in a one-rank gloo group, as written and
with the bug planted in their text or their hooks (no launch); the compile and checkpoint
checks get the 3-rank launch's results with a planted wrong field."""
import ast
import copy
import importlib
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddp_lesson.rank import chain
from ddp_lesson.launcher import launch
from ddp_lesson.notebook.lesson import load_script, script

WORLD = 3
STEPS = 2
AMP_ARGS = ["--precision", "fp16", "--steps", "2", "--accum-steps", "2", "--batch-size", "8", "--max-norm", "0.2"]
AMP_NOSYNC = "            with model.no_sync() if not last else contextlib.nullcontext():  # all-reduce on the last only\n"


def finished(run, filename):
    result = run.wait()
    assert result["status"] == "ok", result.get("message")
    return json.loads((run.run_dir / filename).read_text())


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs10")
    ckpt = base / "ckpt"
    # First link: beyond_amp.py with the all-reduce planted away (no_sync() over every
    # micro-batch), so its "same on all ranks" check meets ranks that really differ. Chained
    # links are imported from the first script's folder: the real ones are copied beside it.
    folder = base / "planted"
    folder.mkdir()
    text = script("beyond_amp.py").read_text()
    assert text.count(AMP_NOSYNC) == 1, "beyond_amp.py no longer holds its no_sync() line"
    (folder / "beyond_amp.py").write_text(text.replace(AMP_NOSYNC, "            with model.no_sync():\n"))
    for name in ("beyond_compile.py", "beyond_shard.py", "beyond_dcp.py"):
        shutil.copy(script(name), folder / name)
    run = launch.start(folder / "beyond_amp.py", cpu=True, nproc=WORLD, run_dir=base / "chain", timeout=600,
                       args=[*AMP_ARGS, "--then", "beyond_compile", "--steps", 3, "--then", "beyond_shard", "--steps", STEPS,
                             "--then", "beyond_dcp", "--save", ckpt, "--steps", STEPS])
    run.wait()              # ended before any test: the leftover-process check runs per test
    yield {"run": run, "ckpt": ckpt}
    run.stop()


def test_zero_shards_the_optimizer_state_and_trains_like_ddp(launched):
    v = finished(launched["run"], "shard.json")
    n, p = v["world_size"], v["params"]
    assert n == WORLD
    z = v["zero_state_floats_per_rank"]
    assert len(z) == n and sum(z) == 2 * p                       # Adam's two moments, split
    assert max(z) <= 2 * p / n + 2 * v["largest_param"]           # ~1/N, by whole parameters
    assert math.isclose(v["held"]["zero"]["optimizer"], 8 * p / n, rel_tol=0.02, abs_tol=8 * 2 * v["largest_param"])
    assert v["held"]["ddp"]["optimizer"] == 8 * p                 # DDP: all of it on every rank
    assert v["zero_max_weight_diff_vs_ddp"] < 1e-6


def test_fsdp2_shards_parameters_and_matches_ddp(launched):
    v = finished(launched["run"], "shard.json")
    n, p = v["world_size"], v["params"]
    assert sum(v["fsdp_local_floats_per_rank"]) == p
    for name, (loc, full) in v["fsdp_local_shapes"].items():
        assert loc[1:] == full[1:] and loc[0] == math.ceil(full[0] / n), name   # rank 0's rows
    assert math.isclose(v["held"]["fsdp"]["params"], 4 * p / n, rel_tol=0.05)
    assert math.isclose(v["held"]["fsdp"]["optimizer"], 8 * p / n, rel_tol=0.05)
    assert v["fsdp_max_loss_diff_vs_ddp"] < 1e-5
    assert v["fsdp_max_weight_diff_vs_ddp"] < 1e-5


def test_unsharded_peak_check_fails_for_root_only_wrapping(launched):
    v = finished(launched["run"], "shard.json")
    shard10 = load_script(script("beyond_shard.py"))
    shard10.check_unsharded_peak(v)                         # the notebook's cell 10-17, at 3 ranks
    peak = v["unsharded_peak"]
    assert peak["per layer"] < peak["root only"] == 4 * v["params"]
    # Planted: the model wrapped at the root only (what "per layer" measures then is the root's peak)
    with pytest.raises(AssertionError, match="is every Linear its own fully_shard unit"):
        shard10.check_unsharded_peak({**v, "unsharded_peak": {**peak, "per layer": peak["root only"]}})
    # Planted: reshard_after_forward=False reported as resharding
    with pytest.raises(AssertionError, match="reshard_after_forward=False held"):
        shard10.check_unsharded_peak({**v, "unsharded_peak": {**peak, "per layer, kept": peak["per layer"]}})


PER_LAYER = ("    for layer in fsdp:\n        if isinstance(layer, nn.Linear):\n"
             "            fully_shard(layer, mesh=mesh)\n")


def test_unsharded_peak_check_fails_when_the_trained_model_is_wrapped_at_the_root_only(one_rank, tmp_path):
    # Cell 10-17's check on the model section 3 trains, with the bug planted in a copy of the
    # script: its per-layer fully_shard lines removed, so only fully_shard(fsdp) is left. On GPUs
    # (no byte counts) this peak is the check that sees it.
    shard10 = load_script(script("beyond_shard.py"))
    shard10.run(shard10.parse_args(["--steps", "1"]), torch.device("cpu"))
    sh = json.loads((one_rank / "shard.json").read_text())
    shard10.check_unsharded_peak(sh)
    root_only = planted(tmp_path, "beyond_shard.py", PER_LAYER, "")
    root_only.run(root_only.parse_args(["--steps", "1"]), torch.device("cpu"))
    sh = json.loads((one_rank / "shard.json").read_text())
    assert sh["unsharded_peak"]["trained"] == 4 * sh["params"]
    with pytest.raises(AssertionError, match="the model section 3 trained held .* before fully_shard"):
        shard10.check_unsharded_peak(sh)


def test_fp16_compress_hook_divides_in_fp16_and_small_gradients_underflow():
    # The hook's own line (installed torch): cast, then divide by N, before the all-reduce.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    assert "buffer.to(dtype).div_(world_size)" in Path(default_hooks.__file__).read_text()
    grads = torch.tensor([1e-3, 1e-5, 3e-7, 1e-7, 3e-8])
    assert ((grads.to(torch.float16).div_(8)) == 0).sum() >= 2          # the notebook's cell 10-10u
    assert (grads.to(torch.bfloat16).div_(8) != 0).all()                # bf16 keeps fp32's range
    assert (grads.div(8).to(torch.float16) == 0).sum() >= 1             # either order: fp16's range is the cause


def test_dcp_checkpoint_saved_at_3_loads_at_1(launched, tmp_path):
    saved = finished(launched["run"], "dcp_save.json")
    assert saved["world_size"] == WORLD
    assert len([f for f in saved["files"] if f.endswith(".distcp")]) == WORLD   # one file per saving rank
    assert saved["floats_on_rank0"] < saved["floats_total"]                     # rank 0 held a shard only
    run = launch.start(script("beyond_dcp.py"), cpu=True, nproc=1,
                       args=["--load", str(launched["ckpt"])], run_dir=tmp_path / "load", timeout=300)
    loaded = finished(run, "dcp_load.json")
    assert loaded["world_size"] == 1
    dcp10 = load_script(script("beyond_dcp.py"))
    dcp10.check(saved, loaded)                             # the notebook's cell 10-21, saved at 3, loaded at 1
    # Planted: a load that kept the save's cut; a save where rank 0 held the whole model; a load
    # at the save's own world size.
    for planted, why in (({**loaded, "local_shapes": saved["local_shapes"]}, "at 1 ranks"),
                         ({**loaded, "world_size": WORLD}, "the save's world size")):
        with pytest.raises(AssertionError, match=why):
            dcp10.check(saved, planted)
    with pytest.raises(AssertionError, match=f"at {WORLD} ranks"):
        dcp10.check({**saved, "local_shapes": saved["full_shapes"]}, loaded)
    assert loaded["max_diff_before_load"] > 1e-3
    assert loaded["max_diff_vs_saved"] == 0.0
    assert loaded["adam_steps_restored"] and all(s == STEPS for s in loaded["adam_steps_restored"])
    assert loaded["adam_moments_restored"] and loaded["max_moment_diff_vs_saved"] == 0.0
    assert loaded["min_moment_abs_max"] > 0


def test_dcp_check_fails_when_the_load_skips_set_optimizer_state_dict(launched, tmp_path):
    # Planted: dcp.load still fills Adam's moments and step counts in place, so only the
    # param_groups tell: the fresh Adam's defaults (lr 1e-3) stay instead of the save's 1e-2.
    saved = finished(launched["run"], "dcp_save.json")
    text = Path(script("beyond_dcp.py")).read_text()
    line = '        set_optimizer_state_dict(model, opt, state["optim"])\n'
    assert text.count(line) == 1
    planted = tmp_path / "beyond_dcp.py"
    planted.write_text(text.replace(line, ""))
    run = launch.start(planted, cpu=True, nproc=1, args=["--load", str(launched["ckpt"])],
                       run_dir=tmp_path / "load", timeout=300)
    loaded = finished(run, "dcp_load.json")
    assert loaded["max_moment_diff_vs_saved"] == 0.0       # the moments came back without it
    with pytest.raises(AssertionError, match="set_optimizer_state_dict restores lr"):
        load_script(script("beyond_dcp.py")).check(saved, loaded)


def test_ddp_holds_a_bucket_copy_unless_gradients_are_bucket_views(launched):
    v = finished(launched["run"], "shard.json")
    p = v["params"]
    assert v["held"]["ddp"]["buckets"] == 4 * p and sum(v["held"]["ddp"].values()) == 20 * p
    assert v["held"]["ddp_view"]["buckets"] == 0 and sum(v["held"]["ddp_view"].values()) == 16 * p


def test_bytes_sent_zero_is_ddp_plus_broadcasts(launched):
    v = finished(launched["run"], "shard.json")
    n, p, sent = v["world_size"], v["params"], v["sent_per_step"]
    assert len(sent["ddp"]) == n
    for s in sent["ddp"]:                                       # ring all-reduce of 4P bytes
        assert 2 * (n - 1) / n * 4 * p <= s <= 2 * (n - 1) / n * 4 * p * 1.02 + 4096
    ratio = sum(sent["zero"]) / sum(sent["ddp"])
    assert 1.45 <= ratio <= 1.55, ratio                         # + (N-1) x 4P of broadcasts in all
    assert 1.9 <= sum(sent["fsdp"]) / sum(sent["ddp"]) <= 2.1   # gloo's reduce-scatter is an all-reduce


def test_compile_graphs_per_bucket_and_ddp_rebuilt_buckets(launched):
    v = finished(launched["run"], "compile.json")
    assert v["world_size"] == WORLD and v["backend"] == "aot_eager"
    compile10 = load_script(script("beyond_compile.py"))
    compile10.check(v)                                     # the notebook's cell 10-13, at 3 ranks
    names = sorted(sum(v["ddp_buckets"]["eager"], []))
    assert sorted(sum(v["split"]["pieces"], [])) == names  # the pieces name every parameter once

    # Planted: the pieces' parameters as the DDPOptimizer would NOT cut them (one piece, as
    # with optimize_ddp=False); DDP's compiled buckets equal to the pieces (DDP using the splits).
    one_piece = copy.deepcopy(v)
    one_piece["split"]["pieces"] = [names]
    with pytest.raises(AssertionError):
        compile10.check(one_piece)
    buckets_are_pieces = copy.deepcopy(v)
    buckets_are_pieces["ddp_buckets"]["compiled"] = v["split"]["pieces"]
    assert compile10.straddling(v["ddp_buckets"]["compiled"], v["split"]["pieces"])
    assert compile10.straddling(v["split"]["pieces"], v["split"]["pieces"]) == []
    with pytest.raises(AssertionError, match="layers"):
        compile10.check(buckets_are_pieces)


CHAIN_BODY = '''import argparse
from ddp_lesson.rank import chain
import chain10_log
def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int)
    {then}
    return p.parse_args(argv)
def run(args, device):
    chain10_log.seen.append((__name__, args.steps, device))
'''


@pytest.fixture
def chain_modules(tmp_path, monkeypatch):
    """Three chainable scripts a, b, c (c without --then) that log their runs in one list."""
    (tmp_path / "chain10_log.py").write_text("seen = []\n")
    for name, then in (("chain10_a", "chain.add_then(p)"), ("chain10_b", "chain.add_then(p)"), ("chain10_c", "")):
        (tmp_path / f"{name}.py").write_text(CHAIN_BODY.format(then=then))
    monkeypatch.syspath_prepend(str(tmp_path))
    import chain10_a, chain10_log
    yield chain10_a, chain10_log.seen
    for name in ("chain10_a", "chain10_b", "chain10_c", "chain10_log"):
        sys.modules.pop(name, None)


def as_main(first, argv):
    """What a chained script's main() does, without the process group."""
    args = first.parse_args(argv)
    first.run(args, "cpu")
    chain.then(args.then, "cpu")


def test_chain_hands_each_script_its_own_arguments_in_order(chain_modules):
    # What the one launch above and the notebook's rest on, in one process: each script parses
    # only the arguments up to the next --then, and they run in the order given.
    first, seen = chain_modules
    as_main(first, ["--steps", "1", "--then", "chain10_b", "--steps", "2", "--then", "chain10_c", "--steps", "3"])
    assert seen == [("chain10_a", 1, "cpu"), ("chain10_b", 2, "cpu"), ("chain10_c", 3, "cpu")]


@pytest.mark.parametrize("last", [["chain10_c", "--steps", "x"],                 # a bad argument
                                  ["chain10_c", "--steps", "3", "--then", "chain10_a"],  # c has no --then
                                  ["chain10_nowhere"]])                          # no such script
def test_a_bad_last_link_fails_before_the_first_runs(chain_modules, last):
    first, seen = chain_modules
    with pytest.raises((SystemExit, ImportError)):
        as_main(first, ["--steps", "1", "--then", "chain10_b", "--steps", "2", "--then", *last])
    assert seen == []


def test_a_missing_later_link_is_named_in_the_error(chain_modules, capsys):
    # An import error of a later link is that link's argparse error, so failed_in names it,
    # not the first script whose parse_args imported it.
    first, seen = chain_modules
    argv = ["--steps", "1", "--then", "chain10_b", "--steps", "2", "--then", "chain10_nowhere"]
    with pytest.raises(SystemExit):
        first.parse_args(argv)
    err = capsys.readouterr().err
    assert "chain10_nowhere.py: error: --then chain10_nowhere: No module named 'chain10_nowhere'" in err
    config = {"script": "/run/dir/script.py", "args": argv}
    assert chain.failed_in(config, {"traceback": err}) == "chain10_nowhere"


def first_launch(notebook):
    """The first code cell's `lesson_run = start(...)` call: its positional arguments, with the
    ones that are not literals (the checkpoint's path) as "<name>"."""
    nb = json.loads(notebook.read_text())
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and "lesson_run = start(" in src:
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "start":
                    return [a.value if isinstance(a, ast.Constant) else f"<{ast.unparse(a)}>" for a in node.args]
    raise AssertionError("no `lesson_run = start(...)` in the notebook")


def test_the_notebooks_launch_line_parses_through_every_script(monkeypatch):
    # The notebook's one launch, parsed as its ranks parse it (no launch): every script, in order.
    line = first_launch(Path(__file__).resolve().parent.parent / "notebooks" / "10_beyond_ddp.ipynb")
    assert line[0] == "beyond_amp"
    monkeypatch.syspath_prepend(str(script("beyond_amp.py").parent))   # chained links: its siblings
    first = importlib.import_module("beyond_amp")
    args = first.parse_args([str(a) for a in line[1:]])
    names = [m.__name__ for m, _ in args.then]
    assert names == ["beyond_compress", "beyond_compile", "beyond_shard", "beyond_dcp"]
    amp, (compress, compile_, shard, dcp) = args, [a for _, a in args.then]
    assert amp.precision == "fp16" and amp.max_norm == 0.2
    assert compress.steps == 24 and compile_.steps == 8 and shard.steps == 3
    assert dcp.save == "<ckpt.resolve()>" and dcp.load is None


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """A one-rank gloo group in this process, and a run directory for the scripts' JSON."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("DDP_LESSON_RUN_DIR", str(run_dir))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield run_dir
    dist.destroy_process_group()


def planted(tmp_path, name, old, new):
    """The course's script `name` with the text `old` (found exactly once) replaced by `new`."""
    text = script(name).read_text()
    assert text.count(old) == 1, f"{name} no longer holds {old!r}"
    path = tmp_path / "planted" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text.replace(old, new))
    return load_script(path)


UNSCALE = "        scaler.unscale_(opt)                               # 1. true gradients (no-op without fp16)\n"
CLIP = "        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)  # 2. then clip\n"


def amp_of(module, run_dir):
    module.run(module.parse_args(AMP_ARGS), torch.device("cpu"))
    return json.loads((run_dir / "amp.json").read_text())


def test_amp_check_fails_on_the_wrong_clip_order(one_rank, tmp_path):
    # Cell 10-05's check, on the script as written and with three planted bugs.
    amp10 = load_script(script("beyond_amp.py"))
    amp = amp_of(amp10, one_rank)
    amp10.check(amp)
    assert amp["scaler"] and all(s["scale"] > 1 for s in amp["steps"])
    swapped = planted(tmp_path, "beyond_amp.py", UNSCALE + CLIP, CLIP + UNSCALE)      # clip, then unscale_
    with pytest.raises(AssertionError, match="clipped before unscale_"):
        amp10.check(amp_of(swapped, one_rank))
    no_unscale = planted(tmp_path, "beyond_amp.py", UNSCALE, "")                      # scaler.step unscales
    with pytest.raises(AssertionError, match="clipped before unscale_"):
        amp10.check(amp_of(no_unscale, one_rank))
    no_clip = planted(tmp_path, "beyond_amp.py", CLIP,                                 # the norm, not clipped
                      CLIP.replace("clip_grad_norm_(model.parameters(), args.max_norm)",
                                   "get_total_norm([p.grad for p in model.parameters()])"))
    with pytest.raises(AssertionError, match="after clipping"):
        amp10.check(amp_of(no_clip, one_rank))
    # One rank cannot show ranks that differ: test_amp_check_fails_when_no_micro_batch_all_reduces
    # runs that at 3 ranks. Here, the check reads the field: planted in the record.
    differ = copy.deepcopy(amp)
    differ["steps"][-1]["same_on_all_ranks"] = False
    with pytest.raises(AssertionError, match="different gradients"):
        amp10.check(differ)


def test_amp_check_fails_when_no_micro_batch_all_reduces(launched):
    # The 3-rank launch's first link: beyond_amp.py run for real with no_sync() over the last
    # micro-batch too, so no gradient is ever all-reduced and every rank keeps its own.
    amp = finished(launched["run"], "amp.json")
    assert amp["world_size"] == WORLD and amp["scaler"]
    assert [s["same_on_all_ranks"] for s in amp["steps"]] == [False] * len(amp["steps"])
    with pytest.raises(AssertionError, match="different gradients"):
        load_script(script("beyond_amp.py")).check(amp)


def test_compress_check_fails_when_a_hook_does_not_compress(one_rank, monkeypatch):
    # Cell 10-09's check, on the script as written (the notebook's 24 steps) and with the fp16
    # hook planted as DDP's plain fp32 all-reduce.
    compress10 = load_script(script("beyond_compress.py"))
    compress10.run(compress10.parse_args(["--steps", "24"]), torch.device("cpu"))
    compress10.check(json.loads((one_rank / "compress.json").read_text()))
    monkeypatch.setitem(compress10.HOOKS, "fp16", compress10.default_hooks.allreduce_hook)
    compress10.run(compress10.parse_args(["--steps", "3"]), torch.device("cpu"))
    with pytest.raises(AssertionError, match="fp16: the hook sent"):
        compress10.check(json.loads((one_rank / "compress.json").read_text()))


def test_the_notebook_runs_the_scripts_checks():
    # The checks above are the notebook's: its check cells call them on the runs' results.
    nb = json.loads((Path(__file__).resolve().parent.parent / "notebooks" / "10_beyond_ddp.ipynb").read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    for call in ('load_script(script("beyond_amp.py")).check(amp)',
                 'load_script(script("beyond_compress.py")).check(compress)',
                 "compile10.check(comp)",
                 'load_script(script("beyond_dcp.py")).check(saved, loaded)'):
        assert call in code, call
