#!/usr/bin/env python3
"""Times PyTorch SDPA in BF16 (cuDNN and FlashAttention-2 backends) over the standard sweep.

The baseline side of `sagebwd bench`, measured the same way (docs/PERFORMANCE.md, the device
library's METHOD.md):
- shapes: B*N = --tokens (16384), H*D = --hidden (2048), D in --head-dim, N in --n, causal and not;
  tensors B x H x N x D (SDPA's native layout, ours too); softmax scale 1/sqrt(D) (SDPA's default);
- each repetition is one training step of attention: events before the forward (with autograd on,
  so it saves what the backward needs, as ours does), between forward and backward
  (`torch.autograd.grad`, which returns fresh dQ, dK, dV) and after the backward; fwd, bwd and
  fwd+bwd are the medians over repetitions, after warm-up, with one repetition queued ahead of the
  one being read so the GPU never idles;
- inputs rotated among --input-sets device-resident sets so the 60 MB L2 does not flatter;
- TOPS by the FlashAttention convention: fwd = 4*B*H*N*N*D (halved when causal), bwd = 2.5 x fwd,
  fwd+bwd = 3.5 x fwd;
- peak memory: one input set (Q, K, V, dO) + the high-water mark of what forward + backward allocate
  (torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus what was allocated before).

A backend that cannot run a shape is recorded with its error, and the sweep goes on.
Usage: python3 scripts/gpu/bench_sdpa.py [--quick] [--json FILE] [--backends cudnn,flash] ...
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def int_list(text):
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head-dim", "-d", type=int_list, default=[64, 128], help="head dims, comma-separated")
    p.add_argument("--n", "-n", type=int_list, default=[1024, 2048, 4096, 8192, 16384], help="sequence lengths")
    p.add_argument("--causal", choices=["on", "off", "both"], default="both")
    p.add_argument("--tokens", type=int, default=16384, help="B*N")
    p.add_argument("--hidden", type=int, default=2048, help="H*D")
    p.add_argument("--backends", default="cudnn,flash", help="comma-separated: " + ",".join(BACKENDS))
    p.add_argument("--reps", type=int, default=30, help="timed repetitions per point")
    p.add_argument("--min-reps", type=int, default=3, help="fewest repetitions, even past --max-time")
    p.add_argument("--warmup", type=int, default=5, help="untimed forward+backward runs per point")
    p.add_argument("--max-time", type=float, default=10.0, help="seconds of timed fwd+bwd per point")
    p.add_argument("--input-sets", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results as JSON to this file")
    p.add_argument("--quick", action="store_true", help="N in {1024, 4096}, 10 repetitions, 2 warm-up runs")
    a = p.parse_args(argv)
    if a.quick:
        a.n, a.reps, a.warmup = [1024, 4096], 10, 2
    a.backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    unknown = [b for b in a.backends if b not in BACKENDS]
    if unknown:
        p.error(f"unknown backend(s) {unknown}; expected some of {list(BACKENDS)}")
    if min(a.reps, a.min_reps, a.input_sets) < 1:
        p.error("--reps, --min-reps and --input-sets must be at least 1")
    return a


def sweep(a):
    """(D, N, B, H, causal) in run order, checked against --tokens and --hidden."""
    causals = {"on": [True], "off": [False], "both": [False, True]}[a.causal]
    points = []
    for d in a.head_dim:
        if a.hidden % d:
            sys.exit(f"error: --hidden {a.hidden} is not a multiple of head dim {d}")
        for causal in causals:
            for n in a.n:
                if a.tokens % n:
                    sys.exit(f"error: --tokens {a.tokens} is not a multiple of N = {n}")
                points.append((d, n, a.tokens // n, a.hidden // d, causal))
    return points


def fwd_flops(d, n, b, h, causal):
    full = 4.0 * b * h * n * n * d
    return full / 2 if causal else full


def tops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def input_sets(shape, count, seed):
    """`count` sets of (Q, K, V with requires_grad, dO): Gaussian, sigma = 1, BF16."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    sets = []
    for _ in range(count):
        q, k, v, d_o = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        sets.append((q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), d_o))
    return sets


def fwd_bwd(x, causal):
    """One forward + backward with events before, between and after; returns the events and the
    tensors, which the caller keeps until the next repetition is queued (so nothing is freed under
    a running kernel's feet, and allocation stays out of the timed region)."""
    q, k, v, d_o = x
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    ev[0].record()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    ev[1].record()
    grads = torch.autograd.grad(out, (q, k, v), d_o)
    ev[2].record()
    return ev, (out, grads)


def time_point(sets, causal, reps, min_reps, max_ms):
    """Per repetition (fwd ms, bwd ms), one repetition queued ahead of the one being read; stops
    once the finished ones took max_ms (after at least min_reps)."""
    done, pending = [], None
    for rep in range(reps):
        current = fwd_bwd(sets[rep % len(sets)], causal)
        if pending is not None:
            ev = pending[0]
            ev[2].synchronize()
            done.append((ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])))
        pending = current
        if len(done) + 1 >= min_reps and sum(a + b for a, b in done) >= max_ms:
            break
    ev = pending[0]
    ev[2].synchronize()
    done.append((ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])))
    return done


def peak_memory(x, causal):
    """One input set + the high-water mark of forward + backward's allocations, in bytes."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _, keep = fwd_bwd(x, causal)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del keep
    return peak + sum(t.numel() * t.element_size() for t in x)


def run_point(a, backend, sets, d, n, b, h, causal):
    with sdpa_kernel([BACKENDS[backend]]):
        for i in range(a.warmup):
            fwd_bwd(sets[i % len(sets)], causal)
        mem = peak_memory(sets[0], causal)
        t_start = time.time()
        timed = time_point(sets, causal, a.reps, min(a.min_reps, a.reps), a.max_time * 1e3)
        t_end = time.time()
    fwd = [t[0] for t in timed]
    bwd = [t[1] for t in timed]
    both = [f + g for f, g in timed]
    flops = fwd_flops(d, n, b, h, causal)
    f_ms, b_ms, fb_ms = statistics.median(fwd), statistics.median(bwd), statistics.median(both)
    return {
        "fwd_flops": flops,
        "fwd_ms": f_ms, "bwd_ms": b_ms, "fwdbwd_ms": fb_ms,
        "fwd_tops": tops(flops, f_ms), "bwd_tops": tops(2.5 * flops, b_ms), "fwdbwd_tops": tops(3.5 * flops, fb_ms),
        "reps": len(timed),
        "peak_mem_bytes": mem,
        "fwd_ms_all": fwd, "bwd_ms_all": bwd,
        # Wall-clock span of the timed repetitions (Unix s), for the SM-clock log of scripts/gpu/bench.sh.
        "timed_unix_s": [t_start, t_end],
    }


def table(results):
    lines = ["| impl | D | N | B | H | causal | fwd ms | bwd ms | fwd+bwd ms | fwd TFLOP/s | bwd TFLOP/s "
             "| fwd+bwd TFLOP/s | peak MiB | reps |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        head = f"| {r['impl']} | {r['head_dim']} | {r['n']} | {r['batch']} | {r['heads']} | {'yes' if r['causal'] else 'no'} "
        if "error" in r:
            lines.append(head + f"| error: {r['error'][:80]} |||||||")
            continue
        lines.append(head + f"| {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | {r['fwd_tops']:.1f} "
                     f"| {r['bwd_tops']:.1f} | {r['fwdbwd_tops']:.1f} | {r['peak_mem_bytes'] / 2**20:.0f} | {r['reps']} |")
    return "\n".join(lines)


def main():
    a = parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_sdpa.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    points = sweep(a)
    device = torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuDNN {torch.backends.cudnn.version()}", file=sys.stderr)
    results = []
    for (d, n, b, h, causal) in points:
        sets = None  # free the previous point's inputs before drawing new ones
        sets = input_sets((b, h, n, d), a.input_sets, a.seed)
        for backend in a.backends:
            rec = {"impl": backend, "head_dim": d, "n": n, "batch": b, "heads": h, "causal": causal}
            t0 = time.time()
            try:
                rec.update(run_point(a, backend, sets, d, n, b, h, causal))
                note = f"fwd+bwd {rec['fwdbwd_ms']:.3f} ms = {rec['fwdbwd_tops']:.1f} TFLOP/s, {rec['reps']} reps"
            except RuntimeError as e:  # the backend does not support this shape / device
                rec["error"] = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
                note = "error: " + rec["error"]
                torch.cuda.synchronize()
            print(f"{backend} D={d} N={n} B={b} H={h} {'causal' if causal else 'full'}: {note} "
                  f"({time.time() - t0:.1f} s)", file=sys.stderr, flush=True)
            results.append(rec)
    print(table(results))
    if a.json:
        report = {
            "tool": "bench_sdpa.py",
            "device": device,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "timing": "CUDA events around F.scaled_dot_product_attention (autograd on) and torch.autograd.grad, "
                      "after warm-up; median over repetitions; inputs rotated among device-resident sets",
            "flops": "fwd = 4*B*H*N*N*D (halved for causal), bwd = 2.5 x fwd, fwd+bwd = 3.5 x fwd",
            "mem_method": "one input set (Q,K,V,dO) + high-water mark of allocations during forward+backward "
                          "(torch.cuda.max_memory_allocated)",
            "settings": {k: getattr(a, k) for k in ("tokens", "hidden", "reps", "min_reps", "warmup", "max_time",
                                                    "input_sets", "seed")},
            "results": results,
        }
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    if all("error" in r for r in results):
        sys.exit("error: every SDPA point failed")


if __name__ == "__main__":
    main()
