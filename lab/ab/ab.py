#!/usr/bin/env python3
"""A/B table of two builds timed in the same device call: medians over rounds per shape, the change, the geometric
mean, and optionally the variant's throughput ratio to cuDNN.

    python3 lab/ab/ab.py DIR BASE VARIANT [KEYS...] [--sdpa SDPA.json]

DIR holds `sagebwd bench --json` outputs named <tag>_<build>-r<round>.json (e.g. s128_base-r1.json and
s128_new-r1.json: tag s128 = preset sagebwd at d 128, as lab/ab/calllib.sh's `bench_json` names them); KEYS are result
fields (default fwd_ms bwd_ms quant_ms). For each tag and key it prints one line per shape (N, causal) with both
medians and the variant's change in percent, then `== TAG KEY geo VARIANT/BASE ±x.xx %` over the shapes both builds
have. With --sdpa (a scripts/gpu/bench_sdpa.py JSON of the same call) each shape's line of fwd_ms / bwd_ms also gives
cuDNN's time over the variant's (above 1: the variant is faster), and a `== TAG fwd+bwd VARIANT/cuDNN` line follows.
Alternate the builds inside each round on the device, so that a GPU that warms up or down during the call favours
neither."""
import argparse
import glob
import json
import math
import os
import statistics
import sys


def load_runs(d, build):
    """(tag, head_dim, n, causal) -> {key: [values over rounds]} for one build."""
    out = {}
    for f in sorted(glob.glob(os.path.join(d, f"*_{build}-r*.json"))):
        tag = os.path.basename(f).split("_")[0]
        with open(f) as fh:
            report = json.load(fh)
        for r in report.get("results", []):
            k = (tag, r.get("head_dim"), r["n"], r["causal"])
            for key, v in r.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out.setdefault(k, {}).setdefault(key, []).append(v)
    return out


def load_cudnn(path):
    """(head_dim, n, causal) -> (fwd_ms, bwd_ms) means of cuDNN's rows."""
    with open(path) as fh:
        report = json.load(fh)
    acc = {}
    for r in report.get("results", []):
        if r.get("impl") != "cudnn" or "error" in r:
            continue
        acc.setdefault((r["head_dim"], r["n"], r["causal"]), []).append((r["fwd_ms"], r["bwd_ms"]))
    return {k: (statistics.mean(v[0] for v in vs), statistics.mean(v[1] for v in vs)) for k, vs in acc.items()}


def geo(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("base")
    p.add_argument("variant")
    p.add_argument("keys", nargs="*", default=["fwd_ms", "bwd_ms", "quant_ms"])
    p.add_argument("--sdpa", help="bench_sdpa.py JSON of the same call: ratios to cuDNN")
    a = p.parse_args()
    base, var = load_runs(a.dir, a.base), load_runs(a.dir, a.variant)
    if not base or not var:
        sys.exit(f"error: no *_{a.base}-r*.json or no *_{a.variant}-r*.json in {a.dir}")
    cudnn = load_cudnn(a.sdpa) if a.sdpa else {}
    for tag in sorted({k[0] for k in base}):
        shapes = sorted(k for k in base if k[0] == tag and k in var)
        for key in a.keys:
            ratios = []
            for k in shapes:
                if key not in base[k] or key not in var[k]:
                    continue
                b, x = statistics.median(base[k][key]), statistics.median(var[k][key])
                if b <= 0:
                    continue
                ratios.append(x / b)
                line = f"{tag} {key} {k[2]} {'causal' if k[3] else 'full'} | {a.base} {b:.4f} | {a.variant} {x:.4f} {100 * (x / b - 1):+.2f}"
                c = cudnn.get(k[1:])
                if c and key in ("fwd_ms", "bwd_ms") and x > 0:
                    line += f" | cuDNN / {a.variant} {c[0 if key == 'fwd_ms' else 1] / x:.2f}"
                print(line)
            if ratios:
                print(f"== {tag} {key} geo {a.variant}/{a.base} {100 * (geo(ratios) - 1):+.2f} %")
        if cudnn:
            both = []
            for k in shapes:
                c = cudnn.get(k[1:])
                if c and "fwd_ms" in var[k] and "bwd_ms" in var[k]:
                    t = statistics.median(var[k]["fwd_ms"]) + statistics.median(var[k]["bwd_ms"])
                    both.append((c[0] + c[1]) / t)
            if both:
                print(f"== {tag} fwd+bwd geo {a.variant}/cuDNN throughput {geo(both):.3f}")


if __name__ == "__main__":
    main()
