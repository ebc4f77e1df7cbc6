"""Lesson 09: a ring all-reduce built from point-to-point send/recv.

The tensor is cut into N chunks (N = world size; sizes may differ by one element when N
does not divide it). Rank r sends to rank r+1 and receives from rank r-1, in two phases:
  1. reduce-scatter, N-1 steps: pass a chunk on, add the chunk that arrives to your own.
     Afterwards rank r holds the full sum of chunk (r+1) mod N.
  2. all-gather, N-1 steps: pass the finished chunks around the ring, overwriting.
Each rank sends 2(N-1) chunks: 2(N-1)/N x the tensor's bytes, under 2x whatever N is; but
in 2(N-1) messages, so the latency part of its time grows with N.

Import it on every rank: `from ring_allreduce import ring_all_reduce`, or run it alone to
check it against dist.all_reduce:  torchrun --nproc-per-node 3 ring_allreduce.py
"""
import torch
import torch.distributed as dist


def ring_all_reduce(tensor):
    """Sum `tensor` over all ranks, in place. Returns the bytes this rank sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = list(torch.tensor_split(tensor.view(-1), world))   # views into the tensor
    sent = 0

    def exchange(send_chunk, recv_into):
        nonlocal sent
        if send_chunk.numel():             # empty chunks (tensor smaller than N) stay home
            send = dist.isend(send_chunk.contiguous(), right)
            sent += send_chunk.numel() * send_chunk.element_size()
        if recv_into.numel():
            dist.irecv(recv_into, left).wait()
        if send_chunk.numel():
            send.wait()

    for step in range(world - 1):          # 1. reduce-scatter
        incoming = torch.empty_like(chunks[(rank - step - 1) % world])
        exchange(chunks[(rank - step) % world], incoming)
        chunks[(rank - step - 1) % world] += incoming
    for step in range(world - 1):          # 2. all-gather
        exchange(chunks[(rank - step + 1) % world], chunks[(rank - step) % world])
    return sent


def bytes_written():
    """Bytes this process has written so far (Linux /proc/self/io): gloo's sockets among them."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def check(sizes=(1, 2, 3, 7, 1000, 1001, 2 ** 16 + 1), seed=0):
    """ring_all_reduce vs dist.all_reduce on random tensors; one dict per size, with the bytes
    the ring says it sent and the bytes this process really wrote meanwhile (measured)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for size in sizes:
        x = torch.randn(size, generator=torch.Generator().manual_seed(seed + 1000 * rank + size))
        ours, ref = x.clone(), x.clone()
        dist.barrier()
        w0 = bytes_written()
        sent = ring_all_reduce(ours)
        written = bytes_written() - w0
        dist.all_reduce(ref)
        rows.append({"size": size, "allclose": torch.allclose(ours, ref, rtol=1e-5, atol=1e-5),
                     "bytes_sent": sent, "bytes_written": written, "messages": 2 * (world - 1),
                     "ring_bytes": 2 * (world - 1) / world * x.numel() * x.element_size()})
    return rows


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for row in check():
        print(f"rank {dist.get_rank()}: {row}", flush=True)
    dist.destroy_process_group()
