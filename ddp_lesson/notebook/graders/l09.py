"""Notebook 09's exercise: the bucketed gradient hook. check_bucketed grades a stage (d) result of
ddp_scratch.check_stage and returns (ok, why); bucketed_solution writes right and wrong answers."""
from pathlib import Path

from ...rank.bundled import script


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
