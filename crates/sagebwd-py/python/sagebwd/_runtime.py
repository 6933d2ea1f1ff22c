"""Finding NVRTC and the GPU: no PyTorch here, so that this part imports and tests without it."""

import ctypes
import os
import sys
import threading

from . import _native

NVRTC = "libnvrtc.so.13"
_lock = threading.Lock()
_devices = {}
_nvrtc_checked = False
# The PyTorch op's default: the backward splits its heads so that its peak memory stays within cuDNN's (SDPA's) at
# every shape; "auto" trades that for speed at N <= 2k (sagebwd.set_backward_memory; SAGEBWD_BWD_GROUPS, the library's
# variable, sets it for the process).
_backward_memory = os.environ.get("SAGEBWD_BWD_GROUPS", "").strip() or "lean"


def _candidate_dirs():
    """Directories that may hold libnvrtc.so.13: $SAGEBWD_NVRTC_DIR, then the `nvidia` pip wheels
    (torch's CUDA 13 wheels bring nvidia-cuda-nvrtc: nvidia/cu13/lib), then $CUDA_HOME/lib64."""
    env = os.environ.get("SAGEBWD_NVRTC_DIR")
    if env:
        yield env
    for base in sys.path:
        for sub in (("nvidia", "cu13", "lib"), ("nvidia", "cuda_nvrtc", "lib")):
            yield os.path.join(base, *sub)
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home:
        yield os.path.join(cuda_home, "lib64")
    yield "/usr/local/cuda/lib64"


def find_nvrtc():
    """The path of the first libnvrtc.so.13 found in the candidate directories, or None."""
    for d in _candidate_dirs():
        p = os.path.join(d, NVRTC)
        if os.path.isfile(p):
            return p
    return None


def ensure_nvrtc():
    """Makes libnvrtc.so.13 loadable by the kernels' compiler: if the dynamic linker cannot find it
    by name, loads it (and its builtins library) from a candidate directory with RTLD_GLOBAL, so
    the extension's later dlopen of the same name finds the loaded copy. Raises RuntimeError naming
    what is missing otherwise."""
    global _nvrtc_checked
    if _nvrtc_checked:
        return
    try:
        ctypes.CDLL(NVRTC, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        path = find_nvrtc()
        if path is None:
            raise RuntimeError(
                "sagebwd needs NVRTC 13 (libnvrtc.so.13) to compile its kernels and found none: not on the "
                "library path, not in an `nvidia` pip wheel on sys.path (nvidia/cu13/lib), not in $CUDA_HOME/lib64. "
                "Install it with `pip install nvidia-cuda-nvrtc==13.0.88` (or `pip install sagebwd[nvrtc]`), "
                "or set SAGEBWD_NVRTC_DIR to the directory holding libnvrtc.so.13."
            ) from None
        d = os.path.dirname(path)
        for name in sorted(os.listdir(d)):
            if name.startswith("libnvrtc-builtins.so"):
                ctypes.CDLL(os.path.join(d, name), mode=ctypes.RTLD_GLOBAL)
                break
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    ok, message = _native.nvrtc_status()
    if not ok:
        raise RuntimeError(message)
    _nvrtc_checked = True


def device(ordinal):
    """The extension's Device of this CUDA ordinal (opened once: primary context, kernels compiled by
    NVRTC at first use and cached in `cache_dir()`). RuntimeError, with the reason, without a GPU,
    a driver or NVRTC."""
    dev = _devices.get(ordinal)
    if dev is not None:
        return dev
    with _lock:
        dev = _devices.get(ordinal)
        if dev is None:
            ensure_nvrtc()
            dev = _native.Device(ordinal)
            dev.set_backward_groups(_backward_memory)
            _devices[ordinal] = dev
    return dev


def set_backward_memory(policy):
    """How the backward bounds its peak memory, on every GPU, for every later call: "lean" (the default: within
    SDPA's peak at every shape; on an H100 fwd+bwd 1.078 ms at [4, 16, 2048, 128] causal), "auto" (split only where it
    costs no time: 0.879 ms there, 1.42x SDPA's peak), "off" (never split), or a number of head groups.
    ValueError for anything else (checked before any device changes)."""
    global _backward_memory
    policy = str(policy)
    _native.check_backward_groups(policy)
    with _lock:
        for dev in _devices.values():
            dev.set_backward_groups(policy)
        _backward_memory = policy


def empty_cache():
    """Returns the memory the library keeps for its workspaces (its own stream-ordered pool, outside PyTorch's
    caching allocator) to the driver, after the GPU work queued so far; as torch.cuda.empty_cache does for PyTorch's."""
    for dev in list(_devices.values()):
        dev.empty_cache()


def cache_dir():
    """Where compiled kernels are cached: $SAGEBWD_CACHE_DIR, else $XDG_CACHE_HOME/sagebwd, else ~/.cache/sagebwd."""
    return _native.cache_dir()
