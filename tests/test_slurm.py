"""The generated sbatch script: its content, what it runs when Slurm's commands are
replaced by stubs that record their arguments, and (where root and Debian's Slurm packages
are there) what it does under a real one-machine Slurm brought up by ddp_lesson/launcher/slurm_cluster.sh."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_lesson.launcher import slurm
from ddp_lesson.rank.bundled import script


def test_content():
    text = slurm.sbatch_script("ddp_basic.py", nodes=2, gpus_per_node=4, args=["--epochs", "3"],
                               partition="gpu", env={"NCCL_SOCKET_IFNAME": "ib0"})
    assert text.startswith("#!/bin/bash\n")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=gpu", "export NCCL_SOCKET_IFNAME=ib0",
                 'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p',
                 f"srun --cpus-per-task=$SLURM_CPUS_PER_TASK {sys.executable} -m torch.distributed.run"):
        assert line in text, line   # srun does not inherit --cpus-per-task; torchrun needs no PATH
    cmd = " ".join(l.strip().rstrip("\\") for l in text.split(" torch.distributed.run", 1)[1].splitlines())
    assert "--nnodes $SLURM_NNODES" in cmd
    assert "--nproc-per-node 4" in cmd
    assert "--rdzv-backend c10d" in cmd
    assert "--rdzv-endpoint $head_node:$head_port" in cmd
    assert "head_port=$((20000 + SLURM_JOB_ID % 20000))" in text          # a port per job
    assert "head_port=29400" in slurm.sbatch_script("t.py", port=29400)  # unless one is given
    assert "--rdzv-id $SLURM_JOB_ID" in cmd
    assert cmd.split()[-3:] == ["ddp_basic.py", "--epochs", "3"]
    assert "--standalone" not in text and "torch.distributed.launch" not in text


def test_python_is_the_interpreter_that_runs_torchrun():
    """No bare `torchrun` command: a kernel whose environment is not on PATH (a hub kernelspec,
    venv/bin/jupyter without activation) would get "execve(): torchrun: No such file"."""
    text = slurm.sbatch_script("t.py", python="/opt/my env/bin/python")
    commands = [l for l in text.splitlines() if l.strip() and not l.lstrip().startswith("#")]
    assert not any(w == "torchrun" for l in commands for w in l.split())
    assert "srun --cpus-per-task=$SLURM_CPUS_PER_TASK '/opt/my env/bin/python' -m torch.distributed.run" in text


def test_quoting_and_bad_input():
    text = slurm.sbatch_script("my script.py", args=["--name", "a b"])
    assert "'my script.py' --name 'a b'" in text
    with pytest.raises(ValueError):
        slurm.sbatch_script("x.py", nodes=0)
    with pytest.raises(ValueError):
        slurm.sbatch_script("x.py", port=70000)


def run_with_stubs(job, nodelist, nnodes, job_id, cpus, scontrol, srun):
    """bash runs the sbatch script with Slurm's variables set and scontrol and srun as stub shell
    functions (exported through the environment); srun gets `python -m torch.distributed.run ...`
    and the stubs the tests give it only echo it."""
    env = dict(os.environ, SLURM_JOB_NODELIST=nodelist, SLURM_NNODES=str(nnodes),
               SLURM_JOB_ID=str(job_id), SLURM_CPUS_PER_TASK=str(cpus))
    for name, body in (("scontrol", scontrol), ("srun", srun)):
        env[f"BASH_FUNC_{name}%%"] = "() {  " + body + "\n}"
    return subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True, timeout=60)


def test_runs_with_stub_slurm(tmp_path):
    """bash runs the script; srun, scontrol and torchrun are stub shell functions (exported
    through the environment): the rendezvous endpoint must be the first host of the node
    list and the job id the rendezvous id."""
    job = tmp_path / "job.sbatch"
    slurm.write(job, "ddp_basic.py", nodes=2, gpus_per_node=4, args=["--epochs", "1"])
    out = run_with_stubs(job, nodelist="gpu-node-[07-08]", nnodes=2, job_id=4242, cpus=32,
                         scontrol='printf "gpu-node-07\\ngpu-node-08\\n"',
                         srun='echo "SRUN $1"; shift; echo "PYTHON $1 $2 $3"; shift 3; echo "TORCHRUN $*"')
    assert out.returncode == 0, out.stderr
    line = [l for l in out.stdout.splitlines() if l.startswith("TORCHRUN")][0]
    assert line == ("TORCHRUN --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d "
                    "--rdzv-endpoint gpu-node-07:24242 --rdzv-id 4242 --max-restarts 0 "
                    "ddp_basic.py --epochs 1")
    assert "rendezvous at gpu-node-07:24242" in out.stdout   # 20000 + 4242 % 20000
    assert "SRUN --cpus-per-task=32" in out.stdout
    assert f"PYTHON {sys.executable} -m torch.distributed.run" in out.stdout


def test_long_node_list_under_pipefail(tmp_path):
    """The first host is read from a list of thousands of names under `set -euo pipefail`: a
    reader that stops early (head -n 1) makes the lister die of SIGPIPE, which pipefail turns
    into the end of the script."""
    job = tmp_path / "job.sbatch"
    slurm.write(job, "t.py", nodes=4000, gpus_per_node=1)
    out = run_with_stubs(job, nodelist="n[0000-3999]", nnodes=4000, job_id=7, cpus=8,
                         scontrol="for i in $(seq -w 0 3999); do echo n$i; done", srun='echo "$@"')
    assert out.returncode == 0, out.stderr
    assert "--rdzv-endpoint n0000:20007 " in out.stdout


def test_cli():
    out = subprocess.run([sys.executable, "-m", "ddp_lesson", "slurm", "train.py", "--nodes", "3",
                          "--gpus-per-node", "8", "--", "--epochs", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --nodes=3" in out.stdout and "--nproc-per-node 8" in out.stdout
    assert out.stdout.rstrip().endswith("train.py --epochs 2")


# --- a real Slurm (ddp_lesson/launcher/slurm_cluster.sh): the printed script is submitted with sbatch ---
TRAIN = script("ddp_basic.py")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = slurm.why_no_cluster()
    if why:
        pytest.skip(why)
    with slurm.Cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def printed(*flags):
    """What `python -m ddp_lesson slurm ...` prints, as a learner would save it."""
    out = subprocess.run([sys.executable, "-m", "ddp_lesson", "slurm", *flags], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def cpu_job(tmp_path, nproc, epochs):
    from ddp_lesson.launcher.launch import free_port
    job = tmp_path / "job.sbatch"
    job.write_text(printed(str(TRAIN), "--cpu", "--nodes", "1", "--nproc-per-node", str(nproc),
                           "--port", str(free_port()), "--", "--epochs", str(epochs)))
    (tmp_path / "run").mkdir()
    return job


def test_cpu_job_runs_under_real_slurm(cluster, tmp_path):
    nproc = 2
    job = cpu_job(tmp_path, nproc, epochs=1)
    job_id = cluster.submit(job, f"--chdir={tmp_path}", f"--output={tmp_path}/out.txt",
                            env={"DDP_LESSON_RUN_DIR": str(tmp_path / "run")})
    info = cluster.wait(job_id, timeout=600)
    out = (tmp_path / "out.txt").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-3000:]
    host = info["NodeList"]
    assert f"job {job_id}: 1 nodes, rendezvous at {host}:" in out
    from ddp_lesson.launcher.runs import load_metrics
    rows = load_metrics(tmp_path / "run")
    assert sorted({r["rank"] for r in rows}) == list(range(nproc))  # the world: nodes x nproc
    tests = [r for r in rows if "test_accuracy" in r]
    assert len(tests) == nproc and len({r["test_accuracy"] for r in tests}) == 1
    assert tests[0]["test_accuracy"] > 0.3, tests  # chance is 10%
    assert f"test accuracy {tests[0]['test_accuracy']:.1%}" in out


def test_scancel_leaves_nothing_running(cluster, tmp_path):
    nproc = 2
    job = cpu_job(tmp_path, nproc, epochs=500)
    job_id = cluster.submit(job, f"--chdir={tmp_path}", f"--output={tmp_path}/out.txt",
                            env={"DDP_LESSON_RUN_DIR": str(tmp_path / "run")})
    cluster.wait(job_id, timeout=300, states={"RUNNING"} | slurm.ENDED)
    end = time.monotonic() + 300
    while len(list((tmp_path / "run").glob("metrics/rank*.jsonl"))) < nproc:  # the ranks train
        assert time.monotonic() < end and cluster.job(job_id)["JobState"] == "RUNNING"
        time.sleep(0.5)
    assert len(slurm.job_processes(job_id)) >= nproc + 2  # batch shell, srun/step, torchrun, ranks
    cluster.slurm("scancel", job_id)
    assert cluster.wait(job_id, timeout=120)["JobState"] == "CANCELLED"
    end = time.monotonic() + 60
    while slurm.job_processes(job_id) and time.monotonic() < end:
        time.sleep(0.5)
    assert slurm.job_processes(job_id) == []


def test_gpu_form_passes_test_only(cluster, tmp_path):
    """The GPU script is judged by sbatch --test-only against the cluster's paper GPU nodes
    (two with 8 GPUs each); asking for more than that is refused, so the check can fail."""
    for gpus, ok in ((4, True), (8, True), (9, False)):
        job = tmp_path / f"gpu{gpus}.sbatch"
        job.write_text(printed("train.py", "--nodes", "2", "--gpus-per-node", str(gpus), "--partition", "gpu"))
        out = cluster.slurm("sbatch", "--test-only", str(job), check=False)
        assert (out.returncode == 0) == ok, out.stderr
        if ok:
            assert "on nodes gpu[1-2]" in out.stderr, out.stderr


@pytest.mark.parametrize("flags", [["--nodes", "0"], ["--gpus-per-node", "-1"],
                                   ["--nodes", "99999999999999999999999"],
                                   ["--cpu", "--nproc-per-node", "0"], ["--cpu", "--gpus-per-node", "2"]])
def test_bad_numbers_exit_2(flags):
    out = subprocess.run([sys.executable, "-m", "ddp_lesson", "slurm", "train.py", *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddp_lesson: ") and lines[0].endswith("."), out.stderr
    assert "Traceback" not in out.stderr


def test_cpu_form_content():
    text = slurm.sbatch_script("t.py", nodes=3, cpu=True, nproc_per_node=5)
    assert "--gpus-per-node" not in text and "#SBATCH --cpus-per-task=5" in text
    assert "--nproc-per-node 5" in text and "#SBATCH --nodes=3" in text


KERNEL_LIKE = r'''
import json, os, sys
from pathlib import Path
from ddp_lesson.launcher import launch, runs, world
from ddp_lesson.rank.bundled import script
assert os.environ["SLURM_JOB_ID"] and os.environ["RANK"] == "5"  # inside an allocation, vars leaked in
run = launch.start(script("rank_table.py"), nproc=2, cpu=True,
                   run_dir=sys.argv[1], timeout=240)
res = run.wait()
rows = [{"RANK": r["rank"], "WORLD_SIZE": r["world_size"]} for r in runs.load_metrics(sys.argv[1])
        if "group_rank" in r]
out = "".join(p.read_text() for p in sorted((Path(sys.argv[1]) / "logs").glob("rank*.stdout.log")))
with world.start(nproc=2, cpu=True, timeout=240) as w:
    live = [r.value for r in w.run("import os; (rank, dist.get_world_size(), os.environ.get('MASTER_PORT'))")]
print(json.dumps({"status": res["status"], "message": res.get("message"), "rows": rows, "out": out,
                  "live": live, "job": os.environ["SLURM_JOB_ID"]}))
'''


def test_kernel_inside_an_allocation(cluster, tmp_path):
    """A JupyterLab started in a Slurm job (Open OnDemand) sees SLURM_* variables and whatever
    the job's shell exported; a kernel-like process under srun launches a run and a live
    world there: torchrun's world is its own (2 ranks), not the tutorial-style RANK=5,
    WORLD_SIZE=8, MASTER_PORT=1 of the job's environment."""
    leaked = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "MASTER_ADDR": "192.0.2.99",
              "MASTER_PORT": "1"}
    out = cluster.slurm("srun", "--ntasks=1", "--cpus-per-task=2", f"--chdir={tmp_path}",
                        sys.executable, "-c", KERNEL_LIKE, str(tmp_path / "run"),
                        env=leaked, timeout=600)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["job"].isdigit()
    assert got["status"] == "ok", got["message"]
    assert sorted((r["RANK"], r["WORLD_SIZE"]) for r in got["rows"]) == [(0, 2), (1, 2)]
    assert "MASTER_PORT=1 " not in got["out"] and "MASTER_ADDR=192.0.2.99" not in got["out"]
    assert sorted(v[:4] for v in got["live"]) == ["(0, ", "(1, "], got["live"]
    assert all(", 2, " in v and "'1')" not in v for v in got["live"]), got["live"]
