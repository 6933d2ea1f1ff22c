# ab.py DIR BASE VARIANT [KEYS...]: medians over rounds of JSON files DIR/<tag>_<variant>-r<k>.json, per shape, geo mean.
import json, sys, glob, statistics as st, math
d, base, var = sys.argv[1:4]; keys = sys.argv[4:] or ["fwd_ms", "bwd_ms", "quant_ms"]
tags = sorted({f.split("/")[-1].split("_")[0] for f in glob.glob(f"{d}/*_{base}-r*.json")})
for tag in tags:
    for key in keys:
        rows = {}
        for v in (base, var):
            for f in sorted(glob.glob(f"{d}/{tag}_{v}-r*.json")):
                for r in json.load(open(f))["results"]:
                    rows.setdefault((r["n"], r["causal"]), {}).setdefault(v, []).append(r[key])
        g = []
        for k in sorted(rows):
            if base not in rows[k] or var not in rows[k]: continue
            b = st.median(rows[k][base]); x = st.median(rows[k][var]); g.append(x / b)
            print(f"{tag} {key} {k[0]} {'causal' if k[1] else 'full'} | {base} {b:.4f} | {var} {x:.4f} {100*(x/b-1):+.2f}")
        if g: print(f"== {tag} {key} geo {var}/{base} {100*(math.exp(sum(map(math.log, g))/len(g))-1):+.2f} %")
