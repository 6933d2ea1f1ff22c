"""A small GPT trained with SageBwd attention (nanoGPT-style). Needs an NVIDIA GPU (sm_80 or newer,
Hopper for the fast kernels), PyTorch with CUDA and the sagebwd wheel.

    python examples/train_gpt.py --steps 200 --attn sagebwd    # or --attn sdpa to compare

Data: a text file (--data, bytes as tokens), else a synthetic corpus of repeated random phrases."""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import sagebwd


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, attn):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.attn = heads, kv_heads, dim // heads, attn
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.GELU(), nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, n, self.heads, self.head_dim)
        k = k.view(b, n, self.kv_heads, self.head_dim)
        v = v.view(b, n, self.kv_heads, self.head_dim)
        if self.attn == "sagebwd":
            o = sagebwd.attention(q, k, v, causal=True, layout="bnhd")  # [B, N, H, d]
        else:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True).transpose(1, 2)
        x = x + self.proj(o.reshape(b, n, -1))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab, dim, layers, heads, kv_heads, ctx, attn):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, attn) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def corpus(path, n_tokens, seed):
    if path:
        return torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(seed)
    phrases = torch.randint(0, 256, (64, 48), generator=g)
    return phrases[torch.randint(0, 64, (n_tokens // 48 + 1,), generator=g)].reshape(-1)[:n_tokens]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attn", choices=["sagebwd", "sdpa"], default="sagebwd")
    ap.add_argument("--data", default=None)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (fullgraph)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this example needs a CUDA GPU")
    torch.manual_seed(a.seed)
    dev = "cuda"
    data = corpus(a.data, 4_000_000, a.seed)
    model = GPT(256, a.dim, a.layers, a.heads, a.kv_heads, a.ctx, a.attn).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    step_fn = torch.compile(model, fullgraph=True) if a.compile else model
    g = torch.Generator().manual_seed(a.seed + 1)
    t0 = time.time()
    for step in range(a.steps):
        ix = torch.randint(0, len(data) - a.ctx - 1, (a.batch,), generator=g)
        x = torch.stack([data[i:i + a.ctx] for i in ix]).to(dev, non_blocking=True)
        y = torch.stack([data[i + 1:i + 1 + a.ctx] for i in ix]).to(dev, non_blocking=True)
        lr = a.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / a.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 20 == 0 or step == a.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  lr {lr:.2e}  {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
