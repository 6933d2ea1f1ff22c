#!/usr/bin/env python3
"""Which preprocessor arms of a kernel stage are live in the library's four compiles (sm_90a / sm_80 x d 64 / 128).

usage: python3 lab/kernels/kernel_arms.py crates/sagebwd-cuda/kernels/STAGE.cu [--apply]
Prints DEAD (live in no compile) and SAME (live exactly when its enclosing arm is: the condition is redundant) arms,
found by running `cpp` over common.cuh + hopper.cuh + the stage with each compile's macros and a marker after every
#if/#elif/#else. --apply rewrites the file without the dead arms and the redundant conditions (#ifndef default blocks
are left alone). Check the result: the stage's cubins must be identical before and after (lab/kernels/sass_diff.py).
"""
import re, subprocess, sys, os
kdir = os.path.dirname(os.path.abspath(sys.argv[1]))
src = open(sys.argv[1]).read().split("\n")
out, markers, parent = [], {}, {}
stack = []  # line of the current arm at each nesting level
for i, line in enumerate(src):
    out.append(line)
    s = line.strip(); ln = i + 1
    m = re.match(r"#\s*(if|ifdef|ifndef|elif|else|endif)\b", s)
    if not m: continue
    k = m.group(1)
    if k in ("if", "ifdef", "ifndef"):
        parent[ln] = stack[-1] if stack else 0; stack.append(ln)
    elif k in ("elif", "else"):
        stack.pop(); parent[ln] = stack[-1] if stack else 0; stack.append(ln)
    else:
        stack.pop(); continue
    out.append(f"ARM_MARKER_{ln}"); markers[ln] = s
body = "\n".join(out)
pre = open(os.path.join(kdir, "common.cuh")).read() + "\n" + open(os.path.join(kdir, "hopper.cuh")).read() + "\n"
live = {}
for arch, defs in [("sm_90a", ["-D__CUDA_ARCH__=900", "-D__CUDA_ARCH_FEAT_SM90_ALL"]), ("sm_80", ["-D__CUDA_ARCH__=800"])]:
    for d in (64, 128):
        r = subprocess.run(["cpp", "-P", "-w", "-undef", *defs, f"-DHEAD_DIM={d}", "-D__CUDACC__", "-"], input=pre + body,
                           capture_output=True, text=True)
        if r.returncode: sys.exit(r.stderr)
        live[(arch, d)] = set(int(m) for m in re.findall(r"ARM_MARKER_(\d+)", r.stdout))
def cfgs(ln):
    return frozenset(c for c, v in live.items() if ln in v) if ln else frozenset(live)
for ln, s in markers.items():
    c, pc = cfgs(ln), cfgs(parent[ln])
    if not pc: continue  # inside a dead arm: reported with it
    if not c: print(f"DEAD {ln}: {s}")
    elif c == pc and not s.startswith("#ifndef"): print(f"SAME {ln}: {s}   [{len(c)} cfg]")

# --apply: rewrite FILE without dead arms and without conditions that always hold where they are
if "--apply" in sys.argv:
    groups, gstack = [], []
    for i, line in enumerate(src):
        s = line.strip(); ln = i + 1
        m = re.match(r"#\s*(if|ifdef|ifndef|elif|else|endif)\b", s)
        if not m: continue
        k = m.group(1)
        if k in ("if", "ifdef", "ifndef"): gstack.append({"arms": [(ln, k)], "parent": parent[ln]})
        elif k in ("elif", "else"): gstack[-1]["arms"].append((ln, k))
        else:
            g = gstack.pop(); g["end"] = ln; groups.append(g)
    drop, rewrite = set(), {}
    for g in groups:
        pc = cfgs(g["parent"])
        if not pc: continue
        if g["arms"][0][1] == "ifndef": continue  # default definitions: left alone
        bounds = [a[0] for a in g["arms"]] + [g["end"]]
        arms = [(a[0], a[1], cfgs(a[0]), bounds[j + 1]) for j, a in enumerate(g["arms"])]
        live_arms = [a for a in arms if a[2]]
        if len(live_arms) == 1 and live_arms[0][2] == pc:
            keep = live_arms[0]
            for a in arms:
                drop.add(a[0])
                if a is not keep: drop.update(range(a[0] + 1, a[3]))
            drop.add(g["end"])
            continue
        for j, a in enumerate(arms):
            if a[2]: continue
            drop.update(range(a[0], a[3]))
            if j == 0:
                nxt = arms[1]
                if nxt[1] == "elif": rewrite[nxt[0]] = re.sub(r"#\s*elif", "#if", src[nxt[0] - 1], count=1)
                else: drop.difference_update(range(a[0], a[3])); print(f"left: dead first arm {a[0]} before #else")
    res = [rewrite.get(i + 1, l) for i, l in enumerate(src) if (i + 1) not in drop]
    open(sys.argv[1], "w").write("\n".join(res))
    print(f"removed {len(drop)} lines")
