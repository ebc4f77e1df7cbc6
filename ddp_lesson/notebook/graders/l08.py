"""Notebook 08's exercises: global rank and device from torchrun's variables (check_ranks), and
an sbatch script, judged by what Slurm reads and what bash runs (check_job)."""
import re
from pathlib import Path


def check_ranks(global_rank, device_for):
    """08: global_rank(node_rank, local_rank, procs_per_node) and device_for(env) on every rank
    of several layouts (3 nodes x 4, 2 x 8, 4 x 2), against multinode.expected_table; env is
    what torchrun sets (RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE...)."""
    from ...launcher import multinode
    for nodes, per in ((3, 4), (2, 8), (4, 2)):
        for r in multinode.expected_table(nodes=nodes, procs_per_node=per):
            got = global_rank(r["NODE_RANK"], r["LOCAL_RANK"], per)
            assert got == r["RANK"], (f"{nodes} nodes x {per}: node {r['NODE_RANK']}, local rank "
                                      f"{r['LOCAL_RANK']} is rank {r['RANK']}, you said {got}")
            env = {"RANK": str(r["RANK"]), "LOCAL_RANK": str(r["LOCAL_RANK"]), "GROUP_RANK": str(r["NODE_RANK"]),
                   "WORLD_SIZE": str(nodes * per), "LOCAL_WORLD_SIZE": str(per), "GROUP_WORLD_SIZE": str(nodes),
                   "ROLE_RANK": str(r["RANK"]), "ROLE_WORLD_SIZE": str(nodes * per), "MASTER_ADDR": "node0",
                   "MASTER_PORT": "29500"}
            got = device_for(env)
            assert got == f"cuda:{r['LOCAL_RANK']}", (f"{nodes} nodes x {per} GPUs, rank {r['RANK']} (local rank "
                                                      f"{r['LOCAL_RANK']}): cuda:{r['LOCAL_RANK']}, you said {got!r}")
    return True


JOB_WANT = {"nodes": 4, "gpus_per_node": 8, "partition": "gpu", "ifname": "ib0", "args": ["ddp_basic.py", "--epochs", "10"]}


def _sbatch_options(text):
    """The #SBATCH options Slurm reads: those before the first command line."""
    opts = {}
    for line in text.splitlines()[1:]:
        s = line.strip()
        if s and not s.startswith("#"):
            break
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:[= ](\S+))?", s)
        if m:
            opts[m.group(1)] = m.group(2)
    return opts


def _run_job(text, job_id):
    """bash runs the batch script on a pretend 4-node allocation, with scontrol and srun as
    stand-ins; srun prints what it would start, one word a line, and the NCCL interface it sees."""
    import os
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        job = Path(d) / "job.sbatch"
        job.write_text(text)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_"))}
        env.update(SLURM_JOB_NODELIST="gpu[07-10]", SLURM_NNODES="4", SLURM_JOB_ID=str(job_id),
                   SLURM_CPUS_PER_TASK="64")
        env["BASH_FUNC_scontrol%%"] = '() {  printf "gpu07\\ngpu08\\ngpu09\\ngpu10\\n"\n}'
        env["BASH_FUNC_srun%%"] = '() {  echo "IFNAME=${NCCL_SOCKET_IFNAME:-}"; for w in "$@"; do echo "ARG $w"; done\n}'
        out = subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True, timeout=60, cwd=d)
    assert out.returncode == 0, f"bash ran the script and it failed: {out.stderr.strip()[-300:]}"
    lines = out.stdout.splitlines()
    words = [l[4:] for l in lines if l.startswith("ARG ")]
    ifname = [l[7:] for l in lines if l.startswith("IFNAME=")]
    assert words, "the script never calls srun"
    return words, (ifname or [""])[0]


def _torchrun_flags(words):
    """srun's words after torchrun (or python -m torch.distributed.run): ({flag: value}, script args)."""
    if "torch.distributed.run" in words:
        rest = words[words.index("torch.distributed.run") + 1:]
    else:
        assert "torchrun" in words, f"srun does not start torchrun: {' '.join(words)}"
        rest = words[words.index("torchrun") + 1:]
    flags = {}
    while rest and rest[0].startswith("--"):
        key, _, value = rest[0][2:].replace("_", "-").partition("=")
        if value or key in ("standalone",):
            rest = rest[1:]
        else:
            value, rest = rest[1], rest[2:]
        flags[key] = value
    return flags, rest


def check_job(text):
    """08: the sbatch script `text` runs ddp_basic.py --epochs 10 on 4 nodes of 8 GPUs on
    partition gpu, with NCCL on interface ib0 and a rendezvous on the first node at a port of its
    own job. Judged by what Slurm reads and what bash runs: the #SBATCH options, then the script
    run on a pretend allocation twice, with two job ids."""
    assert isinstance(text, str) and text.startswith("#!"), "give the text of an sbatch script (sbatch_script returns it)"
    opts = _sbatch_options(text)
    for key, want in (("nodes", "4"), ("gpus-per-node", "8"), ("partition", "gpu"), ("ntasks-per-node", "1")):
        assert opts.get(key) == want, f"#SBATCH --{key} is {opts.get(key)!r}, not {want}"
    ports = []
    for job_id in (4242, 4243):
        words, ifname = _run_job(text, job_id)
        flags, script_args = _torchrun_flags(words)
        assert ifname == "ib0", f"srun sees NCCL_SOCKET_IFNAME={ifname!r}, not ib0: export it in the script"
        assert flags.get("nnodes") == "4", f"torchrun got --nnodes {flags.get('nnodes')}, not 4 (the job's nodes)"
        assert flags.get("nproc-per-node") == "8", f"torchrun got --nproc-per-node {flags.get('nproc-per-node')}, not 8"
        assert flags.get("rdzv-backend") == "c10d", "the agents need --rdzv-backend c10d"
        host, _, port = (flags.get("rdzv-endpoint") or "").rpartition(":")
        assert host == "gpu07", f"the rendezvous is at {flags.get('rdzv-endpoint')!r}, not on the first node, gpu07"
        ports.append(port)
        assert script_args == JOB_WANT["args"], f"torchrun runs {' '.join(script_args)!r}, not 'ddp_basic.py --epochs 10'"
    assert ports[0] != ports[1], (f"jobs 4242 and 4243 both meet on port {ports[0]}: two jobs on one first node "
                                  f"would share a store; leave port= out, the job id picks one")
    return True
