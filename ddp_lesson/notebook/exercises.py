"""Every exercise's checker, and the one verdict they print: "correct!" or "not yet:".

    run_dir, passed = exercises.attempt("work/ex_set_epoch.py", exercises.check_set_epoch)
    passed = exercises.grade(exercises.check_cuda_index, cuda_index)     # a function you wrote

A check_* raises AssertionError with one sentence saying what is wrong, or returns True or a
line saying what it saw. Launched exercises (03-05, 11): the checker reads a finished run
directory (config.json and the ranks' metrics; check_no_sync also the learner's prediction);
expectations come from the run's own world size. Pure-function exercises (00-04, 06-08, 10):
the checker calls the learner's function on cases, in this process. Also the checkers of 09's
bucketed hook (check_bucketed, on ddp_scratch.check_stage's result; it returns (ok, why)).
"""
import re
from collections import defaultdict
from pathlib import Path

from ..launcher import launch, runs
from ..rank.bundled import script


def attempt(script, check, nproc=None, timeout=300):
    """Launch `script` on CPU ranks, wait, run `check` on its run directory and print the
    verdict. Returns (run_dir, passed)."""
    run = launch.start(script, nproc=nproc, cpu=True, timeout=timeout)
    run.wait()
    return run.run_dir, grade(check, run.run_dir)


def grade(check, *answer):
    """Print the verdict of check(*answer) and return whether it passed: "correct!" (and the
    line check returned, if any), or "not yet:" and the sentence of its AssertionError. Any
    other Exception counts as "not yet" too, named by its type: an answer of the wrong kind,
    such as the starter's None (TypeError), or one that raises inside the learner's function
    (a RuntimeError from autograd, say). KeyboardInterrupt and SystemExit are not Exceptions."""
    try:
        said = check(*answer)
    except AssertionError as e:
        print("not yet:", e)
        return False
    except Exception as e:   # the learner's code raised: a verdict, not a traceback
        print(f"not yet: {type(e).__name__}: {e}")
        return False
    print("correct!", *([said] if isinstance(said, str) else []))
    return True


def _finished(run_dir):
    rec = runs.load(run_dir)     # reads config.json, result.json and the metrics once
    assert rec.status == "ok", f"the run ended {rec.status}: {(rec.result or {}).get('message')}"
    return rec, rec.config["world_size"]


def check_set_epoch(run_dir):
    """03: every epoch a new order, the same shuffle on every rank: disjoint shards that
    together cover all the data set's samples once per epoch. Every pair of epochs differs, not
    only neighbours: each rank's order and set of samples, and the split into shards, so a fixed
    shuffle whose shards rotate over the ranks is rejected."""
    rec, world = _finished(run_dir)
    order = defaultdict(list)                    # (rank, epoch) -> indices in training order
    sizes = {row["samples"] for row in rec.rows if "samples" in row}
    assert len(sizes) == 1, "the run did not log its data set's size (samples) once, the same on every rank"
    n = sizes.pop()
    for row in rec.rows:
        if "indices" in row:
            order[row["rank"], row["epoch"]].extend(row["indices"])
    epochs = sorted({e for _, e in order})
    assert len(epochs) >= 2, "the run logged fewer than 2 epochs of indices"
    for e in epochs:
        shards = [order[r, e] for r in range(world)]
        everything = sorted(i for s in shards for i in s)
        assert everything == sorted(set(everything)), \
            f"epoch {e}: some sample was trained on by two ranks (do all ranks draw the same permutation: the same seed on every rank?)"
        assert everything == list(range(n)), \
            f"epoch {e}: the shards cover {len(set(everything) & set(range(n)))} of the {n} samples"
    for i, a in enumerate(epochs):               # every pair of epochs, not only neighbours
        for b in epochs[i + 1:]:
            for r in range(world):
                assert order[r, a] != order[r, b], \
                    f"rank {r} saw the same samples in the same order in epochs {a} and {b}"
                assert world == 1 or set(order[r, a]) != set(order[r, b]), \
                    f"rank {r} trained on the same samples in epochs {a} and {b}, only reordered: " \
                    "shuffle all n indices, then give each rank its share"
            shards_a = sorted(sorted(order[r, a]) for r in range(world))
            assert world == 1 or shards_a != sorted(sorted(order[r, b]) for r in range(world)), \
                f"epochs {a} and {b} split the samples into the same shards, only handed to other ranks: " \
                "draw a new permutation every epoch, from seed + epoch"
    return f"{world} rank(s), {len(epochs)} epochs, each epoch a new order"


def check_global_bn(run_dir, tol=1e-6):
    """04: every rank holds, per channel, the mean and the biased variance of every rank's x
    together (the global batch, as SyncBatchNorm's forward needs them), from the x each rank
    logged. The ranks hold different numbers of samples, so an unweighted average of their
    means is wrong, and an average of their variances leaves out the spread between means.
    Within `tol`: the mean in standard deviations, the variance relative. A float32 answer is
    off by about 1e-7; the unbiased variance by 1/(n - 1), under 1e-4 at 7 or more ranks.
    Each rank's x carries a shift only that rank knows, so an answer that rebuilds the other
    ranks' x without communicating fails too (off by their shifts)."""
    import torch
    rec, world = _finished(run_dir)
    assert world > 1, "with one rank its batch is the global batch: run it on 2 or more"
    xs = {row["rank"]: torch.tensor(row["x"], dtype=torch.float64) for row in rec.rows if "x" in row}
    got = {row["rank"]: row for row in rec.rows if "var" in row}
    assert sorted(xs) == sorted(got) == list(range(world)), \
        "not every rank logged its x and then its mean and var"
    dims = (0, 2, 3)
    whole = torch.cat([xs[r] for r in range(world)])
    want_mean, want_var = whole.mean(dims), whole.var(dims, unbiased=False)
    own = {r: (xs[r].mean(dims), xs[r].var(dims, unbiased=False)) for r in range(world)}
    avg_mean = sum(m for m, _ in own.values()) / world
    avg_var = sum(v for _, v in own.values()) / world
    scale = want_var.sqrt()
    gap = max(((avg_var - want_var).abs() / want_var).max().item(),
              ((avg_mean - want_mean).abs() / scale).max().item())
    # else an average of the ranks' statistics would pass: this run could not tell them apart
    assert gap > 1e-3, f"the ranks' batches are too alike to tell a wrong merge from the right one ({gap:.2g})"
    off_mean = lambda a, b: ((a - b).abs() / scale).max().item()      # in standard deviations
    off_var = lambda a, b: ((a - b).abs() / want_var).max().item()    # relative
    wrong_vars = {  # the common wrong variances, with the right mean, to name the one a learner gave
        "the average of the ranks' variances, which leaves out how far each rank's mean is from "
        "the global mean": avg_var,
        "the unbiased variance (n - 1): divide by the count n, not n - 1, as BatchNorm "
        "normalises with": whole.var(dims, unbiased=True),
    }
    for r in reversed(range(world)):          # the last first: a copy of rank 0's is named as such
        mean = torch.tensor(got[r]["mean"], dtype=torch.float64)
        var = torch.tensor(got[r]["var"], dtype=torch.float64)
        assert mean.shape == want_mean.shape and var.shape == want_var.shape, \
            f"rank {r}: mean and var should each hold {len(want_mean)} numbers, one per channel"
        mean_off, var_off = off_mean(mean, want_mean), off_var(var, want_var)
        if mean_off < tol and var_off < tol:
            continue
        if off_mean(mean, own[r][0]) < tol and off_var(var, own[r][1]) < tol:
            raise AssertionError(f"rank {r} still holds this rank's own statistics")
        if mean_off >= tol:
            close = off_mean(mean, avg_mean) < tol
            raise AssertionError(f"rank {r}: the mean is off by up to {mean_off:.2g} standard deviations"
                                 + (": that is the unweighted average of the ranks' means, but rank r holds "
                                    "3 + r images" if close else ""))
        named = next((name for name, v in wrong_vars.items() if off_var(var, v) < tol), None)
        raise AssertionError(f"rank {r}: the mean is right, the variance is off by up to {var_off:.2g} "
                             "of the right value" + (f": that is {named}" if named else ""))
    return f"every one of {world} ranks holds the global batch's {len(want_mean)} means and variances"


def all_reduced(run_dir):
    """05: {placement: [rank][micro-batch] -> did its forward and backward all-reduce?}, from
    the rows ex_no_sync.py logged."""
    rec, world = _finished(run_dir)
    out = {}
    rows = (r for r in rec.rows if "placement" in r and "all_reduces" in r)
    for row in sorted(rows, key=lambda r: (r["rank"], r["step"])):
        ranks = out.setdefault(row["placement"], [[] for _ in range(world)])
        ranks[row["rank"]].append(row["all_reduces"] > 0)
    return out


def weights_equal(run_dir, tol=1e-7):
    """05: {placement: do the ranks' weights agree after its optimizer step?}, from the
    spread ex_no_sync.py logged."""
    rec, _ = _finished(run_dir)
    return {r["placement"]: r["weights_spread"] <= tol for r in rec.rows if "weights_spread" in r}


def check_no_sync(run_dir, predicted, equal=None):
    """05: `predicted` maps each placement of no_sync() to the micro-batches (numbered from 1)
    whose forward and backward all-reduce; `equal` maps it to whether the ranks' weights agree
    after the window's optimizer step. Both compared with what the run measured on every rank.
    A wrong answer is not named: the verdict says only that one differs, so guessing one
    placement at a time does not pay."""
    measured = all_reduced(run_dir)
    agree = weights_equal(run_dir)
    assert measured, "the run logged no micro-batches"
    world = len(next(iter(measured.values())))
    wrong = 0
    for placement, ranks in measured.items():
        synced = [[k + 1 for k, on in enumerate(row) if on] for row in ranks]
        assert all(s == synced[0] for s in synced), f"{placement}: the ranks all-reduced at different micro-batches {synced}"
        guess = predicted.get(placement)
        assert guess is not None, f"no prediction yet for {placement!r}"
        assert isinstance(guess, (list, tuple, set)) and all(isinstance(k, int) for k in guess), \
            f"{placement}: say the micro-batches as a list of numbers, such as [1, 2], not {guess!r}"
        said = (equal or {}).get(placement)
        assert isinstance(said, bool), f"no True or False yet for the weights of {placement!r}"
        wrong += sorted(guess) != synced[0]
        if world > 1:        # one rank: its weights cannot differ from another's, nothing to predict
            assert placement in agree, f"the run logged no weights for {placement!r}"
            wrong += said != agree[placement]
    assert not wrong, ("at least one answer differs from what the run measured; the checker does not say "
                       "which. Go through each placement and micro-batch: where did its forward run? Then: "
                       "did every rank end the window with the same gradient?")
    return f"all {len(measured)} placements as the run measured them on {world} rank(s)" + (
        "; at one rank the weights cannot differ, so they were not graded" if world == 1 else "")


# -- pure-function exercises of 00-08: the learner's function on cases, no launch --------------
def check_cuda_index(fn):
    """00: fn(physical, cuda_visible_devices) is the cuda:N index of a physical GPU under that
    CUDA_VISIBLE_DEVICES, as torch reads it, or raises ValueError where the GPU is hidden."""
    cases = [(2, "2,3", 0), (3, "2,3", 1), (3, "3,2", 0), (0, "0", 0), (6, "1, 4,6", 2), (4, "1, 4,6", 1),
             (0, "7,0", 1), (0, "0,9,1", 0), (2, "2gpu,3", 0), (3, "2gpu,3", 1), (0, "0,x,0", 0),
             (0, "+2,0", 1), (1, "-0,1", 1)]     # "+2" is 2, "-0" is 0
    for physical, visible, want in cases:
        try:
            got = fn(physical, visible)
        except ValueError as e:
            got = f"ValueError({e})"
        assert got == want, f"GPU {physical} with CUDA_VISIBLE_DEVICES={visible!r} is cuda:{want}, you said {got}"
    # "0,9,0": torch looks for a repeat before it cuts the list at 9, a GPU the server lacks
    # "1,,2" and "x,1": an empty entry or a word stops the list, it is not skipped
    # "0,8,1": GPU 8 is the first the server lacks; "0,-0", "2gpu,2": a repeat is of the number
    for physical, visible in [(0, "2,3"), (1, ""), (1, "0,9,1"), (1, "0,-1,1"), (1, "1,1"), (2, "2,3,2"),
                              (0, "0,9,0"), (2, "1,,2"), (1, "x,1"), (1, "0,8,1"), (0, "0,-0"),
                              (2, "2gpu,2")]:
        try:
            fn(physical, visible)
        except ValueError:
            continue
        raise AssertionError(f"GPU {physical} is not visible with CUDA_VISIBLE_DEVICES={visible!r}: expected ValueError")
    return True


_SPLITTERS = ("chunk", "tensor_split", "split", "unsafe_chunk", "unsafe_split", "split_with_sizes")


def _torch_splitter(fn):
    """The name of the torch chunk or split builtin `fn` is, else None: a function of the torch
    modules (torch.chunk, torch._VF.chunk, torch.ops.aten.chunk) or a Tensor method."""
    import torch
    name = getattr(fn, "__name__", "")
    owner = getattr(fn, "__self__", None)
    if name in _SPLITTERS and ((getattr(fn, "__module__", None) or "").startswith("torch")
                               or isinstance(owner, torch.Tensor)):
        return name
    return None


def check_dp_chunk_sizes(fn):
    """01: fn(batch, n_devices) is the list of chunk sizes DataParallel's scatter makes, found
    by a rule of the learner's own. While fn runs, a profile hook watches each call that
    Python code makes to a C function, in this thread (sys.setprofile) and in threads fn
    starts (threading.setprofile): a direct call of torch's chunk or split fails it, and so
    does a function that changes the hook. This is a guard against the obvious shortcut,
    not a sandbox: a C function called from C (map, functools.partial, operator.methodcaller)
    makes no event to watch."""
    import sys
    import threading

    import torch
    wants = {(batch, n): [len(c) for c in torch.empty(batch).chunk(n)]
             for batch in range(1, 40) for n in range(1, 9)}
    seen = []

    def watch(frame, event, arg):
        name = _torch_splitter(arg) if event == "c_call" and not seen else None
        if name:
            seen.append(name)

    before, before_threads = sys.getprofile(), threading.getprofile()
    for (batch, n), want in wants.items():
        threading.setprofile(watch)
        sys.setprofile(watch)
        try:
            got = fn(batch, n)
            changed = sys.getprofile() is not watch or threading.getprofile() is not watch
        finally:
            sys.setprofile(before)
            threading.setprofile(before_threads)
        assert not changed, "leave the profile hook alone: your function changed sys.setprofile"
        assert not seen, f"write the rule yourself: your function called torch's {seen[0]}"
        assert got is not None and list(got) == want, \
            f"batch {batch} on {n} devices: DP makes {want}, you said {got}"
    return True


_AUTOGRAD_NAMES = {"backward", "autograd", "requires_grad", "requires_grad_", "enable_grad",
                   "set_grad_enabled", "vjp", "jacrev", "jacfwd", "functorch", "run_backward"}
_AUTOGRAD_DIRS = ("torch/autograd/", "torch/_functorch/", "torch/func/")


def _autograd_names(fn):
    """The autograd names fn's source uses as names: comments and strings do not count."""
    import inspect
    import io
    import textwrap
    import tokenize
    try:
        text = textwrap.dedent(inspect.getsource(fn))
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (OSError, TypeError, tokenize.TokenError, IndentationError, SyntaxError):
        return []      # no source to read (a builtin, a lambda mid-line): the run-time watch still guards
    names = [t.string for t in tokens if t.type == tokenize.NAME]
    found = [n for n in names if n in _AUTOGRAD_NAMES]
    found += ["torch.func" for a, b, c in zip(names, names[1:], names[2:]) if (a, b) == ("torch", "func")]
    found += ["torch.func" for a, b in zip(tokens, tokens[1:]) if (a.string, b.string) == (".", "func")]
    return found


def _asks_autograd(fn, *args):
    """fn(*args) with autograd off, and the first call fn made into torch's autograd (torch.autograd,
    torch.func, torch._functorch: backward, grad, vjp, set_grad_enabled ...), else None. A profile
    hook watches each Python call in this thread and in threads fn starts. A guard against the
    obvious routes, not a sandbox."""
    import sys
    import threading

    import torch
    seen = []

    def watch(frame, event, arg):
        if seen:
            return
        if event == "call":
            path = frame.f_code.co_filename.replace("\\", "/")
            if any(d in path for d in _AUTOGRAD_DIRS):
                seen.append(frame.f_code.co_name)
        elif event == "c_call" and getattr(arg, "__name__", "") == "run_backward":
            seen.append("run_backward")

    before, before_threads = sys.getprofile(), threading.getprofile()
    with torch.no_grad():    # autograd off while fn runs
        threading.setprofile(watch)
        sys.setprofile(watch)
        try:
            got = fn(*args)
            changed = sys.getprofile() is not watch or threading.getprofile() is not watch
        finally:
            sys.setprofile(before)
            threading.setprofile(before_threads)
    assert not changed, "leave the profile hook alone: your function changed sys.setprofile"
    return got, (seen[0] if seen else None)


def check_weights(fn):
    """02: fn(batch, n_devices) is each sample's weight in DataParallel's mean of per-device
    means, as autograd finds it. The answer must predict them: asking autograd is refused, by
    the names fn's source uses and by a watch on its calls into torch's autograd."""
    import torch
    for word in _autograd_names(fn):
        raise AssertionError(f"your function uses {word}: the exercise is to predict each weight "
                             f"from DP's split, not to let autograd compute it")
    torch.manual_seed(0)
    for batch in range(1, 25):
        for n in range(1, 9):
            losses = torch.rand(batch, dtype=torch.float64, requires_grad=True)
            torch.stack([c.mean() for c in losses.chunk(n)]).mean().backward()   # DP's split, mean of means
            want = [round(w, 4) for w in losses.grad.tolist()]
            try:
                got, asked = _asks_autograd(fn, batch, n)
            except RuntimeError as e:
                raise AssertionError(f"batch {batch} on {n} devices: your function failed with autograd off "
                                     f"({str(e).splitlines()[0]}): predict the weights, do not ask autograd") from None
            assert not asked, (f"your function called torch's autograd ({asked}): the exercise is to predict "
                               f"each weight from DP's split, not to let autograd compute it")
            assert got is not None and len(got) == batch, \
                f"batch {batch} on {n} devices: want one weight per sample, {want}; you said {got}"
            assert torch.allclose(torch.as_tensor(got, dtype=torch.float64), losses.grad), \
                f"batch {batch} on {n} devices: the weights are {want}; you said {got}"
    return True


def check_scaled(fn):
    """03b: fn(per_device_batch, world_size, base_batch, base_lr) -> (global batch, lr by the
    linear scaling rule)."""
    cases = [((32, 1, 32, 0.1), 32, 0.1), ((32, 8, 256, 0.1), 256, 0.1), ((64, 4, 32, 0.05), 256, 0.4),
             ((48, 1, 32, 0.1), 48, 0.15), ((16, 2, 64, 0.1), 32, 0.05),   # k = 1.5, k = 0.5
             ((48, 8, 32, 0.1), 384, 1.2)]          # the notebook's own example (8 x 48), not one of Goyal et al.'s
    for args, want_batch, want_lr in cases:
        global_batch, lr = fn(*args)
        assert global_batch == want_batch, f"scaled{args}: {global_batch} is not this job's global batch"
        assert abs(lr - want_lr) < 1e-12, f"scaled{args}: with lr {lr:g} an epoch does not go as far as the recipe's"
    return True


def check_merge(fn):
    """04: fn([(n_r, mean_r, var_r), ...]) -> (mean, var) of the concatenated batch, also for
    data far from 0 next to its spread (around 1e8)."""
    import torch
    g = torch.Generator().manual_seed(0)
    for offset in (0.0, 1e8):                 # data around 0, and far from 0 next to its spread
        chunks = [torch.randn(n, generator=g, dtype=torch.float64) * s + m + offset
                  for n, s, m in ((4, 1.0, 0.0), (4, 2.0, 3.0), (7, 0.5, -1.0))]
        parts = [(len(c), c.mean().item(), c.var(unbiased=False).item()) for c in chunks]
        whole = torch.cat(chunks)             # the concatenated batch
        mean, var = fn(parts)
        want_mean, want_var = whole.mean().item(), whole.var(unbiased=False).item()
        assert abs(mean - want_mean) <= 1e-9 * max(1.0, abs(want_mean)), \
            f"data around {offset:g}: the mean is off by {mean - want_mean:.3g}"
        assert abs(var - want_var) < 1e-6 * want_var, \
            f"data around {offset:g}: the variance is off by {var - want_var:.3g} (of {want_var:.3g})"
    return True


def check_predict(fn):
    """06: fn(n, compute_s, grad_bytes, alpha, beta) is the alpha-beta model's speed-up of n
    ranks (a ring all-reduce of the gradients after the compute), within 1e-6."""
    cases = [  # (n, compute_s, grad_bytes, alpha, beta) -> expected
        ((1, 0.1, 100e6, 1e-5, 10e9), 1.0),
        ((2, 0.1, 100e6, 1e-5, 10e9), 2 * 0.1 / (0.1 + 2 * 1e-5 + 1.0 * 100e6 / 10e9)),
        ((8, 0.1, 100e6, 1e-5, 10e9), 8 * 0.1 / (0.1 + 14 * 1e-5 + 1.75 * 100e6 / 10e9)),
        ((8, 0.002, 1e6, 5e-4, 0.5e9), 8 * 0.002 / (0.002 + 14 * 5e-4 + 1.75 * 1e6 / 0.5e9)),
    ]
    for args, want in cases:
        got = fn(*args)
        assert abs(got - want) <= 1e-6 * want, f"predict{args}: the model gives {want:.4g}, you said {got}"
    return True


def check_first_failure(fn, crashed, hung):
    """07: fn(result) is (rank, first line of its message) of a failed run's root cause, from
    its result.json (`crashed`), and None for a run that did not fail with one (`hung`)."""
    got = fn(crashed)
    assert got is not None and got[0] == crashed["failure"]["rank"], \
        f"got {got!r}: the root cause is rank {crashed['failure']['rank']}'s failure"
    assert got[1].strip() == crashed["failure"]["message"].splitlines()[0].strip(), \
        f"got {got!r}: the message's first line, exactly that line"
    assert fn(hung) is None, f"for a run that ended {hung.get('status')} it said {fn(hung)!r}, not None"
    return True


def check_parser(make):
    """07: make() is an ArgumentParser whose --sync-bn is off by default, on with --sync-bn and
    off with --no-sync-bn (not type=bool: bool("False") is True)."""
    p = make()
    assert p is not None, "make_parser() returned None: return the ArgumentParser"
    for argv, want in (([], False), (["--sync-bn"], True), (["--no-sync-bn"], False)):
        try:
            got = p.parse_args(argv).sync_bn
        except SystemExit:
            raise AssertionError(f"the parser refuses {argv}") from None
        assert got is want, f"{argv}: sync_bn is {got!r}, not {want}"
    return True


def check_ranks(global_rank, device_for):
    """08: global_rank(node_rank, local_rank, procs_per_node) and device_for(env) on every rank
    of several layouts (3 nodes x 4, 2 x 8, 4 x 2), against multinode.expected_table; env is
    what torchrun sets (RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE...)."""
    from ..launcher import multinode
    for nodes, per in ((3, 4), (2, 8), (4, 2)):
        for r in multinode.expected_table(nodes=nodes, procs_per_node=per):
            got = global_rank(r["NODE_RANK"], r["LOCAL_RANK"], per)
            assert got == r["RANK"], (f"{nodes} nodes x {per}: node {r['NODE_RANK']}, local rank "
                                      f"{r['LOCAL_RANK']} is rank {r['RANK']}, you said {got}")
            env = {"RANK": str(r["RANK"]), "LOCAL_RANK": str(r["LOCAL_RANK"]), "GROUP_RANK": str(r["NODE_RANK"]),
                   "WORLD_SIZE": str(nodes * per), "LOCAL_WORLD_SIZE": str(per), "GROUP_WORLD_SIZE": str(nodes),
                   "ROLE_RANK": str(r["RANK"]), "ROLE_WORLD_SIZE": str(nodes * per), "MASTER_ADDR": "node0",
                   "MASTER_PORT": "29500"}
            got = device_for(env)
            assert got == f"cuda:{r['LOCAL_RANK']}", (f"{nodes} nodes x {per} GPUs, rank {r['RANK']} (local rank "
                                                      f"{r['LOCAL_RANK']}): cuda:{r['LOCAL_RANK']}, you said {got!r}")
    return True


JOB_WANT = {"nodes": 4, "gpus_per_node": 8, "partition": "gpu", "ifname": "ib0", "args": ["ddp_basic.py", "--epochs", "10"]}


def _sbatch_options(text):
    """The #SBATCH options Slurm reads: those before the first command line."""
    opts = {}
    for line in text.splitlines()[1:]:
        s = line.strip()
        if s and not s.startswith("#"):
            break
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:[= ](\S+))?", s)
        if m:
            opts[m.group(1)] = m.group(2)
    return opts


def _run_job(text, job_id):
    """bash runs the batch script on a pretend 4-node allocation, with scontrol and srun as
    stand-ins; srun prints what it would start, one word a line, and the NCCL interface it sees."""
    import os
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        job = Path(d) / "job.sbatch"
        job.write_text(text)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_"))}
        env.update(SLURM_JOB_NODELIST="gpu[07-10]", SLURM_NNODES="4", SLURM_JOB_ID=str(job_id),
                   SLURM_CPUS_PER_TASK="64")
        env["BASH_FUNC_scontrol%%"] = '() {  printf "gpu07\\ngpu08\\ngpu09\\ngpu10\\n"\n}'
        env["BASH_FUNC_srun%%"] = '() {  echo "IFNAME=${NCCL_SOCKET_IFNAME:-}"; for w in "$@"; do echo "ARG $w"; done\n}'
        out = subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True, timeout=60, cwd=d)
    assert out.returncode == 0, f"bash ran the script and it failed: {out.stderr.strip()[-300:]}"
    lines = out.stdout.splitlines()
    words = [l[4:] for l in lines if l.startswith("ARG ")]
    ifname = [l[7:] for l in lines if l.startswith("IFNAME=")]
    assert words, "the script never calls srun"
    return words, (ifname or [""])[0]


def _torchrun_flags(words):
    """srun's words after torchrun (or python -m torch.distributed.run): ({flag: value}, script args)."""
    if "torch.distributed.run" in words:
        rest = words[words.index("torch.distributed.run") + 1:]
    else:
        assert "torchrun" in words, f"srun does not start torchrun: {' '.join(words)}"
        rest = words[words.index("torchrun") + 1:]
    flags = {}
    while rest and rest[0].startswith("--"):
        key, _, value = rest[0][2:].replace("_", "-").partition("=")
        if value or key in ("standalone",):
            rest = rest[1:]
        else:
            value, rest = rest[1], rest[2:]
        flags[key] = value
    return flags, rest


def check_job(text):
    """08: the sbatch script `text` runs ddp_basic.py --epochs 10 on 4 nodes of 8 GPUs on
    partition gpu, with NCCL on interface ib0 and a rendezvous on the first node at a port of its
    own job. Judged by what Slurm reads and what bash runs: the #SBATCH options, then the script
    run on a pretend allocation twice, with two job ids."""
    assert isinstance(text, str) and text.startswith("#!"), "give the text of an sbatch script (sbatch_script returns it)"
    opts = _sbatch_options(text)
    for key, want in (("nodes", "4"), ("gpus-per-node", "8"), ("partition", "gpu"), ("ntasks-per-node", "1")):
        assert opts.get(key) == want, f"#SBATCH --{key} is {opts.get(key)!r}, not {want}"
    ports = []
    for job_id in (4242, 4243):
        words, ifname = _run_job(text, job_id)
        flags, script_args = _torchrun_flags(words)
        assert ifname == "ib0", f"srun sees NCCL_SOCKET_IFNAME={ifname!r}, not ib0: export it in the script"
        assert flags.get("nnodes") == "4", f"torchrun got --nnodes {flags.get('nnodes')}, not 4 (the job's nodes)"
        assert flags.get("nproc-per-node") == "8", f"torchrun got --nproc-per-node {flags.get('nproc-per-node')}, not 8"
        assert flags.get("rdzv-backend") == "c10d", "the agents need --rdzv-backend c10d"
        host, _, port = (flags.get("rdzv-endpoint") or "").rpartition(":")
        assert host == "gpu07", f"the rendezvous is at {flags.get('rdzv-endpoint')!r}, not on the first node, gpu07"
        ports.append(port)
        assert script_args == JOB_WANT["args"], f"torchrun runs {' '.join(script_args)!r}, not 'ddp_basic.py --epochs 10'"
    assert ports[0] != ports[1], (f"jobs 4242 and 4243 both meet on port {ports[0]}: two jobs on one first node "
                                  f"would share a store; leave port= out, the job id picks one")
    return True


# -- lesson 09: the bucketed hook ---------------------------------------------------------
_BUCKETED_HOOK = '''    def hook(self, p):
        i, offset = self.where[p]
        self.flat[i][offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        self.ready[i] += 1
%s

    def finish(self):
        for i, bucket in enumerate(self.buckets):
            %s
            self.flat[i] /= dist.get_world_size()
            for p in bucket:
                offset = self.where[p][1]
                p.grad.copy_(self.flat[i][offset:offset + p.numel()].view_as(p))
        self.ready = [0] * len(self.buckets)
        self.works = [None] * len(self.buckets)
'''


_WHEN_FULL = ("        if self.ready[i] == len(self.buckets[i]):    # the bucket's last gradient arrived\n"
              "            %s")
_WHEN_ALL = ("        if sum(self.ready) == len(self.where):    # held back: the model's last gradient\n"
             "            for i in range(len(self.buckets)):\n"
             "                %s")


def bucketed_solution(path, starter=None, blocking=False, waiting=False, late=False, keep_ready=False):
    """09: write a solution of the bucketed-hook exercise to `path`: the starter file with
    `hook` and `finish` written. Wrong ones, which check_bucketed must reject: blocking=True
    (the hook's all-reduce is async_op=False), waiting=True (async_op=True, then .wait() in
    the hook): either way backward stalls on the network; late=True (async, but every
    bucket held back until the whole model's last gradient: stage (b)'s timing, no overlap);
    keep_ready=True (finish() never resets self.ready: step 2 launches nothing)."""
    text = Path(starter or script("bucketed_exercise.py")).read_text()
    head = text[:text.index("    def hook(self, p):")]
    launch, wait = "self.works[i] = dist.all_reduce(self.flat[i], async_op=True)", "self.works[i].wait()"
    if blocking:
        launch, wait = "dist.all_reduce(self.flat[i])", "pass"
    if waiting:
        launch, wait = "dist.all_reduce(self.flat[i], async_op=True).wait()", "pass"
    body = _BUCKETED_HOOK % ((_WHEN_ALL if late else _WHEN_FULL) % launch, wait)
    if keep_ready:
        body = body.replace("        self.ready = [0] * len(self.buckets)\n", "")
    Path(path).write_text(head + body)
    return path


def bucket_layout(param_bytes, cap):
    """09: the exercise's buckets, as parameter indices: reverse registration order, a bucket
    closed once it holds >= cap bytes (the rule DDP applies to the order it measured)."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(param_bytes))):
        current.append(i)
        size += param_bytes[i]
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def check_bucketed(stage):
    """09: a stage (d) result of ddp_scratch.check_stage (the learner's Bucketed beside torch
    DDP). Returns (ok, why): the weights equal DDP's after every step; one all-reduce per
    bucket per step, of exactly the bucket's elements (the layout is computed here from the
    parameters' sizes and the cap, not read from the learner's object); each started during
    backward, in the hook of its bucket's last gradient (the harness counts the gradients
    finished at every call; its hook runs after the learner's, so a bucket whose last
    gradient is the k-th to finish is due when k - 1 are counted); and backward never waited
    for one (neither async_op=False nor a wait() in the hook)."""
    layout = bucket_layout(stage["param_bytes"], stage["bucket_bytes"])
    elements = [sum(stage["param_bytes"][i] for i in b) // 4 for b in layout]   # fp32 per bucket
    expected = sorted(elements)
    n = len(expected)
    for i, st in enumerate(stage["steps"], 1):
        if st.get("error"):
            hint = (" Step 1 passed, so something step 1 left behind broke step 2: reset self.ready"
                    " and self.works at the end of finish()" if i > 1 else "")
            return False, f"step {i}: your Bucketed raised {st['error']}.{hint}"
        if not st["allclose"]:
            hint = (": no all_reduce was called, so each rank trained on its own gradients" if not st["calls"]
                    else ": did finish() divide the summed bucket by the world size? torch DDP averages")
            return False, f"step {i}: weights differ from torch DDP by {st['max_abs_diff']:.2e}{hint}"
        if st["calls"] != n:
            return False, f"step {i}: {st['calls']} all_reduce calls, expected one per bucket ({n})"
        if st["numels"] != expected:
            return False, (f"step {i}: all-reduced tensors of {st['numels']} elements, expected the "
                           f"buckets' {expected}: one flat tensor per bucket, as laid out")
        if st["calls_in_backward"] != n:
            return False, f"step {i}: only {st['calls_in_backward']} of {n} all-reduces started during backward"
        finished = {p: k for k, p in enumerate(st["ready_order"])}   # parameter -> its place in backward
        due = sorted((max(finished.get(p, len(finished)) for p in b), e) for b, e in zip(layout, elements))
        launched = sorted(tuple(x) for x in st["launches"])
        if launched != due:
            return False, (f"step {i}: the all-reduces started when {[k + 1 for k, _ in launched]} gradients "
                           f"were ready, the buckets were complete at {[k + 1 for k, _ in due]}: start each "
                           f"bucket's all-reduce in the hook of its own last gradient, not later")
        if st["blocking_in_backward"]:
            return False, (f"step {i}: backward waited for {st['blocking_in_backward']} all-reduce(s) "
                           f"(blocking: async_op=False, or wait() in the hook); use async_op=True "
                           f"and wait in finish()")
    return True, (f"equal to torch DDP for {len(stage['steps'])} steps, {n} buckets, every all-reduce "
                  f"async in backward, as soon as its bucket was complete")


GUARD_EXIT = "the script exited with status "   # how the rank's guard records a SystemExit


def _refusal(failure, script):
    """None if a failed run's first failure is a refusal that says why, else what it is.
    A refusal: a SystemExit that carries a message (sys.exit(text), raise SystemExit(text)),
    or an exception with a message raised by a `raise` or `assert` line of the script itself.
    A NameError on an edited line, a failed import, an error inside torch, a bare
    sys.exit(1) or an assert without a message are not."""
    message = (failure or {}).get("message") or "no error was recorded"
    kind, colon, text = message.partition(": ")
    if not colon:                                # a rank that died without a Python exception
        return message
    if kind == "SystemExit":
        reason = text.removeprefix(GUARD_EXIT)
        if reason.lstrip("-").isdigit():
            return f"it exited with status {reason} and no message: say why, raise SystemExit(message)"
        return None
    frames = re.findall(r'^  File "(.*)", line \d+, in .*\n    (.*)$', failure.get("traceback", ""), re.M)
    if not text.strip():
        return f"{kind} without a message: say why in it (assert ..., message)"
    if not frames or Path(frames[-1][0]).name != Path(script).name or \
            not re.match(r"(raise|assert)\b", frames[-1][1]):
        return f"it crashed with {kind}: {text}"
    return None


def check_global_batch(run_dir):
    """11: every optimizer step saw the global batch the script asked for (summed over
    ranks), at the run's world size. Reads `global_batch_asked` and `micro_batch` (logged
    once, before training) and each rank's per-step count (`samples`, or `windows` in
    gpt_ddp.py). Where no whole number of micro-batches per rank gives the global batch
    (48 samples in micro-batches of 4 on 5 ranks), the right answer is to refuse: a run
    that logged those two numbers and then ended before its first optimizer step with a
    refusal that says why (see _refusal) is accepted then; any other failure is not."""
    rec = runs.load(run_dir)
    world = rec.config["world_size"]
    message = (rec.result or {}).get("message")
    head = next((row for row in rec.rows if "global_batch_asked" in row), None)
    assert head or rec.status == "ok", (
        f"the run ended {rec.status} before it logged the global batch it asked for (the metrics.log(0, "
        f"global_batch_asked=..., micro_batch=...) line), so the checker cannot tell whether {world} "
        f"rank(s) can give it; refuse after that line, at # EXERCISE: {message}")
    assert head, "the run did not log the global batch it asked for (global_batch_asked)"
    asked, micro = head["global_batch_asked"], head.get("micro_batch")
    per_step = defaultdict(dict)                 # step -> {rank: samples this rank used}
    for row in rec.rows:
        n = row.get("samples", row.get("windows"))
        if n is not None:
            per_step[row["step"]][row["rank"]] = n
    if rec.status != "ok":
        assert micro and asked % (micro * world), (f"the run ended {rec.status}, but {asked} samples split into "
                                                   f"micro-batches of {micro} on {world} rank(s): {message}")
        assert not per_step, f"the run ended {rec.status} after {len(per_step)} step(s), not before training: {message}"
        why_not = _refusal((rec.result or {}).get("failure"), rec.config.get("script", ""))
        assert why_not is None, (f"the run failed, but not with a refusal that says why ({why_not}); refuse with "
                                 f"raise SystemExit(message) or raise ValueError(message): {message}")
        return (f"refused before training, as it should: {asked} samples do not split into "
                f"micro-batches of {micro} on {world} ranks")
    assert per_step, "the run logged no training steps"
    for step, by_rank in sorted(per_step.items()):
        assert sorted(by_rank) == list(range(world)), f"step {step}: not every rank logged it"
        total = sum(by_rank.values())
        assert total == asked, (f"step {step}: {total} samples over {world} rank(s), not the "
                                f"{asked} asked for (ranks x micro-batch x accumulation steps)")
    return f"{len(per_step)} steps of {asked} samples each on {world} rank(s)"


# -- lesson 10: the fp16 step that trains too slowly ---------------------------------------
def _recording_scaler(init_scale=2.0 ** 16):
    """A GradScaler("cpu") that notes which of its four calls were made, in order."""
    import torch

    class Recording(torch.amp.GradScaler):
        def __init__(self):
            super().__init__("cpu", init_scale=init_scale)
            self.calls = []

        def scale(self, outputs):
            self.calls.append("scale")
            return super().scale(outputs)

        def unscale_(self, optimizer):
            self.calls.append("unscale_")
            return super().unscale_(optimizer)

        def step(self, optimizer, *args, **kwargs):
            self.calls.append("step")
            return super().step(optimizer, *args, **kwargs)

        def update(self, new_scale=None):
            self.calls.append("update")
            return super().update(new_scale)
    return Recording()


def _start():
    """The exercise's model (seed 0) and batch (8 samples, seed 23: enough for a gradient
    whose norm clipping changes; fp16 convolutions are slow on CPU)."""
    import torch

    from ..rank import data, models
    x, y = data.shapes(8, seed=23).tensors
    torch.manual_seed(0)
    return models.SmallCNN(norm=False), x, y


def _reference(model, x, y, max_norm):
    """The reference step on `model`: the true gradient (fp16 autocast, no scaler), clipped to
    max_norm, one SGD step (lr 0.1). Returns the gradient's norm before and after clipping."""
    import torch
    import torch.nn.functional as F
    with torch.autocast("cpu", dtype=torch.float16):
        F.cross_entropy(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    clipped = sum(p.grad.norm() ** 2 for p in model.parameters()) ** .5
    return norm.item(), clipped.item()


def stepped_norm(fn, max_norm=0.1, init_scale=2.0 ** 16):
    """10: the norm of the gradient the optimizer steps with, in one step of fn (the
    checker's start and batch), with a GradScaler whose scale starts at init_scale."""
    import torch
    model, x, y = _start()
    opt, seen = torch.optim.SGD(model.parameters(), lr=0.1), []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(
        torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm().item()))
    fn(model, opt, _recording_scaler(init_scale), x, y, max_norm)
    assert seen, "the step never called the optimizer's step()"
    return seen[0]


def check_train_step(fn, max_norm=0.1):
    """10: one step of fn(model, opt, scaler, x, y, max_norm) (fp16 autocast on CPU, a
    GradScaler, clipping) against the reference step: the true gradient, clipped to
    max_norm, one SGD step. The step must use the scaler it is given (scale, unscale_,
    step, update, once each, in that order): without it fp16 gradients can underflow, even
    where this batch's do not. Raises AssertionError with one sentence saying what is wrong."""
    import copy

    import torch
    model, x, y = _start()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _recording_scaler()
    fn(model, opt, scaler, x, y, max_norm)
    wanted = ["scale", "unscale_", "step", "update"]
    assert scaler.calls == wanted, (
        f"the step made the GradScaler calls {scaler.calls}, not {wanted}: fp16 needs the scaler "
        "(scale the loss before backward, unscale_ before clipping, scaler.step, scaler.update)")
    norm, clipped = _reference(reference, x, y, max_norm)
    assert norm > max_norm, "the test needs a gradient that clipping changes"
    moved = sum((p - q).norm() ** 2 for p, q in zip(model.parameters(), reference.parameters())) ** .5
    step = 0.1 * clipped
    assert moved < 1e-2 * step, f"the step differs from the reference by {moved / step:.0%} of its size"
    return True


def check_too_small_by(too_small_by, slow_step, max_norm=0.1, scales=(2.0 ** 16, 2.0 ** 10)):
    """10: too_small_by(S) says how many times smaller than the reference step's gradient the
    gradient slow_step steps with is, when the GradScaler's scale is S. Compared, within 1%,
    with the ratio measured at each scale in `scales` (two, so a number read off one run
    does not pass). Raises AssertionError with one sentence saying what is wrong."""
    model, x, y = _start()
    _, clipped = _reference(model, x, y, max_norm)
    for S in scales:
        measured = clipped / stepped_norm(slow_step, max_norm, init_scale=S)
        said = too_small_by(S)
        assert said is not None and abs(said - measured) <= 0.01 * measured, (
            f"with the scale S = {S:,.0f} the step was {measured:,.1f}x too small; too_small_by({S:,.0f}) "
            f"returns {said}")
    return True
