"""The pictures of ddp_lesson/notebook/diagrams/collectives.py draw what their data says: each test reads
the figure's texts and patch colours back and compares them with the input, and a planted wrong
input must come out different (a wrong verdict, a wrong box)."""
import os

import pytest
import torch
import torch.distributed as dist
from matplotlib.colors import to_hex
from matplotlib.patches import FancyBboxPatch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from ddp_lesson.notebook import diagrams
from ddp_lesson.launcher import launch
from ddp_lesson.notebook.diagrams import collectives
from ddp_lesson.notebook.diagrams.shapes import DEVICE_COLOURS


def texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def boxes(fig):
    """(x, y, text, face colour) of every labelled box, top to bottom then left to right."""
    ax = fig.axes[0]
    labels = {(round(t.get_position()[0], 3), round(t.get_position()[1], 3)): t.get_text() for t in ax.texts}
    out = []
    for p in ax.patches:
        if isinstance(p, FancyBboxPatch) and p.get_facecolor()[3] > 0:
            x, y, w, h = p.get_x(), p.get_y(), p.get_width(), p.get_height()
            key = (round(x + w / 2, 3), round(y + h / 2, 3))
            out.append((x, y, labels.get(key), to_hex(p.get_facecolor(), keep_alpha=False)))
    return sorted(out, key=lambda b: (-b[1], b[0]))


# ---- all_reduce before / after


def drawn_rows(fig):
    """The before and after values drawn on each rank's row, read back from the box labels."""
    rows = {}
    for x, y, label, _ in boxes(fig):
        rows.setdefault(round(y, 3), []).append([float(v) for v in label.split()])
    return [r for _, r in sorted(rows.items(), reverse=True)]


def test_all_reduce_draws_each_ranks_values_and_the_right_verdict():
    before = [[0.5, -1.0, 0.25], [1.5, 2.0, -0.75], [-0.5, 0.5, 0.0]]
    mean = [sum(c) / 3 for c in zip(*before)]
    fig = diagrams.all_reduce_before_after(before, [mean] * 3)
    rows = drawn_rows(fig)
    for row, b in zip(rows, before, strict=True):
        assert row[0] == pytest.approx(b, abs=1e-4) and row[1] == pytest.approx(mean, abs=1e-4)
    assert any("/ 3: the mean" in t for t in texts(fig))
    assert [f"rank {r}" for r in range(3)] == [t for t in texts(fig) if t.startswith("rank ")]


def test_all_reduce_planted_wrong_inputs_show():
    before = [[0.5, -1.0], [1.5, 2.0]]
    total = [2.0, 1.0]
    summed = diagrams.all_reduce_before_after(before, [total, total])
    assert any("sum over the 2 ranks, on every rank (not divided)" in t for t in texts(summed))
    assert not any("the mean" in t for t in texts(summed))
    uneven = diagrams.all_reduce_before_after(before, [[1.0, 0.5], [1.0, 0.6]])
    assert any("neither" in t for t in texts(uneven))
    swapped = diagrams.all_reduce_before_after(before[::-1], [[1.0, 0.5]] * 2)
    assert [r[0] for r in drawn_rows(swapped)] != before


def gloo_all_reduce(tensors):
    """A real gloo all_reduce (sum) over len(tensors) ranks, one thread each, in this process
    (no launch): returns every rank's tensor after it."""
    import threading
    store, world, out = dist.HashStore(), len(tensors), [None] * len(tensors)

    def rank(r):
        pg = dist.ProcessGroupGloo(store, r, world)
        t = tensors[r].clone()
        pg.allreduce([t]).wait()
        out[r] = t

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(o is not None for o in out), "the gloo all_reduce did not finish"
    return out


def test_all_reduce_from_a_real_all_reduce():
    # two real gloo ranks: what DDP leaves is the all_reduce's sum divided by the world size
    before = [torch.tensor([0.25, -0.5, 1.0]), torch.tensor([0.75, 1.5, -3.0])]
    summed = gloo_all_reduce(before)
    assert summed[0].tolist() == summed[1].tolist() == [1.0, 1.0, -2.0]     # gloo summed them
    b = [t.tolist() for t in before]
    mean = diagrams.all_reduce_before_after(b, [(t / 2).tolist() for t in summed])
    assert [r[1] for r in drawn_rows(mean)] == [pytest.approx([0.5, 0.5, -1.0], abs=1e-4)] * 2
    assert any("/ 2: the mean" in tx for tx in texts(mean))
    plain = diagrams.all_reduce_before_after(b, [t.tolist() for t in summed])   # not divided
    assert any("sum over the 2 ranks, on every rank (not divided)" in tx for tx in texts(plain))


def test_all_reduce_verdict_edge_cases():
    # one rank: the mean is its own tensor, and anything else is neither
    assert "/ 1: the mean" in collectives.all_reduce_verdict([[0.5, -1.0]], [[0.5, -1.0]])
    assert "neither" in collectives.all_reduce_verdict([[0.5, -1.0]], [[1.0, -2.0]])
    # all-zero gradients (a bias nobody's loss reached): sum = mean, not "not divided"
    zero = collectives.all_reduce_verdict([[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]])
    assert "both zero" in zero and "not divided" not in zero


# ---- layers to buckets


def real_buckets():
    """A DDP model's bucket assignment as its comm hook sees it (one gloo rank), first backward
    and after the rebuild."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(launch.free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = DDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]), bucket_cap_mb=0.25)
        names = {p: n for n, p in model.module.named_parameters()}
        seen = {}

        def hook(state, bucket):
            seen[bucket.index()] = [names[p] for p in bucket.parameters()]
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

        model.register_comm_hook(None, hook)
        steps = []
        for _ in range(2):
            seen.clear()
            model(torch.randn(4, 256)).sum().backward()
            steps.append([seen[k] for k in sorted(seen)])
        return list(names.values()), steps[1], steps[0]
    finally:
        dist.destroy_process_group()


def test_layers_to_buckets_colours_each_parameter_by_its_bucket():
    params, buckets, first = real_buckets()
    assert len(first) == 1 and len(buckets) > 1            # the rebuild split the one bucket
    fig = diagrams.layers_to_buckets(params, buckets, first)
    drawn = boxes(fig)
    colour_of = {label: c for _, _, label, c in drawn}
    for k, b in enumerate(buckets):
        label = f"bucket {k}: " + ", ".join(b)
        assert label in colour_of                           # the bucket box lists its parameters
        for p in b:
            assert colour_of[p] == colour_of[label]         # each parameter in its bucket's colour
    drawn_params = [label for _, _, label, _ in drawn if label in params]
    assert drawn_params == params                           # registration order, top down
    assert f"bucket 0\n{len(params)} parameters" in colour_of
    assert "bucket 0 holds the last layer: layers in reverse registration order" in texts(fig)


def drawn_arrows(fig):
    """(parameter, bucket box label) for every arrow, read from where the arrow starts and ends."""
    from matplotlib.patches import FancyArrowPatch
    ax = fig.axes[0]
    spans = []   # (x0, x1, y0, y1, label) of every labelled box
    for p in ax.patches:
        if isinstance(p, FancyBboxPatch) and p.get_facecolor()[3] > 0:
            x, y, w, h = p.get_x(), p.get_y(), p.get_width(), p.get_height()
            label = next(t.get_text() for t in ax.texts
                         if t.get_position() == pytest.approx((x + w / 2, y + h / 2), abs=1e-3))
            spans.append((x, x + w, y, y + h, label))

    def at(x, y):   # the box nearest the point (arrows stop a little short of the boxes)
        return min(spans, key=lambda b: max(b[0] - x, 0, x - b[1]) + max(b[2] - y, 0, y - b[3]))[4]

    out = []
    for p in ax.patches:
        if isinstance(p, FancyArrowPatch):
            v = p.get_path().vertices
            out.append((at(*v[0]), at(*v[-1])))
    return out


def test_layers_to_buckets_arrows_go_to_each_parameters_bucket():
    params, buckets, first = real_buckets()
    fig = diagrams.layers_to_buckets(params, buckets, first)
    want = sorted((p, f"bucket {k}: " + ", ".join(b)) for k, b in enumerate(buckets) for p in b)
    assert sorted(drawn_arrows(fig)) == want


def test_layers_to_buckets_first_step_boxes_count_their_own_parameters():
    params, buckets, _ = real_buckets()
    fig = diagrams.layers_to_buckets(params, buckets, first_step=buckets)   # several first buckets
    labels = [label for _, _, label, _ in boxes(fig)]
    for k, b in enumerate(buckets):
        assert f"bucket {k}\n{len(b)} parameters" in labels


def test_layers_to_buckets_planted_wrong_assignment_shows():
    params, buckets, _ = real_buckets()
    wrong = buckets[::-1]                                    # first layer's bucket first
    fig = diagrams.layers_to_buckets(params, wrong)
    assert "not in reverse registration order" in texts(fig)
    assert f"bucket 0: " + ", ".join(buckets[0]) not in texts(fig)
    lost = diagrams.layers_to_buckets(params, [b for b in buckets[1:]])
    assert "the buckets do not hold each parameter exactly once" in texts(lost)


# ---- set_epoch orders


def sampler_orders(world, set_epoch, epochs=3, n=12):
    samplers = [DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=0)
                for r in range(world)]
    out = []
    for e in range(epochs):
        if set_epoch:
            for s in samplers:
                s.set_epoch(e)
        out.append([list(s) for s in samplers])
    return out


def drawn_orders(fig):
    rows = {}
    for x, y, label, _ in boxes(fig):
        rows.setdefault(round(y, 3), []).append(int(label))
    return [r for _, r in sorted(rows.items(), reverse=True)]


@pytest.mark.parametrize("world", [1, 3])
def test_set_epoch_orders_draws_every_ranks_indices(world):
    without, with_ = sampler_orders(world, False), sampler_orders(world, True)
    fig = diagrams.set_epoch_orders({"without set_epoch": without, "with set_epoch": with_})
    rows = [share for e in without for share in e] + [share for e in with_ for share in e]
    assert drawn_orders(fig) == rows
    t = texts(fig)
    assert t.index("the same order every epoch") < t.index("with set_epoch") < t.index("a new order every epoch")
    assert [x for x in t if x.startswith("epoch 1, rank ")] == [f"epoch 1, rank {r}" for r in range(world)] * 2
    # every box in its rank's colour, whatever the epoch
    colours = [c for _, _, _, c in boxes(fig)]
    want = [to_hex(DEVICE_COLOURS[r]) for e in without + with_ for r, share in enumerate(e) for _ in share]
    assert colours == want


def test_set_epoch_orders_planted_wrong_input_shows():
    without = sampler_orders(2, False)
    forged = [without[0], sampler_orders(2, True)[1], without[2]]    # one epoch reshuffled
    fig = diagrams.set_epoch_orders({"without set_epoch": forged})
    assert "epoch 2 repeats epoch 0" in texts(fig)                   # every pair compared
    assert "a new order every epoch" not in texts(fig) and "the same order every epoch" not in texts(fig)
    assert drawn_orders(fig) != [share for e in without for share in e]


def test_everything_is_exported():
    assert set(collectives.__all__) == {"all_reduce_before_after", "layers_to_buckets", "set_epoch_orders",
                                        "buffer_rule", "buffer_rule_verdict"}
    for name in collectives.__all__:
        assert getattr(diagrams, name) is getattr(collectives, name)


def measured_buffer_copies():
    """ddp_checks.py's buffer_copies on one gloo rank: DDP's own decision per forward."""
    import importlib.util
    from ddp_lesson.rank.bundled import script
    spec = importlib.util.spec_from_file_location("ddp_checks_for_test", script("ddp_checks.py"))
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(launch.free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        return checks.buffer_copies(torch.device("cpu"), None, 0, 1)
    finally:
        dist.destroy_process_group()


def test_buffer_rule_draws_a_copy_tag_on_each_forward_that_copied():
    forwards = measured_buffer_copies()
    assert [f["kind"] for f in forwards] == ["train"] * 3 + ["eval"] * 3 + ["train"] * 2
    assert [f["decided"] for f in forwards] == [True, True, True, True, False, False, False, True]
    fig = diagrams.buffer_rule(forwards)
    drawn = boxes(fig)
    tags = sorted(x for x, _, label, _ in drawn if label == "copy")
    bodies = sorted(x for x, _, label, _ in drawn if label and label[0].isdigit())
    assert len(bodies) == 8
    copied_at = [i + 1 for i, x in enumerate(bodies) if any(abs(t - x - 0.15) < 1e-6 for t in tags)]
    assert copied_at == [1, 2, 3, 4, 8]                     # a tag above exactly the forwards that copied
    assert texts(fig).count("no copy") == 3
    assert any(t.startswith("each copy follows the forward before it") for t in texts(fig))


def test_buffer_rule_verdict_names_a_forward_that_breaks_the_rule():
    kinds = ["train"] * 3 + ["eval"] * 3 + ["train"] * 2
    planted = [{"kind": k, "decided": True, "copied": None} for k in kinds]   # "every forward copies"
    verdict = diagrams.buffer_rule_verdict(planted)
    assert verdict.startswith("forwards [5, 6, 7] break the rule"), verdict
    measured_wrong = [{"kind": k, "decided": d, "copied": not d} for k, d in
                      zip(kinds, [True, True, True, True, False, False, False, True])]   # copies measured opposite
    assert "break the rule" in diagrams.buffer_rule_verdict(measured_wrong)
