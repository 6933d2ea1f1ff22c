#!/usr/bin/env bash
# The accuracy tables of docs/QUANTIZATION-DESIGN.md: relative L2 of O, dQ, dK, dV against exact f64 for
# each P / dS quantization variant, sigma 1,3,5,8,10 x d 64,128 x causal and not (the `accuracy`
# defaults otherwise: B 1, H 4, N 1024, seed 0), on the CPU simulator. Output: one TSV line per
# (variant, d, mask, sigma). Usage: lab/design/accuracy.sh [BIN] [EXTRA accuracy OPTIONS...]
set -euo pipefail
bin=${1:-target/release/sagebwd}
shift || true
variants=${VARIANTS:-"sagebwd int8-row128 int8-row64 int8-axis p-e4m3 p-e4m3-ds-axis p-e4m3-ds-e4m3 p-e4m3-ds-e5m2 fp8-tensor int8-axis-delta-p p-e4m3-ds-axis-delta-p"}
dims=${DIMS:-"128 64"}
masks=${MASKS:-"full causal"}
printf 'variant\td\tmask\tsigma\tO\tdQ\tdK\tdV\n'
for v in $variants; do
  for d in $dims; do
    for m in $masks; do
      c=""; [ "$m" = causal ] && c=--causal
      "$bin" accuracy --device cpu --preset "$v" -d "$d" $c --no-intermediates --json "$@" |
        python3 -c '
import json, sys
v, d, m = sys.argv[1:4]
rec = json.load(sys.stdin)
for s in sorted({r["sigma"] for r in rec}):
    e = {r["tensor"]: r["rel_l2"] for r in rec if r["sigma"] == s}
    print("\t".join([v, d, m, "%g" % s] + ["%.4f" % e[t] for t in ("O", "dQ", "dK", "dV")]))
' "$v" "$d" "$m"
    done
  done
done
