"""Per-kernel comparison of two SASS listings (nvdisasm -c of two cubins of the same stage), with addresses, label
numbers and internal name suffixes normalized away: prints, per kernel, "identical N", "only in one", or "DIFF a -> b"
and the first changed lines.

usage: python3 lab/kernels/sass_diff.py A.sass B.sass
(The listings come from the CUDA toolkit's nvdisasm; the cubins from NVRTC with the library's options, see
`nvrtc_options` in crates/sagebwd-cuda/src/runtime.rs.)
"""

import difflib
import re
import signal
import sys

signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends it quietly


def kernels(path):
    """{kernel: [normalized SASS lines]} of one listing."""
    out, cur = {}, None
    for line in open(path):
        m = re.match(r"\s*\.section\s+\.text\.(\w+),", line)
        if m:
            cur = m.group(1)
            out[cur] = []
            continue
        if re.match(r"\s*\.section\s", line):  # another section; `.sectioninfo` lines are not sections
            cur = None
            continue
        if line.startswith("//----") or cur is None:
            continue
        line = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line)  # addresses
        line = re.sub(r"\.L_x_[0-9]+", "", line)  # label numbers
        line = re.sub(r"__internal_[0-9]+_", "", line)
        out[cur].append(line.rstrip())
    return out


def main():
    a, b = kernels(sys.argv[1]), kernels(sys.argv[2])
    for k in sorted(set(a) | set(b)):
        if k not in a or k not in b:
            print(k, "only in one")
        elif a[k] == b[k]:
            print(k, "identical", len(a[k]))
        else:
            d = [x for x in difflib.unified_diff(a[k], b[k], lineterm="", n=0)
                 if x[:1] in "+-" and not x.startswith(("+++", "---"))]
            print(k, "DIFF", len(a[k]), "->", len(b[k]), "changed lines", len(d))
            for x in d[:12]:
                print("   ", x.strip())


if __name__ == "__main__":
    main()
