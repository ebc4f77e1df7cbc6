"""Root cause from structured records (failures.py), hints, and the timeout wording
(stacks.py). Unit tests on run directories written here; the same records come from real
runs in test_launch.py and test_cli.py."""
import json
import math

from ddp_lesson.launcher import failures, runs, slurm, stacks
from ddp_lesson.rank import metrics, rundir
from ddp_lesson import BadInput

import pytest


def setup_logs(tmp_path, errors=(), agent=None):
    logs = tmp_path / "logs"
    logs.mkdir()
    for e in errors:
        rundir.write_json(logs / f"rank{e['rank']}.error.json",
                        {"traceback": f"Traceback ...\n{e['message']}\n", "restart": 0, **e})
    if agent is not None:
        rundir.write_json(logs / "agent.failures.json", agent)
    return tmp_path


def row(rank, pid, code, ts=100):
    return {"rank": rank, "local_rank": rank, "pid": pid, "exitcode": code, "timestamp": ts,
            "error_file": "<N/A>", "message": ""}


def test_a_stale_error_file_from_an_earlier_restart_does_not_win(tmp_path):
    run = setup_logs(tmp_path, errors=[{"rank": 1, "pid": 11, "time": 5.0, "message": "ValueError: attempt 0",
                                        "restart": 0}],
                     agent={"failures": [row(1, 21, -9), row(0, 20, -15)]})  # attempt 1: new pids
    f = failures.root_cause(run)
    assert (f["rank"], f["exitcode"]) == (1, -9) and "memory" in failures.describe(f)


def test_a_peer_that_aborted_in_teardown_is_not_the_cause(tmp_path):
    run = setup_logs(tmp_path, errors=[{"rank": 1, "pid": 11, "time": 5.0, "message": "ValueError: boom"}],
                     agent={"failures": [row(0, 10, -6, ts=99), row(1, 11, 1, ts=100)]})
    f = failures.root_cause(run)
    assert (f["rank"], f["exitcode"], f["message"]) == (1, 1, "ValueError: boom")


def test_an_agent_stopped_from_outside_is_said(tmp_path):
    run = setup_logs(tmp_path, agent={"signal": "SIGTERM", "time": 1.0})
    f = failures.root_cause(run)
    assert f is not None and f["rank"] is None and f["exitcode"] == -15
    assert "SIGTERM from outside" in failures.describe(f)


def test_same_error_on_every_rank_is_shown_once(tmp_path):
    errors = [{"rank": r, "pid": 10 + r, "time": 5.0 + r, "message": "RuntimeError: Found no NVIDIA driver"}
              for r in range(3)]
    run = setup_logs(tmp_path, errors=errors, agent={"failures": [row(r, 10 + r, 1) for r in range(3)]})
    f = failures.root_cause(run)
    assert f["rank"] == 0 and f["same_error"] == [1, 2]
    text = failures.describe(f)
    assert text.count("Found no NVIDIA driver") == 2  # the headline and the traceback's last line
    assert "(rank 1, 2 raised the same error)" in text and "--cpu" in text
    assert "Traceback" not in failures.describe(f, traceback=False)


@pytest.mark.parametrize("message, words", [
    ("RuntimeError: Found no NVIDIA driver on your system.", "--cpu"),
    ("AssertionError: Torch not compiled with CUDA enabled", "--cpu"),
    ("RuntimeError: Distributed package doesn't have NCCL built in", "gloo"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "smaller batch"),
    ("RuntimeError: The server socket has failed to listen on any local network address. "
     "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use", "MASTER_PORT"),
    ("ValueError: a plain bug", None),
])
def test_one_line_hints_for_common_root_causes(message, words):
    tip = failures.hint({"rank": 0, "exitcode": 1, "message": message, "traceback": ""})
    assert (tip is None) if words is None else (words in tip and "\n" not in tip)


def test_timeout_wording_follows_where_the_ranks_were():
    collective = stacks.timeout_message(8, {0: {"state": "collective", "call": "all_reduce", "at": "script.py line 13"},
                                            1: {"state": "busy", "call": None, "at": "script.py line 11"}})
    assert "all_reduce" in collective and "rank 1 at script.py line 11 never reached" in collective
    before_init = stacks.timeout_message(8, {0: {"state": "busy", "call": None, "at": "script.py line 3"},
                                             1: {"state": "busy", "call": None, "at": "script.py line 3"}})
    assert "collective" not in before_init and "still busy" in before_init
    joining = stacks.timeout_message(8, {0: {"state": "init", "call": "init_process_group", "at": "script.py line 5"},
                                         1: {"state": "busy", "call": None, "at": "script.py line 3"}})
    assert "init_process_group" in joining and "never joined" in joining


def test_non_finite_metrics_are_written_as_null(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_LESSON_RUN_DIR", str(tmp_path))
    metrics.close()
    metrics.log(0, loss=math.nan, best=math.inf, acc=0.5)
    metrics.close()
    line = (tmp_path / "metrics" / "rank0.jsonl").read_text().strip()
    row = json.loads(line, parse_constant=lambda c: pytest.fail(f"invalid JSON constant {c}"))
    assert row["loss"] is None and row["best"] is None and row["acc"] == 0.5


def test_log_tail_keeps_a_utf8_character_split_across_reads(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    data = "loss ↓ é\n".encode()
    path = logs / "rank0.stdout.log"
    path.write_bytes(data[:6])  # inside "↓"
    tail = runs.LogTail(tmp_path)
    first = "".join(t for _, _, t in tail.read())
    with open(path, "ab") as f:
        f.write(data[6:])
    second = "".join(t for _, _, t in tail.read())
    assert first + second == "loss ↓ é\n" and "\ufffd" not in first + second


def test_log_reads_are_bounded(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.stdout.log").write_bytes(b"x" * (3 * 2 ** 20))  # a rank printing without newlines
    tail = runs.LogTail(tmp_path)
    sizes = [sum(len(t) for _, _, t in tail.read()) for _ in range(4)]
    assert max(sizes) <= 2 ** 20 and sum(sizes) == 3 * 2 ** 20


@pytest.mark.parametrize("kwargs", [{"partition": "gpu\n#SBATCH --qos=high"}, {"time": "1:00:00\nrm -rf ~"},
                                    {"job_name": "a b"}, {"env": {"A=1\nrm -rf ~ #": "x"}}])
def test_sbatch_refuses_values_that_inject_shell_lines(kwargs):
    with pytest.raises(BadInput):
        slurm.sbatch_script("train.py", **kwargs)


# gloo's error when a pair cannot connect, as seen in test_netns.py's two-namespace run
UNREACHABLE = ("RuntimeError: Gloo connectFullMesh failed with [../gloo/transport/tcp/pair.cc:152] timed "
               "out connecting: SO_ERROR: No route to host, remote=[198.51.100.1]:28055")


@pytest.mark.parametrize("message, nnodes", [
    (UNREACHABLE.replace("198.51.100.1", "127.0.0.1"), 1),            # one node: a peer that was slow or died
    ("RuntimeError: Gloo connectFullMesh failed with [../gloo/transport/tcp/pair.cc:534] Connection reset "
     "by peer, remote=[10.0.0.2]:40000", 2),                           # a peer that died, on two nodes
    ("torch.distributed.DistNetworkError: The client socket has failed to connect to [head]:29400 "
     "(errno: 113 - No route to host).", 2),                           # the store, not a gloo pair
])
def test_no_interface_hint_for_unrelated_failures(message, nnodes):
    tip = failures.hint({"rank": 0, "exitcode": 1, "message": message, "traceback": "", "nnodes": nnodes})
    assert tip is None or "GLOO_SOCKET_IFNAME" not in tip, tip


def test_the_waiting_side_of_an_unreachable_pair_gets_the_hint_on_several_nodes():
    waiting = ("RuntimeError: Gloo connectFullMesh failed with [../gloo/transport/tcp/pair.h:311] "
               "Connect timeout [none]")                               # the rank the other never reached
    assert "GLOO_SOCKET_IFNAME" in failures.hint({"message": waiting, "nnodes": 2})
    assert failures.hint({"message": waiting, "nnodes": 1}) is None


def test_a_taken_port_beats_the_interface_hint():
    message = (f"{UNREACHABLE}\nRuntimeError: The server socket has failed to listen on any local network "
               "address. port: 29500, code: -98, name: EADDRINUSE, message: address already in use")
    assert "MASTER_PORT" in failures.hint({"message": message, "nnodes": 2})


def test_the_multi_node_interface_case_gets_its_hint_from_the_runs_config(tmp_path):
    run = setup_logs(tmp_path, errors=[{"rank": 1, "pid": 11, "time": 5.0, "message": UNREACHABLE}],
                     agent={"failures": [row(1, 11, 1)]})
    rundir.write_json(tmp_path / "config.json", {"nnodes": 2, "world_size": 2})
    f = failures.root_cause(run)
    assert f["nnodes"] == 2 and "GLOO_SOCKET_IFNAME" in failures.describe(f)
    rundir.write_json(tmp_path / "config.json", {"nnodes": 1, "world_size": 2})
    assert "GLOO_SOCKET_IFNAME" not in failures.describe(failures.root_cause(run))


def test_timeout_hints_on_several_nodes_follow_where_the_ranks_were():
    init = {0: {"state": "init", "call": "init_process_group", "at": "s.py line 9"},
            1: {"state": "busy", "call": None, "at": "s.py line 3"}}
    assert "GLOO_SOCKET_IFNAME" in failures.after_timeout("stopped", {"nnodes": 2}, init)
    desync = {0: {"state": "collective", "call": "all_reduce", "at": "s.py line 20"},
              1: {"state": "collective", "call": "broadcast", "at": "s.py line 22"}}
    assert failures.after_timeout("stopped", {"nnodes": 2}, desync) == "stopped"   # the group had formed
    nobody = failures.after_timeout("stopped", {"nnodes": 2}, {})   # agents still in the rendezvous
    assert "--rdzv-endpoint" in nobody and "GLOO_SOCKET_IFNAME" not in nobody
    assert failures.after_timeout("stopped", {"nnodes": 1}, {}) == "stopped"


WHOLE_STACK = """main thread 0x7ff0f9e57b80
Current thread 0x00007ff0f9e57b80 (most recent call first):
  File "/site-packages/torch/distributed/distributed_c10d.py", line 669 in _create_gloo_process_group
  File "/site-packages/torch/distributed/distributed_c10d.py", line 2874 in _new_process_group_helper
  File "/site-packages/torch/distributed/distributed_c10d.py", line 2553 in init_process_group
  File "/site-packages/torch/distributed/c10d_logger.py", line 97 in wrapper
  File "/run/node0/script.py", line 35 in main
  File "/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 380 in wrapper
  File "/run/node0/script.py", line 45 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "/repo/ddp_lesson/rank/guard.py", line 289 in <module>
  File "<frozen runpy>", line 198 in _run_module_as_main
"""


def test_a_stack_read_half_written_is_marked_incomplete(tmp_path):
    """faulthandler writes line by line: a read that catches it after two frames (as a CI
    timeout once did) must not pass for the whole stack, whose call is init_process_group."""
    (tmp_path / "logs").mkdir()
    stack = tmp_path / "logs" / "rank0.stack.log"
    stack.write_text("\n".join(WHOLE_STACK.splitlines()[:4]) + "\n")
    half = stacks.where(tmp_path, 1)[0]
    assert half["complete"] is False and half["state"] == "collective"   # what it would have said
    stack.write_text(WHOLE_STACK)
    whole = stacks.where(tmp_path, 1)[0]
    assert whole == {"state": "init", "call": "init_process_group", "at": "script.py line 35",
                     "complete": True}


# a forked (warm) rank whose script has ended waits in torch's worker code until every rank is
# done: its own frames (inner to multiprocessing's _bootstrap) hold no guard frame; below them,
# the agent's stack inherited at the fork (guard.py included) is not the rank's
ENDED_FORKED_STACK = """main thread 0x7ff0f9e57b80
Current thread 0x00007ff0f9e57b80 (most recent call first):
  File "/lib/python3.11/threading.py", line 331 in wait
  File "/site-packages/torch/multiprocessing/spawn.py", line 95 in _wrap
  File "/lib/python3.11/multiprocessing/process.py", line 108 in run
  File "/lib/python3.11/multiprocessing/process.py", line 314 in _bootstrap
  File "/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 760 in _start
  File "/site-packages/torch/distributed/run.py", line 1142 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "/repo/ddp_lesson/rank/guard.py", line 367 in <lambda>
  File "/repo/ddp_lesson/rank/guard.py", line 377 in run_target
  File "/repo/ddp_lesson/rank/warm/server.py", line 241 in <module>
  File "<frozen runpy>", line 198 in _run_module_as_main
"""


def test_a_forked_rank_past_its_script_is_ended_and_left_out_of_the_message(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank0.stack.log").write_text(WHOLE_STACK)
    (tmp_path / "logs" / "rank1.stack.log").write_text(ENDED_FORKED_STACK)
    where = stacks.where(tmp_path, 2)
    assert where[1] == {"state": "ended", "call": None, "at": None, "complete": True}
    message = stacks.timeout_message(8, where)
    assert "rank(s) 0 waited in init_process_group" in message and "rank 1" not in message, message


def test_a_stack_cut_off_by_faulthandler_is_all_the_scripts(tmp_path):
    """faulthandler keeps the innermost 100 frames and writes "..." for the rest: a deep script
    cuts off the guard; what is left is the script's, and whole."""
    deep = "".join(f'  File "/run/script.py", line 7 in f\n' for _ in range(97))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank0.stack.log").write_text(
        "main thread 0x7ff0f9e57b80\nCurrent thread 0x00007ff0f9e57b80 (most recent call first):\n"
        '  File "/site-packages/torch/distributed/distributed_c10d.py", line 4000 in all_reduce\n'
        '  File "/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper\n' + deep + "  ...\n")
    assert stacks.where(tmp_path, 1)[0] == {"state": "collective", "call": "all_reduce",
                                            "at": "script.py line 7", "complete": True}
