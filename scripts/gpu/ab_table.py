#!/usr/bin/env python3
"""A/B table from bench JSONs named {base,new}-TAG-PRESET-REP.json and sdpa-TAG.json (usage: ab_table.py DIR): for each shape and preset, fwd / bwd ms of base and
new (mean of the repeats), the change, and cuDNN's fwd / bwd ms and our new / cuDNN throughput ratio."""
import glob, json, os, sys
from collections import defaultdict
d = sys.argv[1]
ms = defaultdict(list)  # (tag, who, preset, D, N, causal) -> [(fwd, bwd)]
for f in glob.glob(os.path.join(d, "*.json")):
    name = os.path.basename(f)[:-5].split("-")
    if name[0] == "sdpa":
        tag, who, preset = name[1], "cudnn", "-"
    else:
        who, tag, preset = name[0], name[1], name[2]
    for r in json.load(open(f))["results"]:
        if who == "cudnn" and r["impl"] != "cudnn":
            continue
        ms[(tag, who, preset, r["head_dim"], r["n"], r["causal"])].append((r["fwd_ms"], r["bwd_ms"]))
mean = lambda v, i: sum(x[i] for x in v) / len(v)
print("| shape | preset | base fwd | new fwd | Δ fwd | base bwd | new bwd | Δ bwd | new/cuDNN fwd | new/cuDNN bwd | new/cuDNN f+b |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for k in sorted(ms):
    tag, who, preset, D, N, c = k
    if who != "new":
        continue
    b, n = ms.get((tag, "base", preset, D, N, c)), ms[k]
    cu = ms.get((tag, "cudnn", "-", D, N, c))
    bf, bb = (mean(b, 0), mean(b, 1)) if b else (float("nan"),) * 2
    nf, nb = mean(n, 0), mean(n, 1)
    row = f"| {tag}: d{D} N{N} {'causal' if c else 'full'} | {preset} | {bf:.3f} | {nf:.3f} | {100*(nf/bf-1):+.1f} % | {bb:.3f} | {nb:.3f} | {100*(nb/bb-1):+.1f} % |"
    if cu:
        cf, cb = mean(cu, 0), mean(cu, 1)
        row += f" {cf/nf:.2f} | {cb/nb:.2f} | {(cf+cb)/(nf+nb):.2f} |"
    else:
        row += " – | – | – |"
    print(row)
