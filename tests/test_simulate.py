"""ddp_lesson.notebook.simulate against a single-device forward/backward (always) and against the
real nn.DataParallel (only where two or more CUDA GPUs exist)."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddp_lesson.notebook import simulate


def make_model(seed=0, norm=False):
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 16)]
    if norm:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.ReLU(), nn.Linear(16, 3)]
    return nn.Sequential(*layers)


class WithLoss(nn.Module):
    """Returns the mean loss of its chunk: a 0-d tensor per replica."""

    def __init__(self, net, reduction="mean"):
        super().__init__()
        self.net, self.reduction = net, reduction

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y, reduction=self.reduction)


def batch(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("n,devices,sizes", [(5, 4, [2, 2, 1]), (6, 4, [2, 2, 2]), (7, 2, [4, 3]),
                                             (1, 2, [1]), (8, 3, [3, 3, 2])])
def test_chunks_follow_tensor_chunk(n, devices, sizes):
    x, _ = batch(n)
    dp = simulate.DataParallel(make_model(), device_ids=list(range(devices)))
    dp(x)
    assert dp.last_trace.chunk_sizes == sizes == [len(c) for c in x.chunk(devices)]
    assert dp.last_trace.replicas_used == len(sizes)


@pytest.mark.parametrize("n,devices", [(8, 2), (7, 2), (9, 4), (5, 3)])
def test_outputs_and_gradients_equal_one_device(n, devices):
    x, y = batch(n)
    single = make_model()
    wrapped = copy.deepcopy(single)
    F.cross_entropy(single(x), y).backward()

    dp = simulate.DataParallel(wrapped, device_ids=list(range(devices)))
    out = dp(x)
    assert torch.allclose(out, single(x), atol=1e-6)
    loss = F.cross_entropy(out, y)               # loss on the gathered output: exact
    loss.backward()
    for a, b in zip(grads(single), grads(wrapped)):
        assert torch.allclose(a, b, atol=1e-6)


def test_gradients_are_summed_over_replicas():
    x, y = batch(8)
    single, wrapped = make_model(), make_model()
    F.cross_entropy(single(x), y, reduction="sum").backward()
    losses = simulate.DataParallel(WithLoss(wrapped, "sum"), device_ids=[0, 1])(x, y)
    losses.sum().backward()                       # per-replica sums, summed: exact
    for a, b in zip(grads(single), grads(wrapped)):
        assert torch.allclose(a, b, atol=1e-5)


def test_scalar_outputs_warn_and_become_a_vector():
    x, y = batch(3)
    dp = simulate.DataParallel(WithLoss(make_model()), device_ids=[0, 1])
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        losses = dp(x, y)
    assert losses.shape == (2,) and dp.last_trace.scalar_outputs_unsqueezed
    # the mean of per-replica means is not the batch mean when chunks are uneven (2 + 1)
    per_sample = F.cross_entropy(make_model()(x), y, reduction="none")
    expected = torch.stack([per_sample[:2].mean(), per_sample[2:].mean()])
    assert torch.allclose(losses, expected, atol=1e-6)
    assert not torch.isclose(losses.mean(), per_sample.mean())


def test_one_device_returns_a_scalar_without_gather():
    x, y = batch(4)
    dp = simulate.DataParallel(WithLoss(make_model()), device_ids=[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = dp(x, y)
    assert loss.dim() == 0


def test_batchnorm_running_stats_come_from_the_first_chunk():
    x, _ = batch(8)
    wrapped, reference = make_model(norm=True), make_model(norm=True)
    simulate.DataParallel(wrapped, device_ids=[0, 1])(x)
    reference(x[:4])                              # replica 0 saw the first chunk only
    assert torch.allclose(wrapped[1].running_mean, reference[1].running_mean)
    assert wrapped[1].num_batches_tracked.item() == 1


def test_parameters_must_be_on_the_first_device():
    model = simulate.place(make_model(), 0)
    with pytest.raises(RuntimeError, match=r"device_ids\[0\]"):
        simulate.DataParallel(model, device_ids=[2, 3])(batch(4)[0])
    simulate.DataParallel(simulate.place(model, 2), device_ids=[2, 3])(batch(4)[0])


def test_output_device_holds_more():
    dp = simulate.DataParallel(make_model(), device_ids=[0, 1])
    dp(batch(8)[0])
    held = dp.last_trace.bytes_per_device
    assert held[0] > held[1]


def test_replica_exception_reaches_the_caller():
    dp = simulate.DataParallel(make_model(), device_ids=[0, 1])
    with pytest.raises(RuntimeError, match="replica"):
        dp(torch.randn(4, 5))                       # wrong feature count


def _cuda_devices():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_cuda_devices() < 2, reason="needs >= 2 CUDA GPUs to compare with the real "
                    "nn.DataParallel; this machine has fewer (the CPU checks above still ran)")
@pytest.mark.parametrize("n", [8, 7, 3])
def test_matches_real_data_parallel(n):
    x, y = batch(n)
    real_model = WithLoss(make_model()).cuda(0)
    sim_model = WithLoss(make_model())
    real = nn.DataParallel(real_model, device_ids=[0, 1])
    sim = simulate.DataParallel(sim_model, device_ids=[0, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real_losses = real(x.cuda(0), y.cuda(0))
        sim_losses = sim(x, y)
    assert real_losses.shape == sim_losses.shape
    assert torch.allclose(real_losses.cpu(), sim_losses, atol=1e-5)
    real_losses.mean().backward()
    sim_losses.mean().backward()
    for a, b in zip(real_model.parameters(), sim_model.parameters()):
        assert torch.allclose(a.grad.cpu(), b.grad, atol=1e-5)
