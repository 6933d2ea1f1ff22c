"""The sagebwd PyTorch op on the GPU: forward and gradients against SDPA, GQA, causal, layouts,
FP16, torch.compile(fullgraph=True), speed and host overhead against SDPA, peak memory, and (when
transformers is installed) a small Llama trained 50 steps with SDPA and with sagebwd.

Usage: python gpu_test.py OUT_DIR [PART ...] (default: every part). Each part runs in its own try/except and logs its error, so one
failure does not lose the rest; results go to OUT_DIR/*.json and OUT_DIR/log.txt, the summary
(OUT_DIR/summary.json, printed) last. Exit status 1 if any check failed or any part raised.

Error bounds (relative L2 against an FP32 SDPA on the same BF16 inputs, σ = 1 Gaussian inputs):
- fpa (all BF16): 0.01 for O and every gradient (BF16 rounding of the output alone is ~0.002).
- sagebwd: the simulator's error at the case's shape, mask and score scale (`sagebwd accuracy`, in
  CASES) times 1.5: the simulator figure is one seed; across seeds it moves by ~10 %, and the GPU
  computes the same quantization bit for bit up to accumulation order, so an error beyond 1.5x is
  a defect, not noise."""

import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

OUT = sys.argv[1] if len(sys.argv) > 1 else "out"
os.makedirs(OUT, exist_ok=True)
LOG = open(os.path.join(OUT, "log.txt"), "a")
SUMMARY = {"parts": {}, "failed_checks": []}

FPA_BOUND = 0.01
SAGE_MARGIN = 1.5


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.write(s + "\n")
    LOG.flush()


def part(name):
    def wrap(fn):
        def run():
            t0 = time.time()
            try:
                res = fn()
                SUMMARY["parts"][name] = {"ok": True, "seconds": round(time.time() - t0, 2)}
                if res is not None:
                    with open(os.path.join(OUT, f"{name}.json"), "w") as f:
                        json.dump(res, f, indent=1)
            except Exception as e:  # noqa: BLE001 - every part must run
                log(f"[{name}] ERROR {type(e).__name__}: {e}")
                log(traceback.format_exc())
                SUMMARY["parts"][name] = {"ok": False, "seconds": round(time.time() - t0, 2),
                                          "error": f"{type(e).__name__}: {e}"}
        run.name = name
        return run
    return wrap


def expect(name, ok, detail):
    log(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")
    if not ok:
        SUMMARY["failed_checks"].append(f"{name}: {detail}")


def rel_l2(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def inputs(b, hq, hk, nq, nk, d, dtype=torch.bfloat16, seed=0, layout="bhnd"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shp = (lambda h, n: (b, h, n, d)) if layout == "bhnd" else (lambda h, n: (b, n, h, d))
    q = torch.randn(shp(hq, nq), device="cuda", generator=g).to(dtype)
    k = torch.randn(shp(hk, nk), device="cuda", generator=g).to(dtype)
    v = torch.randn(shp(hk, nk), device="cuda", generator=g).to(dtype)
    do = torch.randn(shp(hq, nq), device="cuda", generator=g).to(dtype)
    return q, k, v, do


def end_aligned_mask(nq, nk):
    i = torch.arange(nq, device="cuda")[:, None]
    j = torch.arange(nk, device="cuda")[None, :]
    return j <= i + (nk - nq)


def reference(q, k, v, do, causal, scale=None, layout="bhnd"):
    """FP32 SDPA (math) on the same inputs; returns O and the gradients in the inputs' layout."""
    t = (lambda x: x.transpose(1, 2)) if layout == "bnhd" else (lambda x: x)
    q32, k32, v32 = (t(x).float().detach().requires_grad_() for x in (q, k, v))
    mask = end_aligned_mask(q32.shape[2], k32.shape[2]) if causal else None
    o = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask, scale=scale,
                                       enable_gqa=q32.shape[1] != k32.shape[1])
    o.backward(t(do).float())
    return t(o).detach(), t(q32.grad), t(k32.grad), t(v32.grad)


def run_op(q, k, v, do, **kw):
    import sagebwd

    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = sagebwd.attention(q, k, v, **kw)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


CASES = [
    # name, (B, H_q, H_kv, N_q, N_k, d), causal, extra, the simulator's sagebwd error (O, dQ, dK, dV) at that shape:
    # `sagebwd accuracy --preset sagebwd --batch B --heads H_q --heads-kv H_kv -n N_q --n-k N_k -d d --sigma S
    # [--causal]` on the CPU (S = 1; for `scale`, S = sqrt(0.2 · sqrt(64)): the op multiplies Q by scale · sqrt(d),
    # and INT8 and BF16 errors are relative, so that is σ² of the product of Q and K)
    ("d128", (2, 8, 8, 1024, 1024, 128), False, {}, (0.0214, 0.0551, 0.0548, 0.0474)),
    ("d128_causal", (2, 8, 8, 1024, 1024, 128), True, {}, (0.0182, 0.0433, 0.0431, 0.0409)),
    ("d64_causal", (2, 8, 8, 1000, 1000, 64), True, {}, (0.0178, 0.0443, 0.0437, 0.0414)),
    ("gqa4_causal", (2, 16, 4, 777, 777, 128), True, {}, (0.0175, 0.0425, 0.0421, 0.0402)),
    ("nq_lt_nk_causal", (1, 8, 2, 300, 1000, 128), True, {}, (0.0213, 0.0544, 0.0543, 0.0479)),
    ("nq_gt_nk", (1, 8, 8, 700, 250, 64), False, {}, (0.0208, 0.0505, 0.0497, 0.0423)),
    # one query row: the error varies from seed to seed by 3x; the largest of seeds 0-9 (--seed)
    ("tiny", (1, 2, 1, 1, 5, 64), True, {}, (0.0125, 0.0224, 0.0264, 0.0115)),
    ("bnhd_gqa", (2, 8, 2, 512, 512, 128), True, {"layout": "bnhd"}, (0.0174, 0.0417, 0.0414, 0.0402)),
    ("fp16", (2, 8, 8, 512, 512, 128), True, {"dtype": torch.float16}, (0.0176, 0.0407, 0.0408, 0.0394)),
    ("scale", (2, 8, 8, 512, 512, 64), False, {"scale": 0.2}, (0.0282, 0.0693, 0.068, 0.0752)),
]


@part("accuracy")
def accuracy():
    rows = []
    for name, (b, hq, hk, nq, nk, d), causal, extra, sim in CASES:
        layout = extra.get("layout", "bhnd")
        dtype = extra.get("dtype", torch.bfloat16)
        scale = extra.get("scale")
        q, k, v, do = inputs(b, hq, hk, nq, nk, d, dtype=dtype, layout=layout)
        ref = reference(q, k, v, do, causal, scale=scale, layout=layout)
        # SDPA in the inputs' own precision, for scale
        sd = run_sdpa(q, k, v, do, causal, scale, layout)
        row = {"case": name, "shape": [b, hq, hk, nq, nk, d], "causal": causal, "layout": layout,
               "dtype": str(dtype), "scale": scale,
               "sdpa_lowp": dict(zip(("o", "dq", "dk", "dv"), (rel_l2(x, r) for x, r in zip(sd, ref))))}
        for preset in ("fpa", "sagebwd"):
            try:
                got = run_op(q, k, v, do, causal=causal, scale=scale, preset=preset, layout=layout)
                errs = dict(zip(("o", "dq", "dk", "dv"), (rel_l2(x, r) for x, r in zip(got, ref))))
                finite = all(torch.isfinite(x).all().item() for x in got)
                shapes = all(x.shape == r.shape and x.dtype == dtype for x, r in zip(got, (q, q, k, v)))
                row[preset] = errs
                for (t, e), sim_err in zip(errs.items(), sim):
                    bound = FPA_BOUND if preset == "fpa" else SAGE_MARGIN * sim_err
                    expect(f"{name} {preset} {t}", finite and shapes and e <= bound,
                           f"rel L2 {e:.4f} (bound {bound:.4f}, SDPA {dtype} {row['sdpa_lowp'][t]:.4f})")
            except Exception as e:  # noqa: BLE001
                row[preset] = {"error": f"{type(e).__name__}: {e}"}
                expect(f"{name} {preset}", False, f"raised {type(e).__name__}: {e}")
        rows.append(row)
    return rows


def run_sdpa(q, k, v, do, causal, scale=None, layout="bhnd"):
    t = (lambda x: x.transpose(1, 2)) if layout == "bnhd" else (lambda x: x)
    qq, kk, vv = (t(x).detach().requires_grad_() for x in (q, k, v))
    mask = end_aligned_mask(qq.shape[2], kk.shape[2]) if causal and qq.shape[2] != kk.shape[2] else None
    o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
                                       enable_gqa=qq.shape[1] != kk.shape[1])
    o.backward(t(do))
    return t(o).detach(), t(qq.grad), t(kk.grad), t(vv.grad)


@part("errors")
def errors():
    import sagebwd

    q, k, v, _ = inputs(1, 2, 2, 64, 64, 128)
    cases = {
        "d96": (lambda: sagebwd.attention(*inputs(1, 2, 2, 64, 64, 96)[:3]), ValueError),
        "fp32": (lambda: sagebwd.attention(q.float(), k.float(), v.float()), TypeError),
        "cpu": (lambda: sagebwd.attention(q.cpu(), k.cpu(), v.cpu()), ValueError),
        "gqa_mismatch": (lambda: sagebwd.attention(*inputs(1, 6, 4, 64, 64, 128)[:3]), ValueError),
        "preset": (lambda: sagebwd.attention(q, k, v, preset="int4"), ValueError),
        "product": (lambda: sagebwd.attention(q, k, v, int8=["dz"]), ValueError),
    }
    out = {}
    for name, (fn, exc) in cases.items():
        try:
            fn()
            expect(f"error {name}", False, "no error raised")
            out[name] = "no error"
        except exc as e:
            expect(f"error {name}", True, f"{exc.__name__}: {e}")
            out[name] = str(e)
        except Exception as e:  # noqa: BLE001
            expect(f"error {name}", False, f"{type(e).__name__} instead of {exc.__name__}: {e}")
            out[name] = f"{type(e).__name__}: {e}"
    # non-contiguous input: accepted (copied), same result as the contiguous one
    qn = torch.randn(1, 64, 2, 128, device="cuda").to(torch.bfloat16).transpose(1, 2)
    a = sagebwd.attention(qn, k, v, preset="fpa")
    b = sagebwd.attention(qn.contiguous(), k, v, preset="fpa")
    expect("non-contiguous input", torch.equal(a, b), f"max diff {(a.float() - b.float()).abs().max().item()}")
    return out


@part("streams")
def streams():
    """The op on a side stream: same result as on the default stream, ordered without host sync."""
    import sagebwd

    q, k, v, do = inputs(2, 8, 8, 1024, 1024, 128)
    base = run_op(q, k, v, do, causal=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        q2 = q * 1  # produced on the side stream: the op must wait for it
        got = run_op(q2, k, v, do, causal=True)
    torch.cuda.current_stream().wait_stream(s)
    errs = [rel_l2(x, y) for x, y in zip(got, base)]
    expect("side stream", max(errs) < 1e-2, f"rel L2 vs default stream {[round(e, 5) for e in errs]}")
    return {"rel_l2_vs_default_stream": errs, "sagebwd": sagebwd.__name__}


@part("compile")
def compile_fullgraph():
    import sagebwd

    # The loss is compiled (forward graph and, through AOTAutograd, its backward graph); the backward runs
    # outside, as in training: dynamo does not trace torch.autograd.grad inside a compiled function.
    def loss_of(q, k, v, do):
        o = sagebwd.attention(q, k, v, causal=True, layout="bnhd")
        return (o.float() * do.float()).sum()

    def grads(fn, q, k, v, do):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        return torch.autograd.grad(fn(q, k, v, do), (q, k, v))

    q, k, v, do = inputs(2, 8, 2, 512, 512, 128, layout="bnhd")
    eager = grads(loss_of, q, k, v, do)
    compiled = torch.compile(loss_of, fullgraph=True)
    got = grads(compiled, q, k, v, do)
    errs = [rel_l2(x, y) for x, y in zip(got, eager)]
    expect("torch.compile fullgraph", max(errs) < 1e-2, f"rel L2 vs eager {[round(e, 5) for e in errs]}")
    return {"rel_l2_vs_eager": errs}


def cuda_time(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def host_time(fn, iters=200):
    """Host seconds per call with no synchronization inside the loop (the launch-bound regime)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters


@part("speed")
def speed():
    import sagebwd

    rows = []
    for (b, h, n, d), causal in (((4, 16, 2048, 128), False), ((4, 16, 2048, 128), True), ((2, 16, 8192, 128), True),
                                 ((4, 16, 2048, 64), True)):
        q, k, v, do = inputs(b, h, h, n, n, d)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        row = {"shape": [b, h, n, d], "causal": causal}
        for name, f in (("sagebwd", lambda: sagebwd.attention(q, k, v, causal=causal)),
                        ("fpa", lambda: sagebwd.attention(q, k, v, causal=causal, preset="fpa")),
                        ("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))):
            with torch.no_grad():
                fwd = cuda_time(f)
            fb = cuda_time(lambda: f().backward(do))
            row[name] = {"fwd_ms": fwd, "fwd_bwd_ms": fb}
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        for name in ("sagebwd", "fpa", "sdpa"):
            row[name]["fwd_tflops"] = flops / row[name]["fwd_ms"] / 1e9
            row[name]["fwd_bwd_tflops"] = 3.5 * flops / row[name]["fwd_bwd_ms"] / 1e9
        log(f"  speed {row['shape']} causal={causal}: " + ", ".join(
            f"{k} fwd {row[k]['fwd_ms']:.3f} ms fwd+bwd {row[k]['fwd_bwd_ms']:.3f} ms" for k in ("sagebwd", "fpa", "sdpa")))
        rows.append(row)
    # host overhead: a tiny problem, launch-bound
    q, k, v, _ = inputs(1, 1, 1, 64, 64, 64)
    with torch.no_grad():
        host = {"sagebwd_fwd_us": 1e6 * host_time(lambda: sagebwd.attention(q, k, v)),
                "sdpa_fwd_us": 1e6 * host_time(lambda: F.scaled_dot_product_attention(q, k, v))}
        fwd_op = torch.ops.sagebwd.attention_forward
        host["custom_op_direct_us"] = 1e6 * host_time(lambda: fwd_op(q, k, v, False, "sagebwd", "", "", None))
    log(f"  host per call: {host}")
    expect("host overhead <= 20 us", host["sagebwd_fwd_us"] <= 20.0, f"{host['sagebwd_fwd_us']:.1f} us per call")
    return {"shapes": rows, "host": host}


@part("kernel_share")
def kernel_share():
    """Device time of the op's kernels vs its D2D output copies (profiler), per forward+backward."""
    import sagebwd
    from torch.profiler import ProfilerActivity, profile

    q, k, v, do = inputs(4, 16, 16, 2048, 2048, 128)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    for _ in range(3):
        sagebwd.attention(q, k, v, causal=True).backward(do)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            sagebwd.attention(q, k, v, causal=True).backward(do)
        torch.cuda.synchronize()
    sage, copies, other = 0.0, 0.0, 0.0
    names = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        names[e.name] = names.get(e.name, 0.0) + t
        if e.name.startswith("sage_"):
            sage += t
        elif "Memcpy" in e.name or "memcpy" in e.name:
            copies += t
        else:
            other += t
    share = sage / max(sage + copies, 1e-9)
    log(f"  kernels {sage / 5:.0f} us, copies {copies / 5:.0f} us, other {other / 5:.0f} us per step; "
        f"kernel share of the op {share:.3f}")
    expect("no copies beside the kernels", copies <= 0.03 * sage, f"copies {copies / max(sage, 1e-9):.3%} of kernel time")
    # The op's wall time per step (queued back to back, as in training) against its kernels' device time: host time,
    # launch gaps and copies together.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        sagebwd.attention(q, k, v, causal=True).backward(do)
    end.record()
    end.synchronize()
    wall_us = start.elapsed_time(end) * 1e3 / 5
    log(f"  op wall {wall_us:.0f} us per step vs kernels {sage / 5:.0f} us")
    expect("op within 3 % of its kernels", wall_us <= 1.03 * sage / 5, f"wall / kernels {wall_us / (sage / 5):.3f}")
    top = dict(sorted(names.items(), key=lambda x: -x[1])[:20])
    return {"kernels_us_per_step": sage / 5, "copies_us_per_step": copies / 5, "other_us_per_step": other / 5,
            "wall_us_per_step": wall_us,
            "top": top}


@part("memory")
def memory():
    import sagebwd
    from sagebwd import _runtime

    dev = _runtime.device(0)
    rows = []
    for (b, h, n, d), causal in (((4, 16, 4096, 128), True), ((1, 16, 16384, 128), True)):
        q, k, v, do = inputs(b, h, h, n, n, d)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        row = {"shape": [b, h, n, d], "causal": causal}
        for name, f in (("sagebwd", lambda: sagebwd.attention(q, k, v, causal=causal)),
                        ("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))):
            f().backward(do)  # warm (kernels, workspaces)
            q.grad = k.grad = v.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            dev.pool_peak(reset=True)
            free0 = dev.mem_info()[0]
            f().backward(do)
            torch.cuda.synchronize()
            torch_peak = torch.cuda.max_memory_allocated() - base
            pool_peak = dev.pool_peak() or 0
            free1 = dev.mem_info()[0]
            row[name] = {"torch_peak_mib": torch_peak / 2**20, "pool_peak_mib": pool_peak / 2**20,
                         "sum_mib": (torch_peak + pool_peak) / 2**20, "free_before_mib": free0 / 2**20,
                         "free_after_mib": free1 / 2**20}
            q.grad = k.grad = v.grad = None
        log(f"  memory {row['shape']}: sagebwd torch {row['sagebwd']['torch_peak_mib']:.0f} + pool "
            f"{row['sagebwd']['pool_peak_mib']:.0f} MiB, sdpa torch {row['sdpa']['torch_peak_mib']:.0f} + pool "
            f"{row['sdpa']['pool_peak_mib']:.0f} MiB")
        expect(f"peak memory {row['shape']} <= SDPA", row["sagebwd"]["sum_mib"] <= row["sdpa"]["sum_mib"] * 1.0 + 1,
               f"{row['sagebwd']['sum_mib']:.0f} MiB (torch + pool, an upper bound) vs {row['sdpa']['sum_mib']:.0f} MiB")
        rows.append(row)
    return rows


@part("llama")
def llama():
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        log("  transformers not installed: skipped")
        return {"skipped": "transformers not installed"}
    import sagebwd.hf

    sagebwd.hf.register()
    cfg = dict(vocab_size=512, hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=4, max_position_embeddings=512, head_dim=64)
    g = torch.Generator().manual_seed(0)
    phrases = torch.randint(0, 512, (32, 32), generator=g)
    data = phrases[torch.randint(0, 32, (50, 16, 8), generator=g)].reshape(50, 16, 256).cuda()

    def train(impl, seed):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation=impl)).cuda().to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        losses = []
        for step in range(50):
            out = model(input_ids=data[step], labels=data[step])
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(out.loss.item())
        return losses

    sdpa, sdpa2, sage = train("sdpa", 0), train("sdpa", 1), train("sagebwd", 0)
    tail = lambda x: sum(x[-10:]) / 10  # noqa: E731
    noise = abs(tail(sdpa) - tail(sdpa2))
    diff = abs(tail(sage) - tail(sdpa))
    log(f"  llama: last-10 mean loss sdpa {tail(sdpa):.4f}, sdpa (other seed) {tail(sdpa2):.4f}, "
        f"sagebwd {tail(sage):.4f}")
    expect("llama 50 steps: sagebwd within noise of SDPA", diff <= max(2 * noise, 0.02 * tail(sdpa)),
           f"|sagebwd - sdpa| {diff:.4f}, seed noise {noise:.4f}")
    return {"transformers": transformers.__version__, "sdpa": sdpa, "sdpa_seed1": sdpa2, "sagebwd": sage}


def main():
    t0 = time.time()
    try:
        import sagebwd

        SUMMARY["device"] = sagebwd.device_info()
        SUMMARY["torch"] = torch.__version__
        SUMMARY["nvrtc"] = sagebwd.find_nvrtc()
        SUMMARY["cache_dir"] = sagebwd.cache_dir()
        dev = sagebwd._runtime.device(0)
        for d in (64, 128):
            t = time.time()
            dev.load_kernels(d)
            SUMMARY[f"kernel_load_s_d{d}"] = round(time.time() - t, 2)
        log(f"device {SUMMARY['device']}, torch {torch.__version__}, kernels loaded "
            f"(d64 {SUMMARY['kernel_load_s_d64']} s, d128 {SUMMARY['kernel_load_s_d128']} s)")
    except Exception as e:  # noqa: BLE001
        log(f"[setup] ERROR {type(e).__name__}: {e}")
        log(traceback.format_exc())
        SUMMARY["parts"]["setup"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    parts = (accuracy, errors, streams, compile_fullgraph, speed, kernel_share, memory, llama)
    chosen = sys.argv[2:] or [p.name for p in parts]
    unknown = set(chosen) - {p.name for p in parts}
    if unknown:
        log(f"unknown parts {sorted(unknown)}; the parts are {[p.name for p in parts]}")
        return 2
    for p in parts:
        if p.name not in chosen:
            continue
        log(f"== {p.name}")
        p()
    SUMMARY["seconds"] = round(time.time() - t0, 1)
    SUMMARY["ok"] = not SUMMARY["failed_checks"] and all(p["ok"] for p in SUMMARY["parts"].values())
    with open(os.path.join(OUT, "summary.json"), "w") as f:
        json.dump(SUMMARY, f, indent=1)
    log(json.dumps(SUMMARY, indent=1))
    return 0 if SUMMARY["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
