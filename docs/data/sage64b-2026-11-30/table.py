# fwd / bwd / quant ms per (file, shape) from the bench and sdpa JSONs of a directory.
import glob, json, os, sys
rows = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    tag = os.path.basename(f)[:-5]
    try:
        res = json.load(open(f))["results"]
    except Exception as e:
        print(tag, "unreadable", e); continue
    for r in res:
        if tag.endswith("cudnn") and r.get("impl") != "cudnn":
            continue
        key = (tag.split("-")[0], r["head_dim"], r["n"], r["causal"])
        rows.setdefault(key, []).append((tag, r["fwd_ms"], r["bwd_ms"], r.get("quant_ms", float("nan")), r.get("fwd_tops", float("nan"))))
for key in sorted(rows):
    print(f"== {key[0]} d{key[1]} N{key[2]} {'causal' if key[3] else 'full'}")
    for tag, fw, bw, q, t in rows[key]:
        print(f"   {tag:14s} fwd {fw:7.3f}  bwd {bw:7.3f}  f+b {fw+bw:7.3f}  quant {q:6.3f}  fwdTOPS {t:6.1f}")
