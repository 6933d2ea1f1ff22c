#!/usr/bin/env python3
"""Checks of compare.py that need no GPU (run by scripts/test.sh): the clock table matches nvidia-smi samples to each
point's timed span, skips lines it cannot read, and leaves a point without a span or without samples empty."""
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402


def record(impl, n, span):
    r = {"impl": impl, "head_dim": 128, "n": n, "causal": False, "fwd_ms": 1.0, "bwd_ms": 2.0, "fwdbwd_ms": 3.0,
         "fwd_tops": 500.0, "bwd_tops": 600.0, "fwdbwd_tops": 570.0, "peak_mem_bytes": 1 << 30}
    if span:
        r["timed_unix_s"] = span
    return r


def smi_line(t, mhz, watts):
    stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(t))
    return f"{stamp}.{int(round((t % 1) * 1000)):03d}, {mhz}, {watts:.2f}, 40\n"


def main():
    t0 = float(int(time.time()))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "smi.csv")
        with open(path, "w") as f:
            f.write("timestamp, clocks.sm [MHz], power.draw [W], temperature.gpu\n")  # a header: skipped
            for k in range(40):  # 0.1 s apart over [t0, t0 + 3.9]
                t = t0 + 0.1 * k
                f.write(smi_line(t, 1680 if t < t0 + 2 else 1980, 690.0 if t < t0 + 2 else 400.0))
            f.write("2026/12/02 10:00:00.000, [N/A], [N/A], 40\n")  # unreadable: skipped
        smi = compare.read_smi(path)
        assert len(smi) == 40, len(smi)
        data = {"cudnn": {(128, 4096, False): record("cudnn", 4096, [t0 + 0.05, t0 + 1.05])},
                "ours-sagebwd": {(128, 4096, False): record("ours-sagebwd", 4096, [t0 + 2.05, t0 + 3.05]),
                                 (128, 8192, False): record("ours-sagebwd", 8192, None)}}
        table = compare.clock_table(data, ["cudnn", "ours-sagebwd"], compare.points_of(data), smi)
        assert "| 128 | 4096 | no | 1680 / 690 (10) | 1980 / 400 (10) |" in table, table
        assert "| 128 | 8192 | no | — | — |" in table, table  # no cuDNN point, no span
        assert "cudnn 1680 MHz, ours-sagebwd 1980 MHz" in table, table
        # Without a log the Markdown has no clock table.
        assert "SM clock" not in compare.markdown(data, ["cudnn", "ours-sagebwd"], [])
    print("compare.py checks: ok")


if __name__ == "__main__":
    main()
