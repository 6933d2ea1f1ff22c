#!/usr/bin/env python3
"""Markdown tables for docs/QUANTIZATION-DESIGN.md from the TSVs of lab/design/accuracy.sh.

Usage: lab/design/tables.py FILE.tsv...  Prints, per (d, mask), one table of O / dQ / dK / dV relative L2
per variant and sigma; at d 128 non-causal sigma 1 each cell is marked against the target (<= 1.1 x the
paper's Table 1 row: O .016, dQ .018, dK .022, dV .016)."""
import csv, sys

TABLE1 = {"O": 0.016, "dQ": 0.018, "dK": 0.022, "dV": 0.016}
CUDNN = {"O": 0.060, "dQ": 0.072, "dK": 0.071, "dV": 0.060}
rows = []
for path in sys.argv[1:]:
    with open(path) as f:
        rows += list(csv.DictReader(f, delimiter="\t"))
groups = {}
for r in rows:
    groups.setdefault((r["d"], r["mask"]), []).append(r)
for (d, mask), rs in sorted(groups.items(), key=lambda k: (-int(k[0][0]), k[0][1])):
    print(f"\n**d {d}, {mask}** (relative L2 against exact f64; O / dQ / dK / dV)\n")
    sigmas = sorted({float(r["sigma"]) for r in rs})
    print("| variant | " + " | ".join(f"σ {s:g}" for s in sigmas) + " |")
    print("|---|" + "---|" * len(sigmas))
    seen = []
    for r in rs:
        if r["variant"] not in seen:
            seen.append(r["variant"])
    for v in seen:
        cells = []
        for s in sigmas:
            r = next((x for x in rs if x["variant"] == v and float(x["sigma"]) == s), None)
            if r is None:
                cells.append("–")
                continue
            parts = []
            for t in ("O", "dQ", "dK", "dV"):
                x = float(r[t])
                mark = ""
                if d == "128" and s == 1:
                    mark = "" if x <= 1.1 * TABLE1[t] else "✗"
                parts.append(f"{x:.4f}{mark}")
            cells.append(" / ".join(parts))
        print(f"| `{v}` | " + " | ".join(cells) + " |")
    if d == "128":
        print("| paper Table 1 | " + " / ".join(f"{TABLE1[t]:.3f}" for t in TABLE1) + " | " + " | ".join("not in the docs" for _ in sigmas[1:]) + " |")
        print("| cuDNN FP8 (measured, issue 32) | " + " / ".join(f"{CUDNN[t]:.3f}" for t in CUDNN) + " | " + " | ".join("–" for _ in sigmas[1:]) + " |")
