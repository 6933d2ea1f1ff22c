#!/usr/bin/env python3
"""Summarize an nvidia-smi log taken during a training run: one line per plateau of high power draw.

The H200 caps board power (700 W); a training step at full load reaches the cap and the SM clock then
drops below its 1980 MHz maximum by an amount that depends on the energy each kernel spends. Two
presets can therefore run at different clocks in the same call (e.g. `fpa` ~1730 MHz, `sagebwd`
~1800 MHz at sequence 4096 on an H200), which a bench of attention alone never shows. A run with several presets
shows one plateau per preset, in the order of `--preset`.

Input: `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,power.limit[,temperature.gpu] --format=csv,noheader,nounits
-lms 100` (the temperature column is optional). Leakage grows with temperature, so
at the cap a warmer GPU runs lower clocks: runs compared should have similar temperatures.
Usage: power_log.py LOG.csv
"""
import statistics
import sys


def number(field):
    """The field as a float, None for "[N/A]" or a truncated value."""
    try:
        return float(field)
    except ValueError:
        return None


def samples(path):
    out = []
    for line in open(path):
        f = [x.strip() for x in line.split(",")]
        values = [number(x) for x in f[1:5]]
        if len(values) < 3 or None in values[:3]:
            continue  # header, a "[N/A]" field or a truncated last line
        out.append((f[0], *values[:3], values[3] if len(values) > 3 else None))
    return out


def plateaus(rows, frac=0.9, gap=2, min_len=5):
    """Runs of samples drawing more than `frac` of the highest draw seen, bridging gaps of ≤ `gap` samples
    (the board's power reading lags: a lower threshold takes in the ramps, whose clocks are not the step's)."""
    if not rows:
        return []
    hi = frac * max(r[2] for r in rows)
    runs, cur, low = [], [], 0
    for r in rows:
        if r[2] > hi:
            cur.append(r)
            low = 0
        elif cur:
            low += 1
            if low > gap:
                runs.append(cur)
                cur, low = [], 0
    if cur:
        runs.append(cur)
    return [r for r in runs if len(r) >= min_len]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    rows = samples(sys.argv[1])
    found = plateaus(rows)
    if not found:
        print(f"  power: no plateau of high draw in {len(rows)} samples")
    for i, p in enumerate(found):
        clk = [r[1] for r in p]
        pw = [r[2] for r in p]
        temps = [r[4] for r in p if r[4] is not None]
        temp = f", GPU {min(temps):.0f}–{max(temps):.0f} °C" if temps else ""
        print(f"  power plateau {i + 1}: from {p[0][0]}, {len(p)} samples: SM clock median {statistics.median(clk):.0f} MHz "
              f"(mean {statistics.mean(clk):.0f}), power median {statistics.median(pw):.0f} W of limit {p[0][3]:.0f} W{temp}")


if __name__ == "__main__":
    main()
