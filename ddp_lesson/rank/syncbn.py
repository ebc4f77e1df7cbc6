"""SyncBatchNorm for CPU ranks. PyTorch's nn.SyncBatchNorm refuses CPU tensors in training once
a process group exists ("expected input tensor to be on GPU"); this does the same arithmetic with gloo so the lesson runs on
a laptop: per channel, every rank sums x, x*x and its count, one all_reduce adds them up,
and each rank normalises its own batch with the global mean and variance. The all_reduce
is a differentiable one (AllReduceSum below), so backward also sums over ranks, as
nn.SyncBatchNorm's backward does (both send nothing in backward when no gradient flows to
the layer's input, e.g. a BN layer right on the data).

    model = convert_sync_batchnorm(model)   # nn.SyncBatchNorm for a model on GPUs, this on CPU
"""
import torch
import torch.distributed as dist
from torch import nn


class AllReduceSum(torch.autograd.Function):
    """dist.all_reduce (sum) that autograd can go through: the gradient of a sum over ranks
    is the sum over ranks of the gradients. torch.distributed.nn.functional.all_reduce does
    the same (its _AllReduce) but warns FutureWarning on every call in torch 2.x, pointing
    to the private torch.distributed._functional_collectives."""

    @staticmethod
    def forward(ctx, tensor):
        out = tensor.clone()  # dist.all_reduce works in place; leave autograd's input alone
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class CPUSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Any BatchNorm1d/2d/3d (it replaces all of them), like nn.SyncBatchNorm, with or
    without running statistics (track_running_stats)."""

    def _check_input_dim(self, x):  # used by eval()'s plain BN path
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x):
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(x)
        dims = [d for d in range(x.dim()) if d != 1]
        count = torch.tensor([x.numel() / x.size(1)], dtype=torch.float64)
        local = torch.cat([x.double().sum(dims), (x.double() ** 2).sum(dims), count])
        total = AllReduceSum.apply(local)  # sums over ranks; its backward sums too
        c = x.size(1)
        n = total[-1]
        mean = total[:c] / n
        var = total[c:2 * c] / n - mean ** 2  # biased: what normalisation uses
        if self.track_running_stats:
            self._update_running_stats(mean, var, n)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x - mean.float().view(shape)) / torch.sqrt(var.float().view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y

    @torch.no_grad()
    def _update_running_stats(self, mean, var, n):
        self.num_batches_tracked += 1
        m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        self.running_mean.mul_(1 - m).add_(m * mean.float())
        self.running_var.mul_(1 - m).add_(m * (var * n / (n - 1)).float())  # unbiased


def convert_sync_batchnorm(module):
    """nn.SyncBatchNorm.convert_sync_batchnorm for a model whose tensors are on GPUs (nccl);
    CPUSyncBatchNorm layers for one on the CPU (gloo). Decided by where the model lives, not
    by whether this machine has a GPU: CPU ranks on a GPU machine need the CPU version."""
    if any(t.is_cuda for t in list(module.parameters()) + list(module.buffers())):
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return _to_cpu_sync(module)


def _to_cpu_sync(module):
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, CPUSyncBatchNorm):
        new = CPUSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                               module.track_running_stats)
        new.load_state_dict(module.state_dict())
        new.train(module.training)
        return new
    for name, child in module.named_children():
        module.add_module(name, _to_cpu_sync(child))
    return module
