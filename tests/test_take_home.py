"""Scripts a learner can take home: the reference chain (train_single, ddp_basic, ddp_syncbn,
ddp_accum), each copied alone into an empty folder, and the capstone (gpt_ddp.py with its
gpt_model.py) run under plain torchrun where `import ddp_lesson` fails; the data and model the
chain's scripts hold are the course's, tensor for tensor."""
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import plain_torchrun
from ddp_lesson.rank import bundled
from ddp_lesson.rank import data, models

CHAIN = ("train_single", "ddp_basic", "ddp_syncbn", "ddp_accum")

# Put first on the children's path, it makes every `import ddp_lesson...` fail, as on a machine
# without the course (the package is installed here, editable, so leaving it off PYTHONPATH is not enough).
BLOCKER = '''
import sys

class NoCourse:
    def find_spec(self, name, path=None, target=None):
        if name == "ddp_lesson" or name.startswith("ddp_lesson."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, NoCourse())
'''


@pytest.fixture(scope="module")
def no_course(tmp_path_factory):
    """An environment where `import ddp_lesson` fails, proved before it is used."""
    site = tmp_path_factory.mktemp("no_course_site")
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDP_LESSON_", "MASTER_", "TORCHELASTIC"))}
    env.update(PYTHONPATH=str(site), PYTHONNOUSERSITE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    probe = subprocess.run([sys.executable, "-c", "import ddp_lesson"], env=env, cwd=site,
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'ddp_lesson'" in probe.stderr, probe.stderr
    return env


def take_home(name, tmp_path, *siblings):
    """The shipped script, copied into an empty folder, with the siblings it imports."""
    folder = tmp_path / "home"
    folder.mkdir()
    for other in siblings:
        shutil.copy(bundled.script(f"{other}.py"), folder / f"{other}.py")
    return shutil.copy(bundled.script(f"{name}.py"), folder / f"{name}.py")


def run_alone(path, env, args, nproc=2):
    """`path` run by plain torchrun on `nproc` ranks in its folder (nproc None: by plain python)."""
    if nproc is not None:
        return plain_torchrun(path.name, *args, nproc=nproc, env=env, cwd=path.parent)
    return subprocess.run([sys.executable, path.name, *args], env=env, cwd=path.parent, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CHAIN)
def test_chain_script_runs_alone_without_the_course(name, no_course, tmp_path):
    path = take_home(name, tmp_path)
    args = ["--epochs", "1", "--train-samples", "128"] + (["--accum-steps", "2"] if name == "ddp_accum" else [])
    p = run_alone(path, no_course, args, nproc=None if name == "train_single" else 2)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "test accuracy" in p.stdout, p.stdout
    assert sorted(f.name for f in path.parent.iterdir()) == sorted([path.name, "model.pt"])   # and its checkpoint
    state = torch.load(path.parent / "model.pt", weights_only=True)
    assert state.keys() == models.SmallCNN().state_dict().keys()   # the course's model loads it


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"take_home_{name}", bundled.script(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def same_model(script, size):
    """True if the script's SmallCNN is the course's: the same weights from the same seed, and the
    same outputs on a batch, in training and in eval mode (a pooling or a flatten order of its own
    keeps the weights and changes the outputs)."""
    torch.manual_seed(3)
    mine = script.SmallCNN(image_size=size)
    torch.manual_seed(3)
    course = models.SmallCNN(image_size=size)
    a, b = mine.state_dict(), course.state_dict()
    if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
        return False
    x = torch.randn(8, 3, size, size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        return all(torch.equal(mine.train(mode)(x), course.train(mode)(x)) for mode in (True, False))


# The scripts' cifar10 branch is not tested here: the course's tests have no CIFAR-10 download.
@pytest.mark.parametrize("name", CHAIN)
def test_chain_script_makes_the_courses_data_and_model(name):
    # one truth: ddp_lesson/rank/data.py and models.py; each script's own few lines give the same tensors
    script = load_script(name)
    for train in (True, False):
        mine, course = script.get_data("shapes", train, "data").tensors, data.get("shapes", train=train).tensors
        assert all(torch.equal(a, b) for a, b in zip(mine, course)), (name, train)
    for size in (16, 32):
        assert same_model(script, size), (name, size)


def planted(name, old, new):
    """The script `name` with one edit, loaded as a module."""
    source = bundled.script(f"{name}.py").read_text()
    assert old in source
    bad = type(importlib)("bad")
    exec(compile(source.replace(old, new, 1), "bad", "exec"), bad.__dict__)
    return bad


def test_a_changed_shape_is_caught():
    # the comparison above fails for a script whose data differ in one class's drawing
    bad = planted("ddp_basic", "radius <= r, ", "radius < r, ")
    mine, course = bad.get_data("shapes", False, "data").tensors, data.get("shapes", train=False).tensors
    assert not torch.equal(mine[0], course[0])


@pytest.mark.parametrize("old,new", [("nn.MaxPool2d(2)", "nn.AvgPool2d(2)"),
                                     ("self.features(x).flatten(1)", "self.features(x).transpose(1, 3).flatten(1)")])
def test_a_changed_layer_is_caught(old, new):
    # the same weights, other outputs: the model comparison above fails for such a script
    assert same_model(load_script("ddp_basic"), 16)
    assert not same_model(planted("ddp_basic", old, new), 16)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["ddp_syncbn", "ddp_accum"])
def test_sync_bn_on_cpu_ranks_without_the_course_stops_with_one_sentence(name, no_course, tmp_path):
    # PyTorch's SyncBatchNorm refuses CPU tensors; the course's stand-in is not there
    path = take_home(name, tmp_path)
    p = run_alone(path, no_course, ["--epochs", "1", "--train-samples", "128", "--sync-bn"])
    assert p.returncode != 0
    assert "--sync-bn on CPU ranks needs the course's ddp_lesson" in p.stdout + p.stderr, p.stderr[-3000:]
    assert f'{name}.py", line' not in p.stderr, p.stderr[-3000:]   # the sentence, not the script's stack


@pytest.mark.timeout(300)
def test_capstone_runs_alone_without_the_course(no_course, tmp_path):
    # its data is this Python's standard library, read by lines it holds; its model is gpt_model.py,
    # beside it; a tiny GPT, 3 steps
    path = take_home("gpt_ddp", tmp_path, "gpt_model")
    args = ["--layers=1", "--heads=2", "--width=32", "--block=16", "--global-batch=4", "--micro-batch=1",
            "--steps=3", "--warmup-steps=1", "--eval-every=3", "--eval-windows=4", "--sample-bytes=8",
            "--train-windows=32", "--amp=off", "--save-at=3"]
    p = run_alone(path, no_course, args)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "step 3: loss" in p.stdout and "--- sample ---" in p.stdout, p.stdout
    assert (path.parent / "ckpt_3.pt").exists()


def test_03_take_home_box_says_how_to_run_it_without_the_course():
    # a visible box right after 03's diff fold: the file, the commands, the GPU rule, what needs the course
    import json
    from pathlib import Path
    notebook = Path(__file__).resolve().parent.parent / "notebooks" / "03_ddp_torchrun.ipynb"
    cells = {c["id"]: "".join(c["source"]) for c in json.loads(notebook.read_text())["cells"]}
    ids = list(cells)
    box = cells["03-home"]
    assert ids.index("03-home") == ids.index("03-full") + 1 and box.startswith("> **Take it home.**")   # no fold
    text = " ".join(line.lstrip("> ") for line in box.splitlines())
    for needle in ("`torchrun --standalone --nproc-per-node 2 ddp_basic.py`, with your number of GPUs in place of 2",
                   '`CUDA_VISIBLE_DEVICES="" torchrun --standalone --nproc-per-node 2 ddp_basic.py`',
                   "`--nproc-per-node` is at most your number of GPUs", "`torch.cuda.set_device(1)`",
                   "`train_single.py`", "`ddp_syncbn.py`", "`ddp_accum.py`", "`ex_set_epoch.py`"):
        assert needle in text, needle
    source = bundled.script("ddp_basic.py").read_text()
    assert "torch.cuda.set_device(local_rank)" in source          # the rule's reason: GPU = local rank
    assert "from ddp_lesson." in bundled.script("ex_set_epoch.py").read_text()   # a starter needs the course
    assert "chain's other scripts" not in cells["03-diff3"]
    helpers = cells["03-helpers"]                                    # the folder the fold names is the scripts'
    assert helpers.startswith("<details>") and "`ddp_lesson/rank/scripts/lessons/`" in helpers
    assert bundled.script("ddp_basic.py").parent.as_posix().endswith("ddp_lesson/rank/scripts/lessons")
