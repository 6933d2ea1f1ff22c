#!/usr/bin/env python3
"""Where a kernel's warps wait, by straight-line region of its SASS, from an ncu source export.

On the device (ncu of the CUDA toolkit):
    ncu --clock-control none --section WarpStateStats --section SourceCounters -k regex:sage_fwd_reference \
        -o prof <command>
    ncu -i prof.ncu-rep --page source --csv --print-source sass | gzip > prof-source.csv.gz
Here:
    python3 lab/profile/ncu_regions.py prof-source.csv.gz sage_forward_ws_p3s_x [--min 0.01] [--instance 0]

Splits the SASS at branch targets and after branches, and prints each region holding at least --min of the
samples: its offsets, instruction count, executions per instruction, share of the warp-state samples, the top four
stall reasons and the most frequent opcodes: a region that holds a large share of the samples for a small share of the
work (address arithmetic in a producer loop, say) is where to look first."""
import argparse, collections, csv, gzip, re


def load(path, kernel, instance):
    rows, current, seen, header = [], None, -1, None
    for row in csv.reader(gzip.open(path, "rt") if path.endswith(".gz") else open(path)):
        if row and row[0] == "Kernel Name":
            current, header = row[1], None
            seen += current == kernel
            continue
        if row and row[0] == "Address":
            header = row
            continue
        if current == kernel and seen == instance and header:
            rows.append(dict(zip(header, row)))
    return rows


def regions(rows):
    base = int(rows[0]["Address"], 16)
    targets = {int(m.group(1), 16) for r in rows if (m := re.search(r"BRA.*?(0x[0-9a-f]+)", r["Source"]))}
    out, cur = [], []
    for r in rows:
        if int(r["Address"], 16) in targets and cur:
            out.append(cur)
            cur = []
        cur.append(r)
        if re.search(r"\bBRA\b|EXIT", r["Source"]):
            out.append(cur)
            cur = []
    return base, out + ([cur] if cur else [])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source_csv")
    ap.add_argument("kernel")
    ap.add_argument("--min", type=float, default=0.01, help="smallest share of the samples to print a region")
    ap.add_argument("--instance", type=int, default=0, help="which launch of the kernel in the export (0: first)")
    a = ap.parse_args()
    rows = load(a.source_csv, a.kernel, a.instance)
    if not rows:
        raise SystemExit(f"no SASS rows for kernel {a.kernel!r} (instance {a.instance}) in {a.source_csv}")
    stalls = [h for h in rows[0] if h.startswith("stall_") and "Not Issued" not in h]
    num = lambda r, k: int(r.get(k) or 0)
    total = sum(num(r, "# Samples") for r in rows)
    issued = sum(num(r, "Instructions Executed") for r in rows)
    print(f"{a.kernel}: {len(rows)} instructions, {total} samples, {issued} warp instructions executed")
    base, segs = regions(rows)
    for s in segs:
        n = sum(num(r, "# Samples") for r in s)
        if n < total * a.min:
            continue
        st = collections.Counter()
        for r in s:
            for h in stalls:
                st[h] += num(r, h)
        top = ", ".join(f"{h[6:]} {100 * v / max(n, 1):.0f}%" for h, v in st.most_common(4))
        op = lambda src: src.split()[1] if src.strip().startswith("@") else src.split()[0]
        mix = " ".join(f"{o}:{c}" for o, c in collections.Counter(op(r["Source"]) for r in s).most_common(6))
        lo, hi = int(s[0]["Address"], 16) - base, int(s[-1]["Address"], 16) - base
        print(f"{lo:6x}-{hi:6x} n={len(s):4} exec/inst={num(s[0], 'Instructions Executed'):8} "
              f"samples {100 * n / total:5.1f}% | {top} | {mix}")


if __name__ == "__main__":
    main()
