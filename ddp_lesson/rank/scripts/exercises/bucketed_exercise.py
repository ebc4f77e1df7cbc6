"""Exercise (lesson 09): write stage (d), the bucketed all-reduce, yourself.

The buckets are laid out for you: parameters in reverse registration order, a bucket closed
once it holds >= bucket_bytes. Reverse registration is only a guess at the order backward
produces the gradients; for this model it is not that order (a conv's weight gradient is
ready before its bias's), and torch DDP, which measures the order in its first step and
rebuilds its buckets from it, can end up with other ones (at the checker's 8 KiB it does,
and at section 4's 16 KiB, whose layouts section 4 prints). The sums are the same either way.
Keep this layout: the checker expects it.
Write `hook` (copy the gradient into its bucket; when the bucket's last gradient has
arrived, start ONE async all_reduce of the bucket) and `finish` (wait for every bucket,
average over ranks, copy back into each p.grad). The checker compares you with torch DDP.
"""
import torch
import torch.distributed as dist


def broadcast_parameters(model):
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=0)


class Bucketed:
    def __init__(self, model, bucket_bytes):
        broadcast_parameters(model)
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets, current, size = [], [], 0
        for p in reversed(params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.where = {}                    # parameter -> (bucket, offset in the bucket)
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for p in bucket:
                self.where[p] = (i, offset)
                offset += p.numel()
        self.flat = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
                     for b in self.buckets]
        self.ready = [0] * len(self.buckets)
        self.works = [None] * len(self.buckets)
        for p in params:
            p.register_post_accumulate_grad_hook(self.hook)

    def hook(self, p):
        i, offset = self.where[p]
        # your code here: copy p.grad into self.flat[i], count it, launch the bucket when full

    def finish(self):
        pass  # your code here: wait, average, copy back; then reset self.ready and self.works
