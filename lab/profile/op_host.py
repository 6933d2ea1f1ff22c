"""Where the PyTorch op's host time goes: host microseconds per call of each layer of `sagebwd.attention`
(the public function, the registered custom op, the native call alone, a do-nothing custom op for torch.library's
own cost, SDPA), forward and forward+backward, on a launch-bound problem; then a torch.profiler table of the
native call's driver API calls (CUPTI) and, with py-spy present, a native sampling profile of the forward loop.

    python3 lab/profile/op_host.py OUTDIR [--shape B,H,N,d] [--py-spy]

Needs the sagebwd wheel (and its kernel cache: SAGEBWD_CACHE_DIR) on a GPU machine. Writes OUTDIR/host.json,
OUTDIR/profile.txt (and OUTDIR/pyspy.txt, collapsed stacks)."""

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def host_us(fn, iters=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        best = min(best, (t1 - t0) / iters * 1e6)
    return best


@torch.library.custom_op("sagebwd_lab::noop", mutates_args=(), device_types="cuda")
def noop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, preset: str, int8: str, bf16: str,
         smooth_k: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="1,1,64,64")
    ap.add_argument("--py-spy", action="store_true")
    ap.add_argument("--loop", action="store_true", help=argparse.SUPPRESS)  # the py-spy target
    a = ap.parse_args()
    import sagebwd
    from sagebwd import _runtime, ops

    b, h, n, d = (int(x) for x in a.shape.split(","))
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    dev = _runtime.device(0)
    cfg = ops._config("sagebwd", "", "", None)
    dims = (b, h, h, n, n, d)
    o = torch.empty_like(q)
    stream = torch.cuda.current_stream().cuda_stream

    def native():
        return dev.forward(stream, dims, False, cfg, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr())

    if a.loop:
        with torch.no_grad():
            t_end = time.time() + 8
            while time.time() < t_end:
                for _ in range(200):
                    sagebwd.attention(q, k, v)
                torch.cuda.synchronize()
        return

    os.makedirs(a.out, exist_ok=True)
    fwd = torch.ops.sagebwd.attention_forward
    r = {"shape": [b, h, n, d], "stream": stream}
    with torch.no_grad():
        r["fwd_attention_us"] = host_us(lambda: sagebwd.attention(q, k, v))
        r["fwd_custom_op_us"] = host_us(lambda: fwd(q, k, v, False, "sagebwd", "", "", None))
        r["fwd_autograd_fn_us"] = host_us(lambda: ops._Attention.apply(q, k, v, False, cfg))
        r["fwd_run_forward_us"] = host_us(lambda: ops._run_forward(q, k, v, False, cfg))
        r["fwd_native_us"] = host_us(native)
        r["raw_stream_us"] = host_us(lambda: ops._raw_stream(0))
        saved = native()
        r["lse_dlpack_us"] = host_us(lambda: torch.utils.dlpack.from_dlpack(saved.lse_dlpack(0)))
        r["noop_custom_op_us"] = host_us(lambda: torch.ops.sagebwd_lab.noop(q, k, v, False, "sagebwd", "", "", False))
        r["empty_like_us"] = host_us(lambda: torch.empty_like(q))
        r["sdpa_fwd_us"] = host_us(lambda: F.scaled_dot_product_attention(q, k, v))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    r["fwd_bwd_attention_us"] = host_us(lambda: sagebwd.attention(qg, kg, vg).backward(do), iters=100)
    r["fwd_bwd_sdpa_us"] = host_us(lambda: F.scaled_dot_product_attention(qg, kg, vg).backward(do), iters=100)
    ob, lse = fwd(q, k, v, False, "sagebwd", "", "", None)
    bwd = torch.ops.sagebwd.attention_backward
    r["bwd_custom_op_us"] = host_us(lambda: bwd(do, q, k, v, ob, lse), iters=100)
    for key, val in r.items():
        print(f"{key:>24}: {val:.1f}" if isinstance(val, float) else f"{key:>24}: {val}")
    with open(os.path.join(a.out, "host.json"), "w") as f:
        json.dump(r, f, indent=1)

    from torch.profiler import ProfilerActivity, profile
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(50):
            sagebwd.attention(q, k, v)
        torch.cuda.synchronize()
        for _ in range(50):
            native()
        torch.cuda.synchronize()
    with open(os.path.join(a.out, "profile.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=60))
    prof.export_chrome_trace(os.path.join(a.out, "trace.json"))

    if a.py_spy:
        cmd = [os.environ.get("PY_SPY", "py-spy"), "record", "--native", "-r", "4000", "-f", "raw", "-o",
               os.path.join(a.out, "pyspy.txt"), "--", sys.executable, __file__, a.out, "--shape", a.shape, "--loop"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        print("py-spy:", p.returncode, p.stderr[-2000:])


if __name__ == "__main__":
    main()
