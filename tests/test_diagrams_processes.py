"""The process-tree and CUDA_VISIBLE_DEVICES pictures draw what their data says: read the
figure's texts and tagged arrows back and compare them with the input."""
import re

import pytest

from ddp_lesson.notebook.diagrams import cuda_renumbering, process_tree, visible_ids


def texts(fig):
    return [ax.get_title() for ax in fig.axes] + [t.get_text() for ax in fig.axes for t in ax.texts]


def arrows(fig):
    """{gid: (start, end)} of every tagged arrow."""
    out = {}
    for ax in fig.axes:
        for p in ax.patches:
            if p.get_gid() and not p.get_gid().startswith("box:"):
                out[p.get_gid()] = p._posA_posB
    return out


def drawn_ranks(fig):
    """(rank, local rank, pid) of every rank box, read from its text."""
    found = []
    for t in texts(fig):
        m = re.fullmatch(r"rank (\d+)\nlocal rank (\d+)\npid (\d+)", t)
        if m:
            found.append(tuple(map(int, m.groups())))
    return sorted(found)


def rank_box_centres(fig):
    return {int(re.match(r"rank (\d+)", t.get_text()).group(1)): t.get_position()
            for ax in fig.axes for t in ax.texts if re.match(r"rank \d+\nlocal", t.get_text())}


def box_of(fig, gid):
    """(x0, y0, x1, y1) of the box tagged gid."""
    p = next(p for ax in fig.axes for p in ax.patches if p.get_gid() == gid)
    return p.get_x(), p.get_y(), p.get_x() + p.get_width(), p.get_y() + p.get_height()


def touches(point, bounds, slack=0.03):
    """The point is on or just beside the box: where an arrow from or to it starts or ends."""
    (x, y), (x0, y0, x1, y1) = point, bounds
    return x0 - slack <= x <= x1 + slack and y0 - slack <= y <= y1 + slack


RANKS = [{"rank": r, "local_rank": r, "pid": 4000 + 7 * r, "parent": 321} for r in range(3)]
# node 1 of a 2-node job with 4 ranks each: ranks 4-7, local ranks 0-3, so a drawing that
# shows the rank as the local rank (or the other way round) fails
NODE1 = [{"rank": 4 + i, "local_rank": i, "pid": 5000 + 3 * i, "parent": 321} for i in range(4)]


@pytest.mark.parametrize("warm_pid", [None, 4242])
@pytest.mark.parametrize("ranks, world", [(RANKS, None), (NODE1, 8)])
def test_process_tree_draws_every_rank_with_its_pid_and_the_agent_starting_it(ranks, world, warm_pid):
    fig = process_tree(111, 321, ranks, store="127.0.0.1:45678", run_dir="first_run-2",
                       agent_ports=[45678, 39001], world_size=world, warm_pid=warm_pid)
    assert drawn_ranks(fig) == [(r["rank"], r["local_rank"], r["pid"]) for r in ranks]
    all_text = "\n".join(texts(fig))
    assert "pid 111" in all_text and "pid 321" in all_text and "127.0.0.1:45678" in all_text
    assert "first_run-2" in all_text and f"world size {world or len(ranks)}" in all_text
    a = arrows(fig)
    numbers = [r["rank"] for r in ranks]
    assert {g for g in a if g.startswith("start:rank")} == {f"start:rank{r}" for r in numbers}
    assert {g for g in a if g.startswith("meet:")} == {f"meet:rank{r}" for r in numbers}
    assert {g for g in a if g.startswith("flow:rank")} == {f"flow:rank{r}->run_dir" for r in numbers}
    agent, store, rdzv = box_of(fig, "box:agent"), box_of(fig, "box:store"), box_of(fig, "box:rdzv")
    for r in numbers:   # each arrow goes from the box it names to the box it names
        start, end = a[f"start:rank{r}"]
        assert touches(start, agent) and touches(end, box_of(fig, f"box:rank{r}")), r
        start, end = a[f"meet:rank{r}"]
        assert touches(start, box_of(fig, f"box:rank{r}")) and touches(end, store), r
        assert not touches(end, agent) and not touches(end, rdzv), r
        start, end = a[f"flow:rank{r}->run_dir"]
        assert touches(start, box_of(fig, f"box:rank{r}")) and touches(end, box_of(fig, "box:run_dir"))
    start, end = a["start:agent"]   # the agent's parent: the kernel, or the warm process it started
    parent = box_of(fig, "box:kernel" if warm_pid is None else "box:warm")
    assert touches(start, parent) and touches(end, agent)


def test_process_tree_draws_two_stores_and_who_hosts_each():
    # sharing on (torch's default): the agent listens on the rendezvous port and MASTER_PORT
    fig = process_tree(111, 321, RANKS, store="localhost:45678", agent_ports=[39001, 45678])
    a, t = arrows(fig), "\n".join(texts(fig))
    assert "localhost:45678" in t and "port 39001" in t and "port 45678" not in t
    for gid, target in (("hosts:store", "box:store"), ("hosts:rdzv", "box:rdzv")):
        start, end = a[gid]
        assert touches(start, box_of(fig, "box:agent")) and touches(end, box_of(fig, target)), gid
        assert not touches(start, box_of(fig, "box:kernel")), gid
    # sharing off: MASTER_PORT is not the agent's, so rank 0 hosts the ranks' store
    fig = process_tree(111, 321, RANKS, store="localhost:45678", agent_ports=[39001])
    start, end = arrows(fig)["hosts:store"]
    assert touches(start, box_of(fig, "box:rank0")) and touches(end, box_of(fig, "box:store"))
    assert not touches(start, box_of(fig, "box:agent"))


@pytest.mark.parametrize("warm_pid", [None, 4242])
def test_process_tree_without_stores_draws_no_store_and_names_none(warm_pid):
    # 00's section 2 draws the tree without stores or ports (appendix F adds them), with the
    # warm process when the run was warm
    fig = process_tree(111, 321, RANKS, run_dir="first_run-2", warm_pid=warm_pid)
    a, t = arrows(fig), "\n".join(texts(fig))
    assert drawn_ranks(fig) == [(r["rank"], r["local_rank"], r["pid"]) for r in RANKS]
    assert {g for g in a if g.startswith("start:rank")} == {f"start:rank{r['rank']}" for r in RANKS}
    assert not [g for g in a if g.startswith(("meet:", "hosts:"))], sorted(a)
    assert not [p.get_gid() for ax in fig.axes for p in ax.patches if p.get_gid() in ("box:store", "box:rdzv")]
    assert "store" not in t.lower() and not re.search(r"\bports?\b", t) and ("warm" in t) == (warm_pid is not None), t
    assert "who starts whom" in t and "first_run-2" in t
    # with the stores, the legend names them
    assert "meet at their store" in "\n".join(texts(process_tree(111, 321, RANKS, store="localhost:1")))


@pytest.mark.parametrize("field", ["pid", "local_rank"])
def test_process_tree_follows_a_planted_change_of_its_input(field):
    # the read-back sees the input: change one field of the data and the drawing changes with it
    planted = [dict(r) for r in NODE1]
    if field == "pid":
        planted[0]["pid"], planted[1]["pid"] = planted[1]["pid"], planted[0]["pid"]
    else:
        planted[0]["local_rank"], planted[1]["local_rank"] = 1, 0
    truth = [(r["rank"], r["local_rank"], r["pid"]) for r in NODE1]
    drawn = drawn_ranks(process_tree(111, 321, planted, world_size=8))
    assert drawn == [(r["rank"], r["local_rank"], r["pid"]) for r in planted] and drawn != truth


@pytest.mark.parametrize("ranks", [
    [{"rank": 0, "local_rank": 0, "pid": 1}, {"rank": 0, "local_rank": 1, "pid": 2}],   # rank twice
    [{"rank": 0, "local_rank": 1, "pid": 1}],                                           # no local rank 0
    [{"rank": 1, "local_rank": 0, "pid": 1}],                                           # rank 1 in a world of 1
    [{"rank": 0, "local_rank": 0, "pid": 1, "parent": 999}],                            # not the agent's child
])
def test_process_tree_refuses_impossible_runs(ranks):
    with pytest.raises(ValueError):
        process_tree(1, 2, ranks)


UUIDS = ["GPU-aaaa1111", "GPU-aaaa2222", "GPU-bbbb3333", "GPU-cccc4444"]
VISIBLE_CASES = [
    ("2,3", 8), ("3,2", 8), ("1, 4,6", 8), ("", 8), ("0,9,1", 8), ("1,1", 8), ("5", 4),
    ("0,9,0", 8), ("+2", 8), ("2gpu,3", 8), ("1,-1,2", 8), ("1,,2", 8), ("x,1", 8), (" 3 ,1 ", 4),
    ("GPU-bbbb,GPU-aaaa1", 4), ("GPU-aaaa,GPU-cccc", 4), ("GPU-cccc,GPU-cccc4444", 4),
    ("GPU-bbbb,3", 4), ("GPU-dddd", 4),
    ("GPU-bbbb,GPU-zz,GPU-bbbb", 4), ("GPU-aaaa1111,GPU-aaaa,GPU-aaaa1111", 4),  # repeat before match
]


@pytest.mark.parametrize("visible, n", VISIBLE_CASES)
def test_visible_ids_reads_the_variable_as_torch_does(visible, n, monkeypatch):
    # the oracle is the installed torch: _parse_visible_devices, then _device_count_nvml with
    # the machine's GPU count (and UUIDs) standing in for NVML's
    import torch.cuda
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: n)
    monkeypatch.setattr(torch.cuda, "_raw_device_uuid_nvml", lambda: UUIDS[:n])
    parsed = torch.cuda._parse_visible_devices()
    count = torch.cuda._device_count_nvml()
    ids = visible_ids(visible, n, uuids=UUIDS[:n])
    assert len(ids) == count, (parsed, count, ids)
    if parsed and isinstance(parsed[0], int):
        assert ids == parsed[:count]
    elif parsed:
        assert ids == torch.cuda._transform_uuid_to_ordinals(parsed, UUIDS[:n])[:count]


def test_visible_ids_does_not_model_mig_lists():
    with pytest.raises(ValueError):
        visible_ids("MIG-1234", 8)


@pytest.mark.parametrize("visible, n", [("2,3", 8), ("3,2", 8), ("7,0,5", 8), ("1", 2), ("", 4)])
def test_cuda_renumbering_maps_each_listed_gpu_to_its_position(visible, n):
    fig = cuda_renumbering(visible, n)
    ids = visible_ids(visible, n)
    maps = sorted(g for g in arrows(fig) if g.startswith("map:"))
    assert maps == sorted(f"map:{g}->{j}" for j, g in enumerate(ids))
    t = texts(fig)
    assert sum(s.startswith("GPU ") for s in t) == n
    assert sorted(s for s in t if s.startswith("cuda:")) == sorted(f"cuda:{j}" for j in range(len(ids)))
    assert sum(s.endswith("hidden") for s in t) == n - len(ids)
    # each arrow starts above its physical GPU's box and ends above its logical box
    centres = {s.get_text().split("\n")[0]: s.get_position()[0] for ax in fig.axes for s in ax.texts}
    for j, g in enumerate(ids):
        (x0, _), (x1, _) = arrows(fig)[f"map:{g}->{j}"]
        assert abs(x0 - centres[f"GPU {g}"]) < 1e-9 and abs(x1 - centres[f"cuda:{j}"]) < 1e-9


def test_cuda_renumbering_is_not_the_identity():
    # "cards 2 and 3 become cuda:0 and cuda:1": a drawing that kept physical numbers fails
    a = arrows(cuda_renumbering("2,3", 8))
    assert "map:2->0" in a and "map:3->1" in a and "map:2->2" not in a


def gids(fig):
    return {p.get_gid() for ax in fig.axes for p in ax.patches if p.get_gid()}


def test_process_tree_draws_the_warm_process_between_the_kernel_and_the_agent():
    # a warm run: kernel -> warm process -> agent, the warm process a box of its own with its pid
    fig = process_tree(111, 321, RANKS, warm_pid=4242)
    a, t = arrows(fig), texts(fig)
    assert "box:warm" in gids(fig) and "warm process\npid 4242\ntorch imported" in t
    kernel, warm, agent = box_of(fig, "box:kernel"), box_of(fig, "box:warm"), box_of(fig, "box:agent")
    start, end = a["start:warm"]
    assert touches(start, kernel) and touches(end, warm) and not touches(end, agent)
    start, end = a["start:agent"]
    assert touches(start, warm) and touches(end, agent) and not touches(start, kernel)
    assert warm[1] > agent[3] and kernel[1] > warm[3]          # drawn between them, top to bottom
    assert "forks the agent" in " ".join(t)
    # a cold run: no warm process, the kernel starts the agent itself
    cold = process_tree(111, 321, RANKS)
    assert "box:warm" not in gids(cold) and "start:warm" not in arrows(cold)
    assert not any("4242" in x or "forks the agent" in x or "warm" in x for x in texts(cold))
    start, end = arrows(cold)["start:agent"]
    assert touches(start, box_of(cold, "box:kernel"))
