"""Lesson 11's model, as nanoGPT's model.py is to its train.py: a small decoder-only transformer
over bytes (pre-LayerNorm, tied embeddings). Nothing here is distributed: gpt_ddp.py trains it
with DDP.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


def causal_mask(T, device):
    """True where position i may look at position j: j <= i, itself and the bytes before it.
    What is_causal=True means; the model does not build it (capstone.check_is_causal compares)."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        # softmax(q kᵀ / sqrt(d_head)) v over the bytes up to each position: PyTorch's fused
        # attention. is_causal=True, not an attn_mask: on GPUs only then can it pick the flash kernel
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers=2, heads=4, width=192, block=64, vocab=256, checkpoint=False):
        super().__init__()
        self.checkpoint = checkpoint              # activation checkpointing: see forward
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight        # tied: one matrix reads and writes bytes
        for m in self.modules():                  # GPT-2's init: small weights, zero biases, a loss near ln 256 at step 0
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for b in self.blocks:                     # ... and the layers that add to the residual stream
            for m in (b.proj, b.mlp[2]):          # scaled by 1/sqrt(2 L): 2 L of them add up
                nn.init.normal_(m.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            if self.checkpoint and self.training:  # keep only the block's input; the backward reruns its forward
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln(x))


def flops_per_token(model, layers, width, block):
    """6N + 12 L T d, training FLOPs per token (forward 2, backward 4 per weight and token).
    N counts the weights that multiply: every Linear (the tied head once), not biases,
    LayerNorms or the position table. 12 L T d: the attention scores and their use on v,
    over the full T x T (as nanoGPT and PaLM count it), though the causal mask makes half of
    them unused."""
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return 6 * n + 12 * layers * block * width


@torch.no_grad()
def generate(model, prompt, n, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([list(prompt)], device=device)
    block = model.pos.num_embeddings
    for _ in range(n):
        probs = model(idx[:, -block:])[0, -1].float().softmax(-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=g)[None]], 1)
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")
