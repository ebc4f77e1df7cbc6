"""Write the Slurm batch script for a multi-node torchrun job.

    print(slurm.sbatch_script("ddp_basic.py", nodes=2, gpus_per_node=4, args=["--epochs", "3"]))

sbatch runs the script once, on the first node; its `srun` starts one task per node
(`--ntasks-per-node=1`); each task is a torchrun agent, `python -m torch.distributed.run`, that starts `gpus_per_node` ranks; the agents meet through a c10d rendezvous on
the first node of the allocation (from `scontrol show hostnames`), with the job id as
rendezvous id. The rendezvous port comes from the job id too (unless `port` is given): two jobs
whose first node is the same machine would otherwise share one port, and the second job's agents,
unable to bind it, quietly join the first job's store as clients (c10d_rendezvous_backend's
_create_tcp_store tries host, then client) and fail when that job ends. With cpu=True the script asks for no GPUs and starts
`nproc_per_node` ranks per node; give a CPU partition (nothing here enforces one), since a script
that picks nccl whenever CUDA is available would use a GPU node's GPUs anyway.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import BadInput
from . import validate

HEADER_KEYS = ("job_name", "partition", "account", "time", "output")
SAFE_HEADER = re.compile(r"[A-Za-z0-9_.,:%@+=/-]+")   # one #SBATCH word: no space, no newline
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_NODES = 65535      # far beyond any cluster; a typo like 99999999999999999999 stops here
MAX_PER_NODE = 1024


def _q(word):
    return shlex.quote(str(word))


def sbatch_script(script, nodes=2, gpus_per_node=4, args=(), job_name="ddp-lesson",
                  time="01:00:00", partition=None, account=None, cpus_per_task=None,
                  port=None, output="%x-%j.out", env=None, setup=(), max_restarts=0,
                  python=None, cpu=False, nproc_per_node=None):
    """The text of an sbatch script that runs `script` with torchrun on `nodes` nodes,
    `gpus_per_node` ranks each. `env`: extra variables to export (NCCL_SOCKET_IFNAME=...);
    `setup`: shell lines run first on the batch host (module load, conda activate...).
    cpu=True: no GPUs asked for; `nproc_per_node` CPU ranks (default 2) on each node.
    port=None: a port derived from the job id (20000 + id % 20000), so jobs sharing a first
    node do not share a rendezvous store.
    python: the interpreter that runs torchrun on every node, as `python -m torch.distributed.run`
    (torchrun's own module), so the job needs no torchrun on PATH; default sys.executable, this
    kernel's interpreter: right where the nodes share its path (a shared home or environment)."""
    values = {"job_name": job_name, "partition": partition, "account": account, "time": time,
              "output": output}
    for key, value in values.items():
        if value is not None and not SAFE_HEADER.fullmatch(str(value)):
            raise BadInput(f"The Slurm {key.replace('_', ' ')} {str(value)!r} may only hold letters, digits "
                           f"and _.,:%@+=/- (no spaces or new lines).")
    for key in env or {}:
        if not ENV_NAME.fullmatch(str(key)):
            raise BadInput(f"{str(key)!r} is not an environment variable name (letters, digits, _).")
    nodes = validate.bounded("--nodes", nodes, 1, MAX_NODES)
    if cpu:
        per_node = validate.bounded("--nproc-per-node", 2 if nproc_per_node is None else nproc_per_node,
                                  1, MAX_PER_NODE)
    else:
        per_node = validate.bounded("--gpus-per-node", gpus_per_node, 1, MAX_PER_NODE)
    port = None if port is None else validate.bounded("port", port, 1, 65535)
    # one core per CPU rank; a GPU rank gets 8 for its data loading
    cpus = (validate.bounded("--cpus-per-task", cpus_per_task, 1, 1 << 20) if cpus_per_task
            else per_node * (1 if cpu else 8))
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={job_name}",
             f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1          # one torchrun agent per node",
             (f"#SBATCH --gpus-per-node={per_node}" if not cpu
              else "# no GPUs asked for: CPU ranks on gloo (where the nodes have no GPU)"),
             f"#SBATCH --cpus-per-task={cpus}",
             f"#SBATCH --time={time}",
             f"#SBATCH --output={output}"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    lines += ["", "set -euo pipefail", *setup, ""]
    lines += ["# The first node of the allocation hosts the rendezvous.",
              # sed reads the whole list: `head` would exit early and, under pipefail, a long
              # list's SIGPIPE would end the script
              'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
              ("# a port per job: two jobs on the same first node must not share a store\n"
               "head_port=$((20000 + SLURM_JOB_ID % 20000))" if port is None else f"head_port={port}"),
              "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}"]
    for k, v in (env or {}).items():
        lines.append(f"export {k}={_q(v)}")
    lines += ["",
              'echo "job $SLURM_JOB_ID: $SLURM_NNODES nodes, rendezvous at $head_node:$head_port"',
              "",
              "# from Slurm 22.05 on srun does not inherit sbatch's --cpus-per-task (23.11 sets",
              "# SRUN_CPUS_PER_TASK from sbatch again): asking again is harmless",
              "# torchrun is the module torch.distributed.run of this interpreter: no PATH needed",
              f"srun --cpus-per-task=$SLURM_CPUS_PER_TASK {_q(python or sys.executable)} -m torch.distributed.run \\",
              "    --nnodes $SLURM_NNODES \\",
              f"    --nproc-per-node {per_node} \\",
              "    --rdzv-backend c10d \\",
              "    --rdzv-endpoint $head_node:$head_port \\",
              "    --rdzv-id $SLURM_JOB_ID \\",
              f"    --max-restarts {int(max_restarts)} \\",
              f"    {_q(script)}" + "".join(f" {_q(a)}" for a in args),
              ""]
    return "\n".join(lines)


def write(path, script, **kwargs):
    """Write sbatch_script(script, **kwargs) to `path` (executable) and return the path."""
    text = sbatch_script(script, **kwargs)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    return path


def from_flags(a, script_args=()):
    """The script for `python -m ddp_lesson slurm`'s parsed flags (BadInput for a flag that
    belongs to the other form)."""
    if a.cpu and a.gpus_per_node is not None:
        raise BadInput("--gpus-per-node is for GPU jobs; with --cpu give --nproc-per-node.")
    if not a.cpu and a.nproc_per_node is not None:
        raise BadInput("--nproc-per-node is for CPU jobs (--cpu); a GPU job starts one rank per GPU "
                       "(--gpus-per-node).")
    return sbatch_script(a.script, nodes=a.nodes, args=script_args, time=a.time, partition=a.partition,
                         gpus_per_node=4 if a.gpus_per_node is None else a.gpus_per_node,
                         cpu=a.cpu, nproc_per_node=a.nproc_per_node, port=a.port)


# --- a real Slurm: the one-machine test cluster of slurm_cluster.sh, and its jobs ---
CLUSTER_TOOL = Path(__file__).resolve().with_name("slurm_cluster.sh")   # shipped with the package
SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE"}


def why_no_cluster():
    """None where this machine can run slurm_cluster.sh, else one sentence why not."""
    missing = [p for p in SLURM_PROGRAMS if not shutil.which(p)]
    if missing or not CLUSTER_TOOL.exists():
        return (f"No Slurm here ({', '.join(missing) or CLUSTER_TOOL.name} missing): "
                f"apt-get install -y slurmctld slurmd munge slurm-client.")
    if os.geteuid() != 0:
        return "A test Slurm cluster needs root (slurmd starts jobs as their user)."
    return None


class Cluster:
    """A one-machine Slurm (munged, slurmctld, slurmd) in its own folder and on its own ports,
    from slurm_cluster.sh; `env` is os.environ with SLURM_CONF pointing at it.

        with slurm.Cluster() as c:
            job = c.submit("job.sbatch")
            print(c.wait(job)["JobState"])
    """

    def __init__(self, folder=None):
        from .launch import free_port
        self.folder = Path(folder or tempfile.mkdtemp(prefix="ddp-lesson-slurm-"))
        self.tool_env = dict(os.environ, DDP_LESSON_SLURMCTLD_PORT=str(free_port()),
                             DDP_LESSON_SLURMD_PORT=str(free_port()))
        self.env = None

    def up(self):
        out = subprocess.run(["bash", str(CLUSTER_TOOL), "up", str(self.folder)], env=self.tool_env,
                             capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"slurm_cluster.sh up failed: {out.stderr.strip()}")
        self.env = dict(os.environ, SLURM_CONF=str(self.folder / "slurm.conf"))
        return self

    def down(self):
        subprocess.run(["bash", str(CLUSTER_TOOL), "down", str(self.folder)], env=self.tool_env,
                       capture_output=True, text=True, timeout=120)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()

    def slurm(self, *args, env=None, check=True, timeout=60):
        """Run one Slurm client command (sbatch, scontrol...) against this cluster."""
        out = subprocess.run(list(args), env=dict(self.env, **(env or {})), capture_output=True,
                             text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed: {out.stderr.strip()}")
        return out

    def submit(self, script_path, *sbatch_args, env=None):
        """sbatch the script (exporting this environment plus `env`); the job id."""
        out = self.slurm("sbatch", "--parsable", *sbatch_args, str(script_path), env=env)
        return out.stdout.strip().split(";")[0]

    def job(self, job_id):
        """`scontrol show job` as a dict (JobState, ExitCode, NodeList, StdOut...)."""
        text = self.slurm("scontrol", "show", "job", "--oneliner", str(job_id)).stdout
        return dict(word.split("=", 1) for word in text.split() if "=" in word)

    def wait(self, job_id, timeout=600, states=ENDED):
        """Poll the job until its state is one of `states` (default: it ended); its dict."""
        end = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > end:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout} s")
            time.sleep(0.5)


def job_processes(job_id):
    """Pids of the processes that carry SLURM_JOB_ID=job_id (Slurm sets it in every process
    of the job, and torchrun's ranks inherit it)."""
    mark = f"SLURM_JOB_ID={job_id}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if mark in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids
