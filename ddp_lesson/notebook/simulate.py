"""A faithful CPU simulation of nn.DataParallel: scatter -> replicate -> parallel_apply -> gather.

On a machine with two or more GPUs the lessons use the real `torch.nn.DataParallel`. On a
CPU-only machine `nn.DataParallel` does nothing at all (it calls the module directly), so
this module performs the same four steps with the same rules, on CPU "devices" that are
only labels:

- scatter: every tensor is split along `dim` with `tensor.chunk(len(device_ids), dim)`,
  which is what DP's `Scatter` (`torch.cuda.comm.scatter` with no chunk sizes) does. So a
  batch of 5 on 4 devices gives chunks of 2, 2, 1 and only THREE replicas run. Lists,
  tuples and dicts are scattered element by element; other objects are shared by reference.
- replicate: one copy of the module per chunk. Parameters are differentiable copies
  (DP's `Broadcast`), so in backward the gradients of all replicas are SUMMED into the
  original parameters (DP's `ReduceAddCoalesced`). Buffers are detached copies, except on
  replica 0, which shares them with the original (so BatchNorm running statistics are
  updated from the first chunk only, as in real DP).
- parallel_apply: each replica runs its chunk in its own thread, with the caller's grad
  mode, as DP does; an exception in a thread is re-raised in the caller.
- gather: outputs are concatenated along `dim` on the output device. If every replica
  returned a 0-d tensor (a scalar loss), they are unsqueezed into a vector with DP's
  warning: "Was asked to gather along dimension 0, but all input tensors were scalars;
  will instead unsqueeze and return a vector."

What it cannot show: speed or memory of real GPUs (there are no copies between devices,
no CUDA streams, and both "devices" share the same CPU cores).

    dp = simulate.DataParallel(model, device_ids=[0, 1])
    out = dp(x)                  # same numbers as nn.DataParallel on two GPUs
    dp.last_trace                # chunk sizes, replicas used, bytes held per device

The four functions have the signatures of torch.nn.parallel's scatter, replicate,
parallel_apply and gather, so a lesson can call them step by step either way.
"""
import copy
import threading
import warnings
from dataclasses import dataclass, field
from itertools import chain

import torch
from torch import nn

SCALAR_WARNING = ("Was asked to gather along dimension 0, but all input tensors were scalars; "
                  "will instead unsqueeze and return a vector.")

__all__ = ["DataParallel", "scatter", "scatter_kwargs", "replicate", "parallel_apply",
           "gather", "place", "device_of", "Trace", "SCALAR_WARNING"]


# -- simulated placement ---------------------------------------------------------------

def place(module, device_index):
    """Pretend `module` lives on simulated device `device_index` (like `.to('cuda:N')`)."""
    module._sim_device = int(device_index)
    return module


def device_of(module):
    """The simulated device a module was placed on (0 unless `place` said otherwise)."""
    return getattr(module, "_sim_device", 0)


@dataclass
class Trace:
    """What the last forward did, for the lesson to inspect."""
    device_ids: list
    output_device: int
    chunk_sizes: list = field(default_factory=list)     # batch size each replica got
    replicas_used: int = 0
    scalar_outputs_unsqueezed: bool = False
    bytes_per_device: dict = field(default_factory=dict)

    def describe(self):
        lines = [f"devices {self.device_ids}, output on {self.output_device}",
                 f"chunk sizes {self.chunk_sizes} -> {self.replicas_used} replica(s) ran"]
        for d, b in sorted(self.bytes_per_device.items()):
            lines.append(f"  device {d}: {b / 1024:.1f} KiB of parameters, inputs and outputs")
        return "\n".join(lines)


def _nbytes(obj):
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(o) for o in obj.values())
    return 0


# -- the four steps ------------------------------------------------------------------------

def _is_namedtuple(obj):
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def scatter(inputs, device_ids, dim=0):
    """Split tensors into `tensor.chunk(len(device_ids), dim)`, recursing into lists,
    tuples and dicts like DP's scatter; other objects are repeated by reference.
    Returns one entry per chunk (possibly fewer than devices)."""
    n = len(device_ids)

    def scatter_map(obj):
        if isinstance(obj, torch.Tensor):
            return obj.chunk(n, dim)          # differentiable: backward concatenates grads
        if _is_namedtuple(obj):
            return [type(obj)(*args) for args in zip(*map(scatter_map, obj))]
        if isinstance(obj, tuple) and len(obj) > 0:
            return list(zip(*map(scatter_map, obj)))
        if isinstance(obj, list) and len(obj) > 0:
            return [list(i) for i in zip(*map(scatter_map, obj))]
        if isinstance(obj, dict) and len(obj) > 0:
            return [type(obj)(i) for i in zip(*map(scatter_map, obj.items()))]
        return [obj for _ in device_ids]

    return scatter_map(inputs)


def scatter_kwargs(inputs, kwargs, device_ids, dim=0):
    """DP's scatter_kwargs: positional and keyword inputs scattered and padded to match."""
    scattered_inputs = scatter(inputs, device_ids, dim) if inputs else []
    scattered_kwargs = scatter(kwargs, device_ids, dim) if kwargs else []
    if len(scattered_inputs) < len(scattered_kwargs):
        scattered_inputs.extend(() for _ in range(len(scattered_kwargs) - len(scattered_inputs)))
    elif len(scattered_kwargs) < len(inputs):
        scattered_kwargs.extend({} for _ in range(len(scattered_inputs) - len(scattered_kwargs)))
    return tuple(scattered_inputs), tuple(scattered_kwargs)


def replicate(module, devices, detach=False):
    """One replica of `module` per entry of `devices` (same signature as torch's). Parameters become differentiable copies of the originals
    (DP's Broadcast: gradients flow back and are summed); buffers are detached copies,
    shared with the original on replica 0 (as DP's replica on device_ids[0] does)."""
    replicas = []
    originals = list(module.modules())
    for j in range(len(devices)):
        replica = copy.deepcopy(module)
        for src, dst in zip(originals, replica.modules()):
            for key, p in list(src._parameters.items()):
                if p is None:
                    continue
                copy_ = p.detach().clone() if detach or not torch.is_grad_enabled() else p.clone()
                del dst._parameters[key]
                setattr(dst, key, copy_)      # a plain tensor attribute, like DP's replicas
            for key, b in list(src._buffers.items()):
                if b is None:
                    continue
                dst._buffers[key] = b if j == 0 else b.detach().clone()
        replicas.append(replica)
    return replicas


def parallel_apply(replicas, inputs, kwargs_tup=None, devices=None):
    """Run replica i on inputs[i] in its own thread (DP's parallel_apply), keeping the
    caller's grad mode; re-raise the first exception in the caller."""
    kwargs_tup = kwargs_tup or tuple({} for _ in replicas)
    results, grad_enabled = {}, torch.is_grad_enabled()

    def worker(i, module, inp, kw):
        torch.set_grad_enabled(grad_enabled)
        try:
            if not isinstance(inp, (list, tuple)):
                inp = (inp,)
            results[i] = module(*inp, **kw)
        except Exception as e:  # handed back to the caller, as DP's ExceptionWrapper does
            results[i] = e

    if len(replicas) > 1:
        threads = [threading.Thread(target=worker, args=(i, m, inp, kw))
                   for i, (m, inp, kw) in enumerate(zip(replicas, inputs, kwargs_tup))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        worker(0, replicas[0], inputs[0], kwargs_tup[0])
    outputs = []
    for i in range(len(inputs)):
        out = results[i]
        if isinstance(out, Exception):
            raise type(out)(f"Caught {type(out).__name__} in replica {i}: {out}") from out
        outputs.append(out)
    return outputs


def gather(outputs, target_device=0, dim=0):
    """Concatenate the replicas' outputs along `dim` (recursing into dicts, lists and
    tuples). All-scalar outputs are unsqueezed into a vector, with DP's warning."""

    def gather_map(outs):
        out = outs[0]
        if isinstance(out, torch.Tensor):
            if all(t.dim() == 0 for t in outs) and dim == 0:
                warnings.warn(SCALAR_WARNING, UserWarning, stacklevel=2)
                outs = [t.view(1) for t in outs]
            return torch.cat(list(outs), dim)
        if out is None:
            return None
        if isinstance(out, dict):
            if not all(len(out) == len(d) for d in outs):
                raise ValueError("All dicts must have the same number of keys")
            return type(out)((k, gather_map([d[k] for d in outs])) for k in out)
        if _is_namedtuple(out):
            return type(out)._make(map(gather_map, zip(*outs)))
        return type(out)(map(gather_map, zip(*outs)))

    return gather_map(outputs)


class DataParallel(nn.Module):
    """nn.DataParallel's forward, step for step, on CPU. `device_ids` are labels of
    simulated devices (default [0, 1]); `output_device` defaults to device_ids[0]."""

    def __init__(self, module, device_ids=None, output_device=None, dim=0):
        super().__init__()
        self.module = module
        self.device_ids = list(device_ids if device_ids is not None else [0, 1])
        if not self.device_ids:
            raise RuntimeError("no available devices were found")
        self.output_device = self.device_ids[0] if output_device is None else output_device
        self.dim = dim
        self.last_trace = None
        if len(self.device_ids) == 1:
            place(self.module, self.device_ids[0])

    def forward(self, *inputs, **kwargs):
        src = self.device_ids[0]
        if device_of(self.module) != src:
            raise RuntimeError(f"module must have its parameters and buffers on device {src} "
                               f"(device_ids[0]) but found one of them on device: "
                               f"{device_of(self.module)}")
        inputs, module_kwargs = scatter_kwargs(inputs, kwargs, self.device_ids, self.dim)
        if not inputs and not module_kwargs:
            inputs, module_kwargs = ((),), ({},)
        trace = Trace(self.device_ids, self.output_device)
        trace.chunk_sizes = [_batch_size(i, k, self.dim) for i, k in zip(inputs, module_kwargs)]
        self.last_trace = trace
        if len(self.device_ids) == 1:
            trace.replicas_used = 1
            return self.module(*inputs[0], **module_kwargs[0])
        replicas = replicate(self.module, self.device_ids[: len(inputs)])
        outputs = parallel_apply(replicas, inputs, module_kwargs, self.device_ids[: len(replicas)])
        trace.replicas_used = len(replicas)
        trace.scalar_outputs_unsqueezed = self.dim == 0 and all(
            isinstance(o, torch.Tensor) and o.dim() == 0 for o in outputs)
        result = gather(outputs, self.output_device, self.dim)
        _account(trace, self.module, inputs, module_kwargs, outputs, result, self.device_ids)
        return result


def _batch_size(inp, kw, dim):
    for t in chain(_tensors(inp), _tensors(kw)):
        if t.dim() > dim:
            return t.size(dim)
    return 0


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _account(trace, module, inputs, kwargs, outputs, result, device_ids):
    """Bytes each simulated device holds during the step: a replica of the parameters,
    its chunk and its output; the output device also holds the gathered output (and,
    later, the loss computed from it)."""
    params = sum(p.numel() * p.element_size() for p in chain(module.parameters(), module.buffers()))
    held = {d: 0 for d in device_ids}
    for d, inp, kw, out in zip(device_ids, inputs, kwargs, outputs):
        held[d] += params + _nbytes(inp) + _nbytes(kw) + _nbytes(out)
    held[trace.output_device] = held.get(trace.output_device, 0) + _nbytes(result)
    trace.bytes_per_device = held
