"""Two torchrun agents on this machine as two nodes (c10d rendezvous on 127.0.0.1)."""
import pytest

from ddp_lesson import BadInput
from ddp_lesson.launcher import launch, multinode
from ddp_lesson.rank.bundled import script
from pathlib import Path

SCRIPT = script("rank_table.py")


def test_expected_table():
    rows = multinode.expected_table(nodes=2, procs_per_node=4)
    assert [r["RANK"] for r in rows] == list(range(8))
    assert [r["LOCAL_RANK"] for r in rows] == [0, 1, 2, 3] * 2
    assert {r["WORLD_SIZE"] for r in rows} == {8}


def test_needs_endpoint(tmp_path):
    with pytest.raises(BadInput):
        launch.start(SCRIPT, nproc=1, cpu=True, nnodes=2, node_rank=0, run_dir=tmp_path / "a")
    with pytest.raises(BadInput):
        launch.start(SCRIPT, nproc=1, cpu=True, nnodes=2, node_rank=2,
                     rdzv_endpoint="127.0.0.1:1", run_dir=tmp_path / "b")


def test_two_nodes(tmp_path):
    runs = multinode.start_nodes(SCRIPT, nnodes=2, nproc_per_node=1, base_dir=tmp_path, timeout=90)
    results = multinode.wait_all(runs, timeout=120)
    assert [r["status"] for r in results] == ["ok", "ok"], [r.get("message") for r in results]
    rows = multinode.rank_rows(runs)
    assert [r["RANK"] for r in rows] == [0, 1]
    assert all(r["WORLD_SIZE"] == 2 and r["LOCAL_RANK"] == 0 and r["LOCAL_WORLD_SIZE"] == 1 for r in rows)
    assert sorted(r["GROUP_RANK"] for r in rows) == [0, 1]
    # each node's run directory holds only its own ranks
    for r in runs:
        assert len(list((r.run_dir / "metrics").glob("rank*.jsonl"))) == 1
    assert runs[0].config["nnodes"] == 2 and runs[0].config["world_size"] == 2
