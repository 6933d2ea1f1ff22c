#!/usr/bin/env python3
"""Side-by-side table (Markdown) and throughput plot (PNG) of `sagebwd bench` and bench_sdpa.py
results.

Reads any number of JSON files written by `sagebwd bench --json` (implementation `ours-<preset>`)
and `scripts/gpu/bench_sdpa.py --json` (implementations `cudnn`, `flash`), matches points by
(D, N, causal), and writes:
- throughput of every implementation (fwd / bwd / fwd+bwd, TOPS = TFLOP/s by the FlashAttention
  convention of docs/PERFORMANCE.md);
- peak device memory of forward + backward, and its ratio to cuDNN's;
- our quantization kernels' share of the forward and backward times;
- ratios against cuDNN (every implementation, fwd / bwd / fwd+bwd) and against FlashAttention-2
  (fwd+bwd), then their geometric means: the lines that matter, last.
The plot has one panel per (D, causal) and one row per pass (fwd, bwd, fwd+bwd), throughput vs N.
With --smi (an nvidia-smi log taken during the benches, as scripts/gpu/bench.sh takes it), a table of the SM
clock and board power during each point's timed repetitions: the H200 caps board power at 700 W and lowers its
clock when a kernel reaches it, by an amount that differs between implementations.

Usage: python3 scripts/gpu/compare.py RESULT.json... [--md compare.md] [--png compare.png] [--smi smi.csv]
The Markdown is printed on stdout as well. The plot is skipped (with a note) without matplotlib.
"""
import argparse
import json
import math
import statistics
import sys
import time

BASE, FA2 = "cudnn", "flash"
PASSES = [("fwd", "fwd"), ("bwd", "bwd"), ("fwdbwd", "fwd+bwd")]


def load(paths):
    """{impl: {(D, N, causal): record}}, the implementations in a stable order (cuDNN, FA2, ours
    in file order), and a short description of each file."""
    data, order, sources = {}, [], []
    for path in paths:
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, ValueError) as e:  # a run that failed: compare what there is
            print(f"note: skipping {path}: {e}", file=sys.stderr)
            continue
        sources.append(describe_source(path, report))
        for r in report.get("results", []):
            impl = r["impl"]
            if impl not in data:
                data[impl] = {}
                order.append(impl)
            data[impl][(r["head_dim"], r["n"], bool(r["causal"]))] = r
    order.sort(key=lambda i: (i != BASE, i != FA2))  # stable: keeps file order otherwise
    return data, order, sources


def describe_source(path, report):
    s = report.get("settings", {})
    what = report.get("tool", "?")
    if "torch" in report:
        extra = f"torch {report['torch']}, cuDNN {report.get('cudnn')}"
    else:
        extra = f"{report.get('config', '')}; {report.get('kernels', '?')} kernels"
    return (f"`{path.split('/')[-1]}`: {what} on {report.get('device', '?')} ({extra}); "
            f"reps ≤ {s.get('reps')}, warm-up {s.get('warmup')}, ≤ {s.get('max_time_s', s.get('max_time'))} s "
            f"per point, {s.get('input_sets')} input sets")


def ok(r):
    return r is not None and "error" not in r and r.get("fwdbwd_ms", 0) > 0


def fmt(x, digits=1):
    if x is None:
        return "—"
    return f"{x:.{digits}f}" if abs(x) >= 0.1 or x == 0 else f"{x:.3g}"


def triple(values, digits=1):
    return " / ".join(fmt(v, digits) for v in values)


def ratio(a, b, key):
    if not (ok(a) and ok(b)):
        return None
    return a[key] / b[key]


def points_of(data):
    return sorted({p for impl in data.values() for p in impl})


def row_head(p):
    d, n, causal = p
    return f"| {d} | {n} | {'yes' if causal else 'no'} "


def md_table(title, note, columns, rows):
    out = [f"### {title}", "", note, "", "| D | N | causal | " + " | ".join(columns) + " |",
           "|---|---|---|" + "---|" * len(columns)]
    out += rows
    return "\n".join(out) + "\n"


def throughput_table(data, order, points):
    rows = []
    for p in points:
        cells = []
        for impl in order:
            r = data[impl].get(p)
            if r is not None and "error" in r:
                cells.append("error")
            else:
                cells.append(triple([r[f"{k}_tops"] for k, _ in PASSES]) if ok(r) else "—")
        rows.append(row_head(p) + "| " + " | ".join(cells) + " |")
    return md_table("Throughput (TOPS; fwd / bwd / fwd+bwd)",
                    "TFLOP/s for BF16, TOPS for INT8, same formula: fwd = 4·B·H·N²·D (halved when causal), "
                    "bwd = 2.5 × fwd, fwd+bwd = 3.5 × fwd. B·N and H·D fixed (see the source files).",
                    order, rows)


def memory_table(data, order, points):
    cols = order + [f"{i} / {BASE}" for i in order if i != BASE]
    rows = []
    for p in points:
        base = data.get(BASE, {}).get(p)
        cells = [fmt(data[i][p]["peak_mem_bytes"] / 2**20, 0) if ok(data[i].get(p)) else "—" for i in order]
        cells += [fmt(ratio(data[i].get(p), base, "peak_mem_bytes"), 2) for i in order if i != BASE]
        rows.append(row_head(p) + "| " + " | ".join(cells) + " |")
    return md_table("Peak device memory of forward + backward (MiB)",
                    "One input set (Q, K, V, dO) + the high-water mark of what forward + backward allocate "
                    "(ours: CUDA memory-pool high-water mark; SDPA: torch.cuda.max_memory_allocated).",
                    cols, rows)


def quant_table(data, order, points):
    ours = [i for i in order if any("quant_ms" in r for r in data[i].values())]
    if not ours:
        return ""
    rows = []
    for p in points:
        cells = []
        for i in ours:
            r = data[i].get(p)
            if ok(r) and r.get("quant_ms") is not None:
                cells.append(f"{fmt(r['quant_ms'], 3)} ms = {100 * r['quant_ms'] / r['fwd_ms']:.1f} % / "
                             f"{fmt(r['quant_do_ms'], 3)} ms = {100 * r['quant_do_ms'] / r['bwd_ms']:.1f} %")
            else:
                cells.append("—")
        rows.append(row_head(p) + "| " + " | ".join(cells) + " |")
    return md_table("Our quantization kernels alone (Q/K/V share of fwd / dO share of bwd)",
                    "Timed on their own; included in the fwd and bwd times above.", ours, rows)


def ratio_table(data, order, points):
    others = [i for i in order if i != BASE]
    ours = [i for i in order if i not in (BASE, FA2)]
    cols = [f"{i} / {BASE}" for i in others] + [f"{i} / {FA2} fwd+bwd" for i in ours if FA2 in data]
    rows = []
    for p in points:
        base, fa2 = data.get(BASE, {}).get(p), data.get(FA2, {}).get(p)
        cells = [triple([ratio(data[i].get(p), base, f"{k}_tops") for k, _ in PASSES], 2) for i in others]
        cells += [fmt(ratio(data[i].get(p), fa2, "fwdbwd_tops"), 2) for i in ours if FA2 in data]
        rows.append(row_head(p) + "| " + " | ".join(cells) + " |")
    return md_table(f"Throughput ratio against cuDNN (fwd / bwd / fwd+bwd) and FlashAttention-2",
                    "Above 1: faster than the baseline. Measured in the same call on the same GPU.", cols, rows)


def geomean(values):
    values = [v for v in values if v is not None and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def summary(data, order, points):
    if BASE not in data:
        return "No cuDNN results: no ratios.\n"
    groups = sorted({(d, c) for d, _, c in points})
    lines = ["### Summary: geometric mean of the ratio against cuDNN (fwd / bwd / fwd+bwd)", "",
             "| impl | " + " | ".join(f"D={d} {'causal' if c else 'full'}" for d, c in groups) + " | all |",
             "|---|" + "---|" * (len(groups) + 1)]
    for i in order:
        if i == BASE:
            continue
        cells = []
        for sel in [[p for p in points if (p[0], p[2]) == g] for g in groups] + [points]:
            cells.append(triple([geomean([ratio(data[i].get(p), data[BASE].get(p), f"{k}_tops") for p in sel])
                                 for k, _ in PASSES], 2))
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def read_smi(path):
    """[(Unix s, SM MHz, board W)] of `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,...
    --format=csv,noheader,nounits -lms N`. Its timestamps are local time: read on the machine that took them."""
    out = []
    for line in open(path):
        f = [x.strip() for x in line.split(",")]
        try:
            stamp, frac = f[0].split(".")
            t = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
            out.append((t, float(f[1]), float(f[2])))
        except (ValueError, IndexError):  # a header, "[N/A]" or a line cut short
            continue
    return out


def clock_table(data, order, points, smi):
    """Median SM clock and board power over the samples inside each point's timed repetitions."""
    rows, per_impl = [], {i: [] for i in order}
    for p in points:
        cells = []
        for i in order:
            r = data[i].get(p)
            span = r.get("timed_unix_s") if ok(r) else None
            w = [s for s in smi if span and span[0] <= s[0] <= span[1]]
            if w:
                mhz = statistics.median(s[1] for s in w)
                per_impl[i].append(mhz)
                cells.append(f"{mhz:.0f} / {statistics.median(s[2] for s in w):.0f} ({len(w)})")
            else:
                cells.append("—")
        rows.append(row_head(p) + "| " + " | ".join(cells) + " |")
    medians = ", ".join(f"{i} {statistics.median(v):.0f} MHz" for i, v in per_impl.items() if v)
    return md_table("SM clock (MHz) / board power (W) during each point's timed repetitions (samples)",
                    "Medians of the nvidia-smi samples inside each point's timed span. The H200 caps board power at "
                    "700 W: a kernel that reaches it runs at a lower clock, so a throughput ratio compares both the "
                    "kernels and their clocks. The clock is sampled; the power is the driver's average over about a "
                    "second, so a short point shows some of what ran before it. "
                    f"Median over the points: {medians or 'no samples'}.", order, rows)


def markdown(data, order, sources, smi=None):
    points = points_of(data)
    parts = ["## sagebwd vs PyTorch SDPA (BF16): cuDNN and FlashAttention-2", "",
             *[f"- {s}" for s in sources], "",
             throughput_table(data, order, points),
             memory_table(data, order, points),
             quant_table(data, order, points),
             ratio_table(data, order, points),
             clock_table(data, order, points, smi) if smi else None,
             summary(data, order, points)]
    return "\n".join(p for p in parts if p is not None)


def plot(data, order, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401  (used as matplotlib.ticker)
    except ImportError:
        return "note: matplotlib not found, no plot written"
    points = points_of(data)
    groups = sorted({(d, c) for d, _, c in points})
    fig, axes = plt.subplots(len(PASSES), len(groups), figsize=(4.2 * len(groups), 3.4 * len(PASSES)),
                             squeeze=False, sharex=True)
    all_values = [r[f"{k}_tops"] for i in order for r in data[i].values() if ok(r) for k, _ in PASSES]
    # Scalar kernels sit two orders of magnitude under cuDNN: a log axis keeps both readable.
    log_y = bool(all_values) and max(all_values) / max(min(all_values), 1e-9) > 20
    for row, (key, name) in enumerate(PASSES):
        for col, (d, causal) in enumerate(groups):
            ax = axes[row][col]
            for impl in order:
                pts = sorted((n, r[f"{key}_tops"]) for (dd, n, c), r in data[impl].items()
                             if dd == d and c == causal and ok(r))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl,
                            linestyle="--" if impl in (BASE, FA2) else "-")
            ax.set_xscale("log", base=2)
            ns = sorted({n for dd, n, c in points if dd == d and c == causal})
            ax.set_xticks(ns, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in ns])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            if log_y:
                ax.set_yscale("log")
            ax.set_title(f"{name}, D={d}, {'causal' if causal else 'full'}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if col == 0:
                ax.set_ylabel("TOPS (TFLOP/s)")
            if row == len(PASSES) - 1:
                ax.set_xlabel("N (B·N fixed)")
    legend = {}  # every implementation, even one missing from the first panel
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, h)
    handles, labels = list(legend.values()), list(legend.keys())
    fig.legend(handles, labels, loc="upper center", ncol=max(1, len(labels)), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", help="JSON files of sagebwd bench / bench_sdpa.py")
    p.add_argument("--md", help="write the Markdown tables here")
    p.add_argument("--png", help="write the plot here")
    p.add_argument("--smi", help="nvidia-smi log (timestamp, clocks.sm, power.draw, ...) taken during the benches")
    a = p.parse_args(argv)
    data, order, sources = load(a.results)
    if not data:
        sys.exit("error: no results in " + ", ".join(a.results))
    smi = None
    if a.smi:
        try:
            smi = read_smi(a.smi)
        except OSError as e:
            print(f"note: no clock table: {e}", file=sys.stderr)
    text = markdown(data, order, sources, smi)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text)
    if a.png:
        print(plot(data, order, a.png), file=sys.stderr)
    print(text)


if __name__ == "__main__":
    main()
