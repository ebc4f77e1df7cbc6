"""Write the Slurm batch script for a multi-node torchrun job.

    print(slurm.sbatch_script("train_ddp.py", nodes=2, gpus_per_node=4, args=["--epochs", "3"]))

Slurm starts one task per node (`srun --ntasks-per-node=1`); each task is a torchrun
agent that starts `gpus_per_node` ranks; the agents meet through a c10d rendezvous on
the first node of the allocation (from `scontrol show hostnames`), with the job id as
rendezvous id so two jobs never mix.
"""
import re
import shlex

from . import BadInput

HEADER_KEYS = ("job_name", "partition", "account", "time", "output")
SAFE_HEADER = re.compile(r"[A-Za-z0-9_.,:%@+=/-]+")   # one #SBATCH word: no space, no newline
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _q(word):
    return shlex.quote(str(word))


def sbatch_script(script, nodes=2, gpus_per_node=4, args=(), job_name="ddp-lesson",
                  time="01:00:00", partition=None, account=None, cpus_per_task=None,
                  port=29500, output="%x-%j.out", env=None, setup=(), max_restarts=0,
                  python="python"):
    """The text of an sbatch script that runs `script` with torchrun on `nodes` nodes,
    `gpus_per_node` ranks each. `env`: extra variables to export (NCCL_SOCKET_IFNAME=...);
    `setup`: shell lines run first on the batch host (module load, conda activate...)."""
    values = {"job_name": job_name, "partition": partition, "account": account, "time": time,
              "output": output}
    for key, value in values.items():
        if value is not None and not SAFE_HEADER.fullmatch(str(value)):
            raise BadInput(f"The Slurm {key.replace('_', ' ')} {str(value)!r} may only hold letters, digits "
                           f"and _.,:%@+=/- (no spaces or new lines).")
    for key in env or {}:
        if not ENV_NAME.fullmatch(str(key)):
            raise BadInput(f"{str(key)!r} is not an environment variable name (letters, digits, _).")
    nodes, gpus_per_node = int(nodes), int(gpus_per_node)
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError("nodes and gpus_per_node must be at least 1")
    port = int(port)
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be a TCP port number, got {port}")
    cpus = int(cpus_per_task) if cpus_per_task else 8 * gpus_per_node
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={job_name}",
             f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1          # one torchrun agent per node",
             f"#SBATCH --gpus-per-node={gpus_per_node}",
             f"#SBATCH --cpus-per-task={cpus}",
             f"#SBATCH --time={time}",
             f"#SBATCH --output={output}"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    lines += ["", "set -euo pipefail", *setup, ""]
    lines += ["# The first node of the allocation hosts the rendezvous.",
              'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              f"head_port={port}",
              "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}"]
    for k, v in (env or {}).items():
        lines.append(f"export {k}={_q(v)}")
    lines += ["",
              'echo "job $SLURM_JOB_ID: $SLURM_NNODES nodes, rendezvous at $head_node:$head_port"',
              "",
              "srun torchrun \\",
              "    --nnodes $SLURM_NNODES \\",
              f"    --nproc-per-node {gpus_per_node} \\",
              "    --rdzv-backend c10d \\",
              "    --rdzv-endpoint $head_node:$head_port \\",
              "    --rdzv-id $SLURM_JOB_ID \\",
              f"    --max-restarts {int(max_restarts)} \\",
              f"    {_q(script)}" + "".join(f" {_q(a)}" for a in args),
              ""]
    return "\n".join(lines)


def write(path, script, **kwargs):
    """Write sbatch_script(script, **kwargs) to `path` (executable) and return the path."""
    import os
    text = sbatch_script(script, **kwargs)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    return path
