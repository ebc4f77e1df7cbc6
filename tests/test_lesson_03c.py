"""Notebook 03c (averaging in DDP): its claims checked without a kernel, the exercise's
solution, and the one claim the notebook only computes in arithmetic, checked on 2 real gloo
ranks: a loss all-reduced by hand before backward gives gradients divided twice."""
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "03c_averaging_in_ddp.ipynb"
SCRIPTS = ROOT / "ddp_lesson" / "scripts"


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
    assert any("# your answer here" in t and "def check_" in t and "not yet:" in t for t in texts)
    solutions = [c for c in cells() if "solution" in c.get("metadata", {}).get("tags", [])]
    assert solutions and all(c["metadata"]["jupyter"]["source_hidden"] for c in solutions)
    assert all("check_" in source(c) and "starter" in source(c) for c in solutions)


def test_links_previous_03b_next_04():
    last = source(cells()[-1])
    assert "(03b_ddp_equals_one_process.ipynb)" in last and "(04_sync_batchnorm.ipynb)" in last
    for name in ("03b_ddp_equals_one_process.ipynb", "04_sync_batchnorm.ipynb"):
        assert (ROOT / "notebooks" / name).is_file()


def test_script_seeds_and_evaluates_as_notebook_03s():
    # the learner meets one rule for both scripts: seed + rank, evaluation through DDP's forward
    mine, basic = (SCRIPTS / "loss_averaging.py").read_text(), (SCRIPTS / "ddp_basic.py").read_text()
    for needle in ("torch.manual_seed(args.seed + rank)", 'os.environ["RANK"]', 'os.environ["LOCAL_RANK"]',
                   'os.environ["WORLD_SIZE"]', "@record", "set_epoch", "destroy_process_group"):
        assert needle in mine and needle in basic, needle
    assert "count_correct(model.module" not in mine and "count_correct(model," in mine


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
    dist.destroy_process_group()
""")


def test_loss_reduced_by_hand_divides_the_gradients_twice(tmp_path):
    script = tmp_path / "hand_reduced.py"
    script.write_text(HAND_REDUCED)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    ratio = json.loads(out.stdout.split("RATIO", 1)[1].splitlines()[0].strip())
    assert all(math.isclose(r, 2.0, rel_tol=1e-9) for r in ratio), ratio      # 2 ranks: half of one process's
    assert "WARNED True" in out.stdout, out.stdout


