"""The process-tree and CUDA_VISIBLE_DEVICES pictures draw what their data says: read the
figure's texts and tagged arrows back and compare them with the input."""
import re

import pytest

from ddp_lesson.diagrams import cuda_renumbering, process_tree, visible_ids


def texts(fig):
    return [ax.get_title() for ax in fig.axes] + [t.get_text() for ax in fig.axes for t in ax.texts]


def arrows(fig):
    """{gid: (start, end)} of every tagged arrow."""
    out = {}
    for ax in fig.axes:
        for p in ax.patches:
            if p.get_gid():
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


RANKS = [{"rank": r, "local_rank": r, "pid": 4000 + 7 * r, "parent": 321} for r in range(3)]


def test_process_tree_draws_every_rank_with_its_pid_and_the_agent_starting_it():
    fig = process_tree(111, 321, RANKS, store="127.0.0.1:45678", run_dir="first_run-2")
    assert drawn_ranks(fig) == [(r["rank"], r["local_rank"], r["pid"]) for r in RANKS]
    all_text = "\n".join(texts(fig))
    assert "pid 111" in all_text and "pid 321" in all_text and "127.0.0.1:45678" in all_text
    assert "first_run-2" in all_text and "world size 3" in all_text
    a = arrows(fig)
    assert {g for g in a if g.startswith("start:rank")} == {f"start:rank{r}" for r in range(3)}
    assert {g for g in a if g.startswith("meet:")} == {f"meet:rank{r}" for r in range(3)}
    assert {g for g in a if g.startswith("flow:rank")} == {f"flow:rank{r}->run_dir" for r in range(3)}
    centres = rank_box_centres(fig)
    for r in range(3):   # the agent's arrow for rank r ends above rank r's own box
        (_, _), (x_end, _) = a[f"start:rank{r}"]
        assert abs(x_end - centres[r][0]) < 1e-9, r


def test_process_tree_check_rejects_a_wrong_drawing():
    # the read-back is a real check: the same figure does not match planted wrong data
    fig = process_tree(111, 321, RANKS)
    swapped = [(0, 0, 4007), (1, 1, 4000), (2, 2, 4014)]
    assert drawn_ranks(fig) != swapped
    assert drawn_ranks(process_tree(111, 321, RANKS[:2])) != drawn_ranks(fig)


@pytest.mark.parametrize("ranks", [
    [{"rank": 0, "local_rank": 0, "pid": 1}, {"rank": 0, "local_rank": 1, "pid": 2}],   # rank twice
    [{"rank": 1, "local_rank": 0, "pid": 1}],                                           # no rank 0
    [{"rank": 0, "local_rank": 0, "pid": 1, "parent": 999}],                            # not the agent's child
])
def test_process_tree_refuses_impossible_runs(ranks):
    with pytest.raises(ValueError):
        process_tree(1, 2, ranks)


@pytest.mark.parametrize("visible, n, want", [
    ("2,3", 8, [2, 3]), ("3,2", 8, [3, 2]), ("1, 4,6", 8, [1, 4, 6]), ("", 8, []),
    ("0,9,1", 8, [0]),     # CUDA stops at the first id this machine lacks
    ("1,1", 8, []),        # a repeated id hides every GPU
    ("5", 4, []),
])
def test_visible_ids_reads_the_variable_as_torch_does(visible, n, want):
    assert visible_ids(visible, n) == want


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
