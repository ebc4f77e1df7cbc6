"""The checks of lesson 11 (the capstone GPT), as functions so that tests can plant the bugs
they must catch: a model that ignores its context or sees the future, throughput figures
the wall clock does not back, no speed-up from N ranks, FSDP2 that trains another model.
Each raises AssertionError saying what is wrong, or returns figures. The grader of 11's
exercise is graders/l11.py."""
import statistics

import torch


def influence(model, x, cut, seed=1):
    """How far a model's logits move when the bytes of x are replaced by random ones: from
    position `cut` on (then positions before it must not move: `leak`), or before it (then
    positions from cut + 1 on, which see those bytes only 2 or more positions back, must: `past`)."""
    random = lambda t: torch.randint(0, 256, t.shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logits = model(x)
        later, earlier = x.clone(), x.clone()
        later[:, cut:] = random(later[:, cut:])
        earlier[:, :cut] = random(earlier[:, :cut])
        leak = (model(later)[:, :cut] - logits[:, :cut]).abs().max().item()
        past = (model(earlier)[:, cut + 1:] - logits[:, cut + 1:]).abs().max().item()
    return leak, past


def check_attention(model, x, cut, min_past=0.05):
    """Causal, and using context beyond the byte it predicts from: no logit moves when later
    bytes change, and logits 2 or more positions after a change move by more than min_past
    (a model that attends only to its own position, a bigram through attention, moves 0)."""
    leak, past = influence(model, x, cut)
    assert leak < 1e-5, f"changing bytes {cut}.. moved earlier logits by {leak:.2e}: a position sees later bytes"
    assert past > min_past, (f"changing bytes before {cut} moved the logits at {cut + 1}.. by {past:.2e} only: "
                             f"the model does not use bytes 2 or more positions back")
    return leak, past


def check_is_causal(causal_mask, T=64, heads=4, d_head=48, seed=0):
    """SDPA with is_causal=True gives what an explicit causal mask gives: the same output,
    without a (T, T) mask tensor, which on GPUs rules out the flash kernel. Returns the max diff."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, heads, T, d_head, generator=g) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    diff = (sdpa(q, k, v, is_causal=True) - sdpa(q, k, v, attn_mask=causal_mask(T, q.device))).abs().max().item()
    assert diff < 1e-6, (f"is_causal=True and the mask causal_mask({T}) differ by {diff:.2e}: the mask is not "
                         f"'each position sees itself and the bytes before it'")
    return diff


def check_decay_groups(model, opt):
    """nanoGPT's weight decay: every matrix (2 or more dims) decayed, no bias or LayerNorm gain."""
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert len(decay) == len(list(model.parameters())), "some parameters are in no param_group"
    wrong = [n for n, p in model.named_parameters() if (decay[id(p)] > 0) != (p.dim() >= 2)]
    assert not wrong, (f"weight decay on {wrong[:3]}...: nanoGPT decays the matrices only, "
                       f"not biases or LayerNorm gains" if wrong else "")
    return sum(p.numel() for p in model.parameters() if decay[id(p)] > 0)


def saved_bytes(model, x, y):
    """Bytes of the activations autograd keeps for the backward of one forward and loss on x, y:
    every tensor saved for the backward, each storage once, the parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}
    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    return sum(seen.values())


def check_checkpointing(model, x, y):
    """Activation checkpointing (model.checkpoint) keeps less than half the activations, and
    the gradients it gives are the ones without it."""
    grads, kept = {}, {}
    for on in (False, True):
        model.checkpoint = on
        model.zero_grad()
        kept[on] = saved_bytes(model, x, y)
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        grads[on] = [p.grad.clone() for p in model.parameters()]
    model.checkpoint = False
    assert kept[True] < kept[False] / 2, f"checkpointing kept {kept[True]:,} bytes of {kept[False]:,}: it did not act"
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(grads[False], grads[True])), \
        "the gradients with checkpointing differ"
    return kept[False], kept[True]


# /proc/cpuinfo's "cpu MHz" is the clock of the moment, or in a virtual machine the nominal one,
# and turbo runs a core up to about twice a nominal base clock (2.0 -> 3.8 GHz on recent server
# parts). Measured on this course's Zen 4 VM (2596 MHz reported): one thread's 256-1024 matmuls
# reached 87-94 GFLOP per CPU-second in fp32 against 83 at 32 FLOP/cycle, and 188-203 in bf16
# against 166 at 64: 1.1-1.2x. A peak from cpufreq's cpuinfo_max_freq has no headroom.
NOMINAL_CLOCK_HEADROOM = 2.0


def check_peak(peak, cpu_rates, clock_from=None, cores=1):
    """No matmul can run faster than the hardware's peak. `cpu_rates`: FLOP per CPU-second of
    the process (gpt_ddp.achievable_rate's second list), so load, which takes cores away, cannot
    slow them; they are compared with the peak per core, peak / cores. A peak below the fastest
    is wrong (too slow a clock or unit). With the clock from /proc/cpuinfo (clock_from not naming
    cpuinfo_max_freq), a turbo clock may beat it by up to NOMINAL_CLOCK_HEADROOM; a unit 4x too
    small (8 FLOP/cycle for 32) still fails. A peak too high is not caught. Returns fastest / (peak / cores)."""
    headroom = 1.0 if clock_from and "cpuinfo_max_freq" in clock_from else NOMINAL_CLOCK_HEADROOM
    fastest, per_core = max(cpu_rates), peak / cores
    assert fastest <= per_core * headroom, (
        f"a matmul ran at {fastest / 1e9:.1f} GFLOP per CPU-second, above {headroom:g}x the peak per core "
        f"of {per_core / 1e9:.1f}: the peak is wrong")
    return fastest / per_core


def check_throughput(rows, world, global_batch, block, flops_per_token, peak):
    """The run's logged tokens/s and MFU against what the run directory alone says: tokens per
    rank per step from the global batch and world size (config), FLOPs per token counted by
    FlopCounterMode, and the wall-clock time between a rank's rows (each row's `time` is
    when it was logged). The step timer runs inside that gap and (median) over most of it."""
    tokens = global_batch // world * block
    t = {(r["rank"], r["step"]): r["time"] for r in rows}
    gaps = [(r, t[r["rank"], r["step"]] - t[r["rank"], r["step"] - 1]) for r in rows if r["step"] > 1]
    for r, gap in gaps:
        assert r["windows"] * block == tokens, f"rank {r['rank']} step {r['step']}: {r['windows']} windows, not {tokens // block}"
        assert r["tokens_per_s"] * gap >= tokens * (1 - 1e-6), (
            f"rank {r['rank']} step {r['step']}: {r['tokens_per_s']:.0f} tokens/s, but {tokens} tokens took {gap:.3f} s")
        if peak:
            wall_mfu = flops_per_token * tokens / gap / peak
            assert wall_mfu * (1 - 1e-6) <= r["mfu"] <= 1, (r["step"], r["mfu"], wall_mfu)
    cover = statistics.median(tokens / r["tokens_per_s"] / gap for r, gap in gaps)
    assert cover > 0.5, f"the timed steps cover {cover:.0%} of the time between rows: the tokens/s are too high"
    return cover


# the N-rank step must cost each rank less than this share of the 1-rank step. With no speed-up
# each rank costs the whole 1-rank step or more (plus the all-reduce). The model predicts about
# 0.52 at 2 ranks; load raised the CPU-time step by 20 % (1 rank) to 30-47 % (2 ranks) when
# measured, and the 1-rank run comes minutes after the N-rank one: 0.85 leaves room for that.
SCALING_BOUND = 0.85


def scaling(one, many, key="cpu_s"):
    """1 rank against N from the rows of two runs: the least time of steps 2-4 on any rank (other
    programs can only add to a step's time, by taking its core or its caches). key: the ranks'
    CPU time per step (CPU ranks: it does not count the waits for a core that load causes) or
    step_s (GPUs). The model: a fixed cost per step (the step minus its micro-batches, measured
    on 1 rank) plus the micro-batches' cost, split over N ranks. Returns the figures."""
    micro_key = "micro_cpu_s" if key == "cpu_s" else "micro_s"
    rows_of = lambda rows: [r for r in rows if key in r and 1 < r["step"] <= 4]
    windows = lambda rows: {r["rank"]: r["windows"] for r in rows if "windows" in r}   # per rank per step
    n = len(windows(many))
    best = min(rows_of(one), key=lambda r: r[key])
    t1, tn = best[key], min(r[key] for r in rows_of(many))
    fixed = best[key] - best[micro_key]
    per_window = (t1 - fixed) / windows(one)[0]
    predicted = fixed + per_window * windows(many)[0]
    return {"N": n, "t1": t1, "tN": tn, "fixed": fixed, "predicted": predicted,
            "threshold": SCALING_BOUND * t1}                 # no speed-up fails it, load has room


def check_scaling(one, many, key="cpu_s"):
    """The N-rank step costs each rank less than SCALING_BOUND (0.85) x the 1-rank step: it
    fails when N ranks give no speed-up (each rank doing all the work)."""
    s = scaling(one, many, key)
    assert s["N"] > 1, "the second run has 1 rank too: no N to compare"
    assert s["tN"] < s["threshold"], (
        f"{s['N']} ranks: {s['tN'] * 1e3:.1f} ms per rank per step, not below {s['threshold'] * 1e3:.1f} ms, "
        f"{SCALING_BOUND} x 1 rank's {s['t1'] * 1e3:.1f} ms (predicted {s['predicted'] * 1e3:.1f} ms): no speed-up")
    return s


# tolerances for FSDP2 against DDP (--fsdp-check), from the same seed on the same windows:
# (loss in nats, gradient norms relative, whole weights: |w - w_ddp| over |w_ddp - w_init|)
FSDP_TOLERANCE = {
    "fp32": (1e-5, 1e-5, 1e-4),   # the same sums in another order: measured 4e-8, 5e-7 and 2e-6
    "bf16": (1e-2, 1e-2, 0.1),    # weights gathered and used in bf16 (8 bits of mantissa): 1e-3,
}                                 # 9e-4 and 0.023 measured at 2 ranks after 3 steps


def fsdp_rows(rows):
    """variant -> step -> rank -> row, from the rows gpt_ddp.py --fsdp-check logged."""
    out = {}
    for r in rows:
        if "fsdp_variant" in r:
            out.setdefault(r["fsdp_variant"], {}).setdefault(r["step"], {})[r["rank"]] = r
    return out


def weight_distance(weights, reference, init):
    """|w - w_ref| / |w_ref - w_init| over every weight at once: how far apart two trainings
    ended, as a share of how far training moved the weights."""
    diff = sum(((weights[k] - reference[k]).double() ** 2).sum() for k in reference) ** 0.5
    moved = sum(((reference[k] - init[k]).double() ** 2).sum() for k in reference) ** 0.5
    return (diff / moved).item()


def check_same_training(ddp, other, weights, ddp_weights, init, precision="fp32"):
    """`other` (one variant's rows: step -> rank -> row) trained the model DDP trained, within
    the tolerances of its precision: each step's loss on every rank, the gradient norm before
    the clip and the norm after it, and the weights at the end. Returns the largest differences."""
    tol_loss, tol_norm, tol_weights = FSDP_TOLERANCE[precision]
    assert sorted(other) == sorted(ddp) and all(sorted(other[s]) == sorted(ddp[s]) for s in ddp), "steps or ranks missing"
    worst = {"loss": 0.0, "grad_norm": 0.0, "clipped_norm": 0.0}
    for s in ddp:
        for r, d in ddp[s].items():
            o = other[s][r]
            worst["loss"] = max(worst["loss"], abs(o["check_loss"] - d["check_loss"]))
            worst["grad_norm"] = max(worst["grad_norm"], abs(o["check_grad_norm"] / d["check_grad_norm"] - 1))
            worst["clipped_norm"] = max(worst["clipped_norm"], abs(o["clipped_norm"] / d["clipped_norm"] - 1))
            assert abs(o["check_loss"] - d["check_loss"]) < tol_loss, f"step {s}, rank {r}: loss {o['check_loss']:.6f}, DDP {d['check_loss']:.6f}"
            for key in ("check_grad_norm", "clipped_norm"):
                assert abs(o[key] / d[key] - 1) < tol_norm, (
                    f"step {s}, rank {r}: {key} {o[key]:.6f}, DDP {d[key]:.6f}: not the gradient DDP clipped")
    worst["weights"] = weight_distance(weights, ddp_weights, init)
    assert worst["weights"] < tol_weights, f"the weights ended {worst['weights']:.2e} apart (relative), over {tol_weights:g}"
    return worst


def check_fsdp2(rows, weights, init, world, layers, accum):
    """gpt_ddp.py --fsdp-check's claims: FSDP2 in fp32 trains DDP's model up to rounding, and
    with bf16 compute within bf16's rounding; its clip issues a collective where DDP's issues
    none; each rank holds about 1/W of the weights; each block is its own unit (step 1's
    collectives); and the local-clip mistake fails the same comparison (it must, at 2 ranks
    or more). Returns the figures."""
    v = fsdp_rows(rows)
    assert sorted(v) == ["ddp", "fsdp2_bf16", "fsdp2_fp32", "fsdp2_local_clip"], sorted(v)
    ddp, fp32, bf16, local = v["ddp"], v["fsdp2_fp32"], v["fsdp2_bf16"], v["fsdp2_local_clip"]
    assert all(sorted(ddp[s]) == list(range(world)) for s in ddp), "a rank logged no check row"
    calls = lambda rows: {tuple(sorted(r["clip_collectives"].items())) for s in rows for r in rows[s].values()}
    assert calls(ddp) == {()}, f"DDP's clip issued collectives: {calls(ddp)}"          # local: no collective
    if world > 1:
        assert calls(fp32) == calls(bf16) == {(("c10d::allreduce_", 1),)}, (calls(fp32), calls(bf16))
        assert calls(local) == {()}, calls(local)
        # step 1, on every rank: DDP one all-reduce (one bucket in its first step, and no_sync on all
        # micro-batches but the last); FSDP2 per micro-batch an all-gather for the root and one per
        # block in the forward, one per block again in the backward (the root stays gathered), and on
        # the last micro-batch a reduce-scatter per unit (blocks and root)
        step1 = {name: [v[name][1][r]["step_collectives"] for r in range(world)] for name in ("ddp", "fsdp2_fp32")}
        assert step1["ddp"] == [{"c10d::allreduce_": 1}] * world, step1["ddp"]
        assert step1["fsdp2_fp32"] == [{"c10d::_allgather_base_": accum * (2 * layers + 1),
                                        "c10d::_reduce_scatter_base_": layers + 1}] * world, (step1, layers, accum)
        for s in fp32:   # the whole norm needs every rank's shards: sum of local squares = total squared
            total, parts = fp32[s][0]["check_grad_norm"], [fp32[s][r]["local_norm"] for r in range(world)]
            assert all(p < total for p in parts) and abs(sum(p * p for p in parts) ** 0.5 / total - 1) < 1e-5, (s, total, parts)
    held = {name: [v[name][1][r]["param_bytes_held"] for r in range(world)] for name in ("ddp", "fsdp2_fp32")}
    assert all(h == sum(held["ddp"]) / world for h in held["ddp"]), held           # DDP: every rank, everything
    assert sum(held["fsdp2_fp32"]) == held["ddp"][0], held                          # FSDP2: each weight once
    assert max(held["fsdp2_fp32"]) <= held["ddp"][0] / world * 1.2, held            # about 1/W on each rank
    figures = {"fp32": check_same_training(ddp, fp32, weights["fsdp2_fp32"], weights["ddp"], init, "fp32"),
               "bf16": check_same_training(ddp, bf16, weights["fsdp2_bf16"], weights["ddp"], init, "bf16"),
               "held": held, "clip_calls": {k: sorted(calls(x)) for k, x in (("ddp", ddp), ("fsdp2", fp32))},
               "step1": {name: v[name][1][0]["step_collectives"] for name in ("ddp", "fsdp2_fp32")}}
    if world > 1:
        try:
            check_same_training(ddp, local, weights["fsdp2_local_clip"], weights["ddp"], init, "fp32")
        except AssertionError as e:
            figures["local_clip_caught"] = str(e)
        else:
            raise AssertionError("clipping each rank's shards by their own norm passed the comparison: it cannot catch it")
    return figures
