"""Lesson 10: torch.compile with DDP.

    torchrun --standalone --nproc-per-node 2 beyond_compile.py --steps 8
What is counted: the graphs Dynamo hands the backend, one per call of the backend.
1. Graph split: Dynamo's DDPOptimizer cuts the model's forward graph into pieces that mirror
   DDP's buckets (its own bucketing of the graph's parameters, reverse order, DDP's
   bucket_bytes_cap, a 1 MiB first bucket) and hands each piece to the backend on its own, so
   that backward completes one bucket's worth of gradients while the rest still runs.
   Counted with a backend that only counts the graphs it is given and runs them as they are
   (backward stays eager autograd): in compile(DDP(m)), one per bucket DDP all-reduces; in
   DDP(compile(m)) with torch._dynamo.config.optimize_ddp = False, one. Both orders on a
   user-defined module. In compile(DDP(m)) Dynamo starts tracing DDP's forward (torch.compile
   wraps a torch.nn module so that it can) but breaks the graph inside it, at DDP's C++
   logging/reducer calls and at the context manager _inside_ddp_forward (disabled for Dynamo).
   DDP's _run_ddp_forward calls the module inside `with self._inside_ddp_forward():`; the
   user's forward, called there, is a new frame that Dynamo compiles. With a bare
   nn.Sequential that frame is torch.nn code, which Dynamo skips as a frame, so no graph.
2. Training: the compiled model trains like the eager one from the same start, within a
   stated tolerance. --backend auto: inductor on GPUs; aot_eager on CPU ranks (no C++ code
   generation, which took minutes on 2 busy cores). The training backend is wrapped the same
   way, so the graphs it was really given are counted too (one per bucket of eager DDP), and
   with aot_eager so are the graphs AOTAutograd makes of each: a forward and a backward graph
   per piece, and which parameters each piece takes. A comm hook records which parameters
   each of DDP's buckets held, eager and compiled: DDP rebuilds its buckets from the order the
   gradients became ready, and a compiled piece's backward hands over all its gradients at
   once. --backend inductor on CPU needs a C++ compiler and says so without one.
Writes compile.json; check(comp) is the notebook's check of it.
--then SCRIPT ARGS runs a later section's script after this one, in the same ranks
(ddp_lesson/rank/chain.py): the notebook runs sections 1-5's scripts in one launch.
"""
import argparse
import copy
import os
import shutil
import time

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.debugging import aot_eager, boxed_nop
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lesson.rank import chain, data, metrics


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--hidden", type=int, default=512, help="at 512: 3 layers of 1-1.5 MiB and a 20 KB head")
    p.add_argument("--backend", choices=["auto", "inductor", "aot_eager", "eager"], default="auto")
    p.add_argument("--bucket-cap-mb", type=float, default=1.0, help="DDP's bucket size (>= 1: "
                   "the DDPOptimizer wants the first bucket, 1 MB, to be no larger than the rest)")
    chain.add_then(p)
    args = p.parse_args(argv)
    if args.backend == "inductor" and not torch.cuda.is_available() and compiler() is None:
        p.error("inductor on CPU needs a C++ compiler (g++ or clang++); none was found: use --backend aot_eager")
    return args


class MLP(nn.Module):
    """A user-defined module, as real models are: its forward is not torch.nn code, so Dynamo
    starts a frame there when DDP's _run_ddp_forward calls it, inside the context manager
    _inside_ddp_forward (disabled for Dynamo)."""
    def __init__(self, hidden):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(3 * 16 * 16, hidden), nn.Linear(hidden, hidden),
                                     nn.Linear(hidden, hidden), nn.Linear(hidden, 10)])

    def forward(self, x):
        x = x.flatten(1)
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


def mlp(hidden, sequential=False):
    """The MLP; sequential=True: the same layers as a bare nn.Sequential (torch.nn's own code)."""
    torch.manual_seed(0)
    model = MLP(hidden)
    if sequential:
        l1, l2, l3, l4 = model.layers
        return nn.Sequential(nn.Flatten(), l1, nn.ReLU(), l2, nn.ReLU(), l3, nn.ReLU(), l4)
    return model


class Buckets:
    """Comm hook state: the buckets DDP all-reduced, each as its parameters' names."""
    def __init__(self, module):
        self.names = {id(p): n.replace("_orig_mod.", "") for n, p in module.named_parameters()}
        self.seen = []


def count_buckets(state, bucket):
    state.seen.append([state.names[id(p)] for p in bucket.parameters()])
    return allreduce_hook(None, bucket)


def counting(graphs, then=None, aot=None, pieces=None):
    """A backend that notes the ops of each graph Dynamo hands it, then compiles the graph with
    the backend named `then`, or (None) runs it as it is. aot: a dict to count the forward and
    backward graphs AOTAutograd makes of each graph under aot_eager. pieces: a Buckets state,
    to note the parameters each graph takes."""
    def backend(gm, example_inputs):
        graphs.append(sum(1 for n in gm.graph.nodes if n.op == "call_function"))
        if pieces is not None:
            pieces.seen.append(parameters_of(gm, pieces.names))
        if then is None:
            return gm.forward
        if then == "aot_eager" and aot is not None:
            return aot_eager(gm, example_inputs, fw_compiler=noting(aot, "forward"),
                             bw_compiler=noting(aot, "backward"))
        return torch._dynamo.lookup_backend(then)(gm, example_inputs)
    return backend


def parameters_of(gm, names):
    """The parameters a graph takes as inputs, by name. Dynamo notes on each input node the
    tensor it came from (GraphArg.example, torch/_dynamo/variables/builder.py)."""
    taken = [n.meta["grapharg"].example for n in gm.graph.nodes
             if n.op == "placeholder" and "grapharg" in n.meta]
    return [names[id(t)] for t in taken if id(t) in names]


def noting(aot, kind):
    """aot_eager's own graph compiler (boxed_nop: no code generation), counting its calls."""
    def compile_graph(gm, example_inputs):
        aot[kind] += 1
        return boxed_nop(gm, example_inputs)
    return compile_graph


def graphs_of(model_fn, optimize_ddp, x, y):
    """Compile with the counting backend that runs each graph as it is; graphs and buckets."""
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = optimize_ddp
    graphs = []
    model, buckets = model_fn(counting(graphs))
    for _ in range(2):                     # DDP rebuilds its buckets after the first step
        buckets.seen = []
        F.cross_entropy(model(x), y).backward()
    return graphs, len(buckets.seen)


def compiler():
    """The C++ compiler inductor would call on CPU, or None."""
    names = [os.environ.get("CXX"), "g++", "clang++", "c++"]
    return next((shutil.which(n) for n in names if n and shutil.which(n)), None)


def run(args, device):
    """This section's runs, in a process group already started; rank 0 writes compile.json."""
    rank, world = dist.get_rank(), dist.get_world_size()
    use_cuda = device.type == "cuda"
    ids = [device.index] if use_cuda else None
    b = args.batch_size
    x_all, y_all = data.shapes(args.steps * b * world, seed=13).tensors
    x0, y0 = x_all[:b].to(device), y_all[:b].to(device)
    base = mlp(args.hidden).to(device)

    def ddp_of_compiled(backend):           # DDP(torch.compile(model)): the form that splits here
        model = DDP(torch.compile(copy.deepcopy(base), backend=backend), device_ids=ids,
                    bucket_cap_mb=args.bucket_cap_mb)
        state = Buckets(model.module)
        model.register_comm_hook(state, count_buckets)
        return model, state

    def compiled_ddp(backend, inner=base):  # torch.compile(DDP(model)): the form the docs show
        model = DDP(copy.deepcopy(inner), device_ids=ids, bucket_cap_mb=args.bucket_cap_mb)
        state = Buckets(model.module)
        model.register_comm_hook(state, count_buckets)
        return torch.compile(model, backend=backend), state

    cxx = compiler()                        # (parse_args refused inductor on CPU without one)
    backend = args.backend if args.backend != "auto" else ("inductor" if use_cuda else "aot_eager")
    out = {"world_size": world, "bucket_cap_mb": args.bucket_cap_mb, "backend": backend, "cxx": cxx,
           "param_mb": sum(p.numel() * p.element_size() for p in base.parameters()) / 2**20}

    # 1. Graphs handed to a backend that only counts them (no compiling): the whole graph
    #    without the DDPOptimizer, and the other order of DDP and compile.
    whole, _ = graphs_of(ddp_of_compiled, False, x0, y0)
    outer, outer_buckets = graphs_of(compiled_ddp, True, x0, y0)
    seq, _ = graphs_of(lambda backend: compiled_ddp(backend, mlp(args.hidden, sequential=True).to(device)),
                       True, x0, y0)
    out["no_split"] = {"graphs": len(whole), "ops_per_graph": whole}
    out["compile_of_ddp"] = {"graphs": len(outer), "ops_per_graph": outer, "ddp_buckets": outer_buckets}
    out["compile_of_ddp_sequential"] = {"graphs": len(seq), "ops_per_graph": seq}

    # 2. Training, eager vs compiled with the real backend (DDP(torch.compile(model)), split by
    #    the DDPOptimizer), the graphs that backend was given counted on the way in.
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = True
    graphs, aot = [], ({"forward": 0, "backward": 0} if backend == "aot_eager" else None)
    losses, weights, times, buckets = {}, {}, {}, {}
    for name in ("eager", "compiled"):
        net = copy.deepcopy(base)
        if name == "compiled":
            pieces = Buckets(net)                          # the parameters each piece takes
            net = torch.compile(net, backend=counting(graphs, then=backend, aot=aot, pieces=pieces))
        model = DDP(net, device_ids=ids, bucket_cap_mb=args.bucket_cap_mb)
        state = Buckets(net)
        model.register_comm_hook(state, count_buckets)   # both runs: the same all-reduce
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses[name], times[name] = [], []
        for step in range(args.steps):
            i = (step * world + rank) * b
            x, y = x_all[i:i + b].to(device), y_all[i:i + b].to(device)
            state.seen = []
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times[name].append(time.perf_counter() - t0)
            losses[name].append(loss.item())
            buckets[name] = state.seen                     # the last step's (rebuilt) buckets
        weights[name] = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    out["split"] = {"graphs": len(graphs), "ops_per_graph": graphs, "aot_graphs": aot, "pieces": pieces.seen}
    out["ddp_buckets"] = buckets       # per training run: which parameters each bucket held
    out["losses"] = losses
    out["first_step_s"] = {k: v[0] for k, v in times.items()}        # compiled: includes compiling
    out["later_step_ms"] = {k: 1000 * min(v[1:]) for k, v in times.items()}
    out["max_loss_diff"] = max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"]))
    out["max_weight_diff"] = (weights["eager"] - weights["compiled"]).abs().max().item()

    x_seen, y_seen = x_all.to(device), y_all.to(device)

    def loss_on_all(flat):  # over every sample the ranks trained on: one batch's loss is too noisy
        m = copy.deepcopy(base)
        nn.utils.vector_to_parameters(flat.to(device), m.parameters())
        with torch.no_grad():
            return F.cross_entropy(m(x_seen), y_seen).item()
    out["loss_on_all_samples"] = {"start": loss_on_all(nn.utils.parameters_to_vector(base.parameters())),
                                  **{k: loss_on_all(w) for k, w in weights.items()}}
    if rank == 0:
        metrics.save_json("compile.json", out)


def straddling(buckets, pieces):
    """The buckets that hold gradients of more than one piece."""
    piece_of = {name: i for i, piece in enumerate(pieces) for name in piece}
    return [b for b in buckets if len({piece_of[name] for name in b}) > 1]


def check(comp):
    """The notebook's check of compile.json."""
    split, aot, ddp_buckets = comp["split"], comp["split"]["aot_graphs"], comp["ddp_buckets"]
    eager_buckets = ddp_buckets["eager"]
    assert len(eager_buckets) > 1                            # the small bucket cap made several buckets
    assert split["graphs"] == len(eager_buckets)             # the backend was handed one graph per bucket,
    pieces = split["pieces"]                                 # each with one bucket's parameters
    assert sorted(map(sorted, pieces)) == sorted(map(sorted, eager_buckets)), (pieces, eager_buckets)
    if aot is not None:                                      # aot_eager: AOTAutograd, per piece,
        assert aot == {"forward": split["graphs"], "backward": split["graphs"]}   # a forward and a backward graph
        # DDP's rebuilt buckets are not the pieces: some hold gradients of two pieces
        assert straddling(ddp_buckets["compiled"], pieces), (ddp_buckets["compiled"], pieces)
    assert comp["no_split"]["graphs"] == 1                   # without the DDPOptimizer: one graph
    assert sum(split["ops_per_graph"]) == sum(comp["no_split"]["ops_per_graph"])  # same ops, cut up
    outer = comp["compile_of_ddp"]                           # the other order, the same module
    assert outer["graphs"] == outer["ddp_buckets"] == split["graphs"]
    assert outer["ops_per_graph"] == split["ops_per_graph"]
    assert comp["compile_of_ddp_sequential"]["graphs"] == 0  # the bare nn.Sequential: nothing compiled
    # Tolerance: aot_eager runs the same kernels, inductor fuses and reorders float math.
    assert comp["max_loss_diff"] < 1e-4 and comp["max_weight_diff"] < 1e-4
    # it trains: the loss over every sample the ranks saw fell (one batch's loss is too noisy to tell)
    assert comp["loss_on_all_samples"]["compiled"] < comp["loss_on_all_samples"]["start"]


if __name__ == "__main__":
    chain.main(parse_args, run)   # set-up as in 03, run(), then any --then sections
