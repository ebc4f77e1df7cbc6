"""Each rank reports who it is: the environment torchrun gives it, across nodes.

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 \
             --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id job1 rank_table.py

Every rank prints one line and logs RANK, LOCAL_RANK, GROUP_RANK (the node's rank),
WORLD_SIZE, LOCAL_WORLD_SIZE and its host (and, under Slurm, the job id, the rendezvous id
torchrun was given, and how many CPUs it may run on); an all_gather checks that every global rank
exists exactly once.
"""
import os
import socket

import torch
import torch.distributed as dist

from ddp_lesson.rank import metrics

KEYS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def main():
    env = {k: os.environ.get(k) for k in KEYS}
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert rank == int(env["RANK"]) and world == int(env["WORLD_SIZE"])
    seen = [None] * world
    dist.all_gather_object(seen, (rank, int(env["GROUP_RANK"]), int(env["LOCAL_RANK"])))
    assert sorted(r for r, _, _ in seen) == list(range(world)), seen
    metrics.log(0, local_rank=int(env["LOCAL_RANK"]), group_rank=int(env["GROUP_RANK"]),
                world_size=world, local_world_size=int(env["LOCAL_WORLD_SIZE"]),
                host=socket.gethostname(), pid=os.getpid(), all_ranks=seen,
                agent_pid=os.getppid(),  # the torchrun agent that started this rank
                run_id=os.environ.get("TORCHELASTIC_RUN_ID"), slurm_job_id=os.environ.get("SLURM_JOB_ID"),
                slurm_cpus_per_task=os.environ.get("SLURM_CPUS_PER_TASK"),
                cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")  # not on macOS
                else os.cpu_count())  # the CPUs Slurm's task plugin left this rank
    print(" ".join(f"{k}={v}" for k, v in env.items()), f"host={socket.gethostname()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
