"""The generated sbatch script: its content, and what it runs when Slurm's commands are
replaced by stubs that record their arguments."""
import os
import subprocess
import sys

import pytest

from ddp_lesson import slurm


def test_content():
    text = slurm.sbatch_script("train_ddp.py", nodes=2, gpus_per_node=4, args=["--epochs", "3"],
                               partition="gpu", env={"NCCL_SOCKET_IFNAME": "ib0"})
    assert text.startswith("#!/bin/bash\n")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=gpu", "export NCCL_SOCKET_IFNAME=ib0",
                 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1'):
        assert line in text, line
    cmd = " ".join(l.strip().rstrip("\\") for l in text.split("srun torchrun", 1)[1].splitlines())
    assert "--nnodes $SLURM_NNODES" in cmd
    assert "--nproc-per-node 4" in cmd
    assert "--rdzv-backend c10d" in cmd
    assert "--rdzv-endpoint $head_node:$head_port" in cmd and "head_port=29500" in text
    assert "--rdzv-id $SLURM_JOB_ID" in cmd
    assert cmd.split()[-3:] == ["train_ddp.py", "--epochs", "3"]
    assert "--standalone" not in text and "torch.distributed.launch" not in text


def test_quoting_and_bad_input():
    text = slurm.sbatch_script("my script.py", args=["--name", "a b"])
    assert "'my script.py' --name 'a b'" in text
    with pytest.raises(ValueError):
        slurm.sbatch_script("x.py", nodes=0)
    with pytest.raises(ValueError):
        slurm.sbatch_script("x.py", port=70000)


def test_runs_with_stub_slurm(tmp_path):
    """bash runs the script; srun, scontrol and torchrun are stub shell functions (exported
    through the environment): the rendezvous endpoint must be the first host of the node
    list and the job id the rendezvous id."""
    job = tmp_path / "job.sbatch"
    slurm.write(job, "train_ddp.py", nodes=2, gpus_per_node=4, args=["--epochs", "1"])
    env = dict(os.environ, SLURM_JOB_NODELIST="gpu-node-[07-08]", SLURM_NNODES="2", SLURM_JOB_ID="4242")
    env["BASH_FUNC_scontrol%%"] = '() {  printf "gpu-node-07\\ngpu-node-08\\n"\n}'
    env["BASH_FUNC_srun%%"] = '() {  "$@"\n}'
    env["BASH_FUNC_torchrun%%"] = '() {  echo "TORCHRUN $*"\n}'
    out = subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    line = [l for l in out.stdout.splitlines() if l.startswith("TORCHRUN")][0]
    assert line == ("TORCHRUN --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d "
                    "--rdzv-endpoint gpu-node-07:29500 --rdzv-id 4242 --max-restarts 0 "
                    "train_ddp.py --epochs 1")
    assert "rendezvous at gpu-node-07:29500" in out.stdout


def test_cli():
    out = subprocess.run([sys.executable, "-m", "ddp_lesson", "slurm", "train.py", "--nodes", "3",
                          "--gpus-per-node", "8", "--", "--epochs", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --nodes=3" in out.stdout and "--nproc-per-node 8" in out.stdout
    assert out.stdout.rstrip().endswith("train.py --epochs 2")
