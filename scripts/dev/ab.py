#!/usr/bin/env python3
"""A/B table of two builds timed in the same device call: medians over rounds, per shape, and the geometric mean.

    python3 scripts/dev/ab.py DIR BASE VARIANT [KEYS...]

DIR holds `sagebwd bench --json` outputs named <tag>_<build>-r<round>.json (e.g. s128_m0-r1.json, s128_z1-r1.json: tag
s128 = preset sagebwd at d 128); KEYS are result fields (default fwd_ms bwd_ms quant_ms). For each tag and key it prints
one line per shape (N, causal) with both medians and the variant's change in percent, then `== TAG KEY geo VARIANT/BASE
±x.xx %` over the shapes both builds have. Alternate the builds inside each round on the device, so that a GPU that
warms up or down during the call favours neither (the session calls in docs/data/s2*/ do)."""
import glob
import json
import math
import statistics
import sys


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    d, base, var = sys.argv[1:4]
    keys = sys.argv[4:] or ["fwd_ms", "bwd_ms", "quant_ms"]
    tags = sorted({f.split("/")[-1].split("_")[0] for f in glob.glob(f"{d}/*_{base}-r*.json")})
    for tag in tags:
        for key in keys:
            rows = {}
            for v in (base, var):
                for f in sorted(glob.glob(f"{d}/{tag}_{v}-r*.json")):
                    for r in json.load(open(f))["results"]:
                        rows.setdefault((r["n"], r["causal"]), {}).setdefault(v, []).append(r[key])
            ratios = []
            for k in sorted(rows):
                if base not in rows[k] or var not in rows[k]:
                    continue
                b, x = statistics.median(rows[k][base]), statistics.median(rows[k][var])
                ratios.append(x / b)
                print(f"{tag} {key} {k[0]} {'causal' if k[1] else 'full'} | {base} {b:.4f} | {var} {x:.4f} {100 * (x / b - 1):+.2f}")
            if ratios:
                geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
                print(f"== {tag} {key} geo {var}/{base} {100 * (geo - 1):+.2f} %")


if __name__ == "__main__":
    main()
