#!/usr/bin/env python3
"""Instructions per attention score, issue rate and SASS instruction mix of every kernel in ncu exports.

Reads the `<name>-details.csv` and `<name>-source.csv.gz` pairs that lab/ab/calllib.sh's `prof` (or an
ncu export of the same sections) writes, for reports of one forward + backward at the standard sweep shape (B·N = 16384, H·D = 2048;
the name ends in `-d<D>-n<N>`). For each kernel (first instance of each name): duration, warp instructions executed,
thread instructions executed (the source page's sum, so predicated-off lanes do not count), thread instructions per
score (scores = B·H·N², non-causal), issued warps per scheduler per cycle, registers, and the opcode classes that hold
most of its thread instructions.
Usage: python3 lab/profile/ncu_mix.py DIR NAME [NAME ...] [--top 12]
"""
import argparse, collections, csv, gzip, os, re


def details(path):
    kernels = collections.OrderedDict()
    for r in csv.DictReader(open(path)):
        k = kernels.setdefault(r["ID"], {"name": r["Kernel Name"]})
        k[r["Metric Name"]] = r["Metric Value"]
        k[r["Metric Name"] + " unit"] = r["Metric Unit"]
    return list(kernels.values())


def source(path):
    """Per kernel instance (in report order): opcode -> thread instructions executed."""
    out, cur, header = [], None, None
    for row in csv.reader(gzip.open(path, "rt")):
        if row and row[0] == "Kernel Name":
            cur = collections.Counter()
            out.append((row[1], cur))
            header = None
            continue
        if row and row[0] == "Address":
            header = row
            continue
        if header and cur is not None and len(row) == len(header):
            r = dict(zip(header, row))
            words = r["Source"].split()
            if not words:
                continue
            op = words[1] if words[0].startswith("@") else words[0]
            cur[op.split(".")[0]] += int(r["Thread Instructions Executed"] or 0)
    return out


DURATION_MS = {"ms": 1.0, "us": 1e-3, "usecond": 1e-3, "msecond": 1.0, "ns": 1e-6, "nsecond": 1e-6, "s": 1e3}


def num(s):
    return float(s.replace(",", "")) if s not in (None, "", "n/a") else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("names", nargs="+")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    for name in a.names:
        m = re.search(r"-d(\d+)-n(\d+)$", name)
        d, n = int(m.group(1)), int(m.group(2))
        scores = 16384 * 2048 * n / d
        ks = details(os.path.join(a.dir, f"{name}-details.csv"))
        src = source(os.path.join(a.dir, f"{name}-source.csv.gz"))
        print(f"## {name}  (scores {scores:.4g})")
        print(f"{'kernel':58s} {'ms':>7s} {'warp inst':>10s} {'thr/score':>9s} {'issue/sch':>9s} {'regs':>4s}")
        seen, total_ms, total_thr = set(), 0.0, 0.0
        for k in ks:
            if k["name"] in seen:
                continue
            seen.add(k["name"])
            # the export may hold a kernel's section more than once (some empty): its first non-empty one
            mix = next((c for nm, c in src if nm == k["name"] and sum(c.values())), collections.Counter())
            thr = sum(mix.values())
            ms = num(k.get("Duration")) * DURATION_MS[k.get("Duration unit", "ms")]
            total_ms += ms
            total_thr += thr
            print(f"{k['name'][:58]:58s} {ms:7.3f} {num(k.get('Executed Instructions')):10.4g} {thr / scores:9.2f} "
                  f"{num(k.get('Issued Warp Per Scheduler')):9.2f} {k.get('Registers Per Thread', '?'):>4s}")
            if thr / scores >= 0.5:
                top = ", ".join(f"{op} {c / scores:.2f}" for op, c in mix.most_common(a.top))
                print(f"    per score: {top}")
        print(f"{'all (first instance of each name)':58s} {total_ms:7.3f} {'':10s} {total_thr / scores:9.2f}\n")


if __name__ == "__main__":
    main()
