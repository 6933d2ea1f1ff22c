"""SageBwd: attention with six of its seven matrix products in INT8 (forward and backward), for
training transformers in PyTorch on NVIDIA GPUs (sm_80 and newer; the fast paths are Hopper's).

    import sagebwd
    o = sagebwd.attention(q, k, v, causal=True)   # q, k, v: [B, H, N, d] bf16/fp16 CUDA tensors

The kernels are compiled by NVRTC on first use (libnvrtc.so.13, found in torch's `nvidia` wheels)
and cached in `sagebwd.cache_dir()`.
"""

from . import _native
from ._runtime import cache_dir, empty_cache, ensure_nvrtc, find_nvrtc, set_backward_memory

PRESETS = tuple(_native.PRESETS)
PRODUCTS = tuple(_native.products())
HEAD_DIMS = tuple(_native.head_dims())
Config = _native.Config

try:
    import torch as _torch  # noqa: F401
except ImportError:
    _torch = None

if _torch is not None:
    from .ops import attention
else:

    def attention(*args, **kwargs):
        """Needs PyTorch (not installed)."""
        raise ImportError("sagebwd.attention needs PyTorch (>= 2.4): pip install torch")


def device_info(ordinal=0):
    """The GPU's name and architecture ("NVIDIA H100 80GB HBM3 (sm_90a)"). RuntimeError, with the
    reason, without a driver, a GPU or NVRTC."""
    from ._runtime import device

    return device(ordinal).describe()


__all__ = ["attention", "Config", "PRESETS", "PRODUCTS", "HEAD_DIMS", "cache_dir", "device_info", "empty_cache",
           "ensure_nvrtc", "find_nvrtc", "set_backward_memory"]
