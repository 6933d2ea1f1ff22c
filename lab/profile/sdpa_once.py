#!/usr/bin/env python3
"""One PyTorch SDPA forward + backward (BF16) inside a CUDA profiler range, for `ncu --profile-from-start off`.

Same shapes as scripts/gpu/bench_sdpa.py (B*N = 16384, H*D = 2048, B x H x N x D, scale 1/sqrt(D)); two untimed
warm-up steps run outside the range, so ncu sees only the measured step's kernels.
Usage (on the device): ncu --profile-from-start off ... python3 lab/profile/sdpa_once.py cudnn 128 4096 [causal]
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def main():
    backend, d, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    causal = len(sys.argv) > 4 and sys.argv[4] == "causal"
    b, h = 16384 // n, 2048 // d
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    def step():
        with sdpa_kernel(BACKENDS[backend]):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return torch.autograd.grad(o, (q, k, v), do)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
