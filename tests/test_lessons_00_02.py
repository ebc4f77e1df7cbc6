"""The key claims of notebooks 00-02, checked without a kernel, and an exercise with a
checker and a solution in each."""
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_lesson import simulate

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
    # through the checker; a collapsed <details> solution; a hidden solution cell that proves
    # the checker accepts the solution and rejects the starter
    texts = [source(c) for c in cells(name) if c["cell_type"] == "code"]
    assert any("# your answer here" in t and "def check_" in t and "not yet:" in t for t in texts)
    assert any(c["cell_type"] == "markdown" and source(c).startswith("<details>") for c in cells(name))
    solutions = [c for c in cells(name) if "solution" in c.get("metadata", {}).get("tags", [])]
    assert solutions and all(c["metadata"]["jupyter"]["source_hidden"] for c in solutions)
    assert all("check_" in source(c) and "starter" in source(c) for c in solutions)


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
