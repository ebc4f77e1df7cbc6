"""The built-in data is deterministic and learnable; the CIFAR-10 option reads
torchvision's on-disk format (tested on a tiny fixture: nothing downloads here)."""
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ddp_lesson.rank import data, models
from ddp_lesson.launcher import launch, runs
from ddp_lesson.rank.bundled import script

SCRIPT = script("ddp_basic.py")


def test_shapes_is_deterministic_and_balanced():
    a, b = data.shapes(512, seed=3), data.shapes(512, seed=3)
    assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])
    assert a.tensors[0].shape == (512, 3, 16, 16)
    counts = torch.bincount(a.tensors[1], minlength=10)
    assert counts.min() > 25, counts  # every class present in fair numbers
    assert not torch.equal(data.shapes(64, seed=0).tensors[0], data.shapes(64, seed=1).tensors[0])


def test_shapes_classes_are_distinct_without_noise():
    # With the noise removed, the mean image of each class differs from every other.
    x, y = data.shapes(2000, seed=0, noise=0.0).tensors
    means = torch.stack([x[y == c].mean(0) for c in range(10)]).flatten(1)
    dist = torch.cdist(means, means) + torch.eye(10) * 1e9
    assert dist.min() > 0.1


def test_small_cnn_learns_shapes_quickly():
    torch.manual_seed(0)
    train, test = data.shapes(2048, seed=0), data.shapes(512, seed=1)
    model = models.SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        for x, y in torch.utils.data.DataLoader(train, batch_size=64, shuffle=True):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    model.eval()
    x, y = test.tensors
    acc = (model(x).argmax(1) == y).float().mean().item()
    assert acc > 0.6, acc  # chance is 0.1


def make_cifar_fixture(root, per_batch=16):
    """A tiny CIFAR-10 in torchvision's on-disk format (cifar-10-batches-py/)."""
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 "labels": [int(v) for v in rng.integers(0, 10, per_batch)]}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog",
                                     "frog", "horse", "ship", "truck"]}, f)
    return root


def fixture_md5s(root):
    """The md5 lists torchvision's CIFAR10 checks, computed from the fixture's own files."""
    import hashlib

    folder = Path(root) / "cifar-10-batches-py"
    md5 = {f.name: hashlib.md5(f.read_bytes()).hexdigest() for f in folder.iterdir()}
    return {"train_list": [[f"data_batch_{i}", md5[f"data_batch_{i}"]] for i in range(1, 6)],
            "test_list": [["test_batch", md5["test_batch"]]],
            "meta": {"filename": "batches.meta", "key": "label_names", "md5": md5["batches.meta"]}}


def trust_fixture(monkeypatch, root):
    """Make torchvision accept the fixture (its md5 check stays on: real files must match)."""
    import torchvision

    for name, value in fixture_md5s(root).items():
        monkeypatch.setattr(torchvision.datasets.CIFAR10, name, value)


def test_cifar10_md5_is_checked(tmp_path):
    make_cifar_fixture(tmp_path)      # torchvision's real md5 sums: the fixture must not pass
    with pytest.raises(RuntimeError, match="corrupted"):
        data.get("cifar10", root=str(tmp_path))


def test_cifar10_reads_the_on_disk_format(tmp_path, monkeypatch):
    make_cifar_fixture(tmp_path)
    trust_fixture(monkeypatch, tmp_path)
    train = data.get("cifar10", train=True, root=str(tmp_path))
    test = data.get("cifar10", train=False, root=str(tmp_path))
    assert len(train) == 5 * 16 and len(test) == 16
    x, y = train[0]
    assert x.shape == (3, 32, 32) and 0 <= y < 10
    assert train.classes[0] == "airplane"


def test_cifar10_missing_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="download=True"):
        data.get("cifar10", root=str(tmp_path))


@pytest.mark.timeout(300)
def test_reference_script_trains_on_cifar10_fixture(tmp_path):
    make_cifar_fixture(tmp_path / "data")
    site = tmp_path / "site"       # the ranks trust the fixture the same way, at start-up
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import torchvision\n"
        f"for k, v in {fixture_md5s(tmp_path / 'data')!r}.items():\n"
        "    setattr(torchvision.datasets.CIFAR10, k, v)\n")
    run = launch.start(SCRIPT, nproc=2, cpu=True, run_dir=tmp_path / "run",
                       env={"PYTHONPATH": str(site)},   # the launcher puts the package first
                       args=["--epochs", "1", "--dataset", "cifar10", "--data-root", str(tmp_path / "data"),
                             "--batch-size", "8", "--train-samples", "80"])
    try:   # generous: at load ~17 on 2 cores this 2-rank run took over 100 s
        result = run.wait(timeout=240)
    finally:
        run.stop()   # a run that did not finish must not outlive the test
    assert result and result["status"] == "ok", (result, runs.log_tail(run.run_dir, 0, 30, "stderr"))
    rec = runs.load(run.run_dir)
    assert rec.ranks() == [0, 1]
    assert rec.last("test_accuracy") is not None
