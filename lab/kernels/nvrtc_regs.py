#!/usr/bin/env python3
"""Registers and spills of every kernel of one stage, as the library compiles it (no GPU needed).

    LD_LIBRARY_PATH=.cache/nvrtc/nvidia/cu13/lib \\
        python3 lab/kernels/nvrtc_regs.py quantize.cu sm_90a 128 [-DNAME=VALUE ...] [--cubin out.cubin]

Compiles common.cuh + hopper.cuh + the stage's pieces (src/runtime.rs `SOURCES`) with NVRTC and the library's options (src/runtime.rs `nvrtc_options`)
plus --ptxas-options=-v, and prints ptxas's register line of each kernel and its spill line where it spills. With
--cubin it also writes the cubin (for nvdisasm, lab/kernels/sass_diff.py). Needs the pip NVRTC that scripts/test.sh
installs into .cache/nvrtc. Use it to size a kernel's launch bounds or to see whether a change spills."""
import argparse, ctypes, pathlib, re, sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = ROOT / "crates/sagebwd-cuda/kernels"
NVRTC = ROOT / ".cache/nvrtc/nvidia/cu13"


def pieces(stage):
    """The stage's pieces, as src/runtime.rs `SOURCES` composes them (`stage_source!` lists)."""
    rs = (ROOT / "crates/sagebwd-cuda/src/runtime.rs").read_text()
    m = re.search(r'\(\s*"' + re.escape(stage) + r'",\s*stage_source!\((.*?)\)', rs, re.S)
    if not m:
        sys.exit(f"{stage}: not a stage of src/runtime.rs SOURCES")
    return re.findall(r'"([^"]+)"', m.group(1))


def source(stage):
    head = [("common/common.cuh", KERNELS / "common/common.cuh"), ("sm90/hopper.cuh", KERNELS / "sm90/hopper.cuh")]
    body = "".join(f'#line 1 "{p}"\n{(KERNELS / p).read_text()}' for p in pieces(stage))
    return "".join(f'#line 1 "{name}"\n{path.read_text()}\n' for name, path in head) + f'#line 1 "{stage}"\n{body}\n'


def compile_stage(stage, arch, head_dim, defines):
    lib = ctypes.CDLL(str(NVRTC / "lib/libnvrtc.so.13"))
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source(stage).encode(), stage.encode(), 0, None, None) != 0:
        sys.exit("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}", f"-DHEAD_DIM={head_dim}", "--std=c++17", "--fmad=false", "--ftz=false",
            "--prec-div=true", "--prec-sqrt=true", "--ptxas-options=-v", f"--include-path={NVRTC / 'include'}", *defines]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts]))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    cubin = None
    if rc == 0:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, buf)
        cubin = buf.raw
    return rc, log.value.decode(), cubin


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", help="a stage of src/runtime.rs SOURCES, e.g. backward_main.cu")
    ap.add_argument("arch", help="sm_90a, sm_80, ...")
    ap.add_argument("head_dim", type=int, choices=[64, 128])
    ap.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--cubin", help="also write the cubin here")
    a = ap.parse_args()
    rc, log, cubin = compile_stage(a.stage, a.arch, a.head_dim, [f"-D{d}" for d in a.defines])
    if rc != 0:
        sys.exit(log)
    kernel = None
    for line in log.splitlines():
        if "Compiling entry function" in line:
            kernel = line.split("'")[1]
        elif "Used" in line or ("spill" in line and " 0 bytes spill stores, 0 bytes spill loads" not in line):
            print(f"{kernel}: {line.strip()}")
    if a.cubin:
        pathlib.Path(a.cubin).write_bytes(cubin)


if __name__ == "__main__":
    main()
