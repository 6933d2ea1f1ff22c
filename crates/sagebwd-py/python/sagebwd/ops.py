"""`sagebwd.attention`: the SageBwd attention op for PyTorch. On plain tensors in eager mode a
torch.autograd.Function calls the native kernels (the least host time per call); under torch.compile,
and for fake tensors, the same work runs as custom ops registered with torch.library (autograd, fake
implementations), so that it traces without graph breaks."""

import weakref
from typing import Optional, Tuple

import torch
import torch.utils.dlpack
from torch import Tensor

from . import _native, _runtime, _validate

# The forward's saved state, found by the address of the LSE tensor the forward returned: that
# tensor wraps the state's own LSE buffer and holds a reference to the state, so the entry lives
# exactly as long as the tensor autograd saved for the backward.
_saved = weakref.WeakValueDictionary()
_configs = {}
_checked = {}


def _config(preset: str, int8: str, bf16: str, smooth_k: Optional[bool]):
    """The method's configuration; int8, bf16: comma-separated product names (the op schema has no
    list of strings)."""
    key = (preset, int8, bf16, smooth_k)
    cfg = _configs.get(key)
    if cfg is None:
        split = lambda s: [n for n in s.split(",") if n] or None  # noqa: E731
        cfg = _native.Config(preset, split(int8), split(bf16), smooth_k)  # ValueError for unknown names
        _configs[key] = cfg
    return cfg


def _dims(q: Tensor, k: Tensor) -> Tuple[int, int, int, int, int, int]:
    b, hq, nq, d = q.shape
    _, hk, nk, _ = k.shape
    return b, hq, hk, nq, nk, d


def _kernel_input(t: Tensor) -> Tensor:
    """The tensor as the kernels read it: contiguous BF16 CUDA, 16-byte aligned (TMA copies need it; a tensor at an
    odd storage offset is copied)."""
    if t.dtype != torch.bfloat16 or not t.is_cuda or not t.is_contiguous():
        raise ValueError(f"sagebwd kernels take contiguous bfloat16 CUDA tensors, got {t.dtype} on {t.device}"
                         f"{'' if t.is_contiguous() else ' (not contiguous)'}")
    return t if t.data_ptr() % 16 == 0 else t.clone()


try:  # the current stream's raw handle without making a torch.cuda.Stream object (~2 us a call less)
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - older or future torch
    def _raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream


def _run_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, cfg):
    """O and the native saved state of contiguous BF16 [B, H, N, d] inputs, queued on the current stream."""
    q, k, v = _kernel_input(q), _kernel_input(k), _kernel_input(v)
    index = q.device.index
    dev = _runtime.device(index)
    o = torch.empty_like(q)
    saved = dev.forward(_raw_stream(index), _dims(q, k), causal, cfg, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                        o.data_ptr())
    return o, saved


def _run_backward(saved, d_o: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor):
    """dQ, dK, dV from the forward's saved state, its inputs and output, and dO."""
    if d_o.dtype != torch.bfloat16:
        d_o = d_o.to(torch.bfloat16)
    d_o, q, k, v, o = (_kernel_input(t) for t in (d_o.contiguous(), q, k, v, o))
    index = q.device.index
    dev = _runtime.device(index)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dev.backward(_raw_stream(index), saved, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), d_o.data_ptr(),
                 dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
    return dq, dk, dv


class _Attention(torch.autograd.Function):
    """The native path (plain tensors, eager mode): the saved state rides on the autograd context (no LSE tensor,
    no registry), so a call costs one autograd node and the native launches; the custom op below is what
    torch.compile traces and what fake tensors dispatch to."""

    @staticmethod
    def forward(ctx, q, k, v, causal, cfg):
        o, saved = _run_forward(q, k, v, causal, cfg)
        ctx.save_for_backward(q, k, v, o)
        ctx.state = saved
        return o

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, o = ctx.saved_tensors
        dq, dk, dv = _run_backward(ctx.state, d_o, q, k, v, o)
        return dq, dk, dv, None, None


@torch.library.custom_op("sagebwd::attention_forward", mutates_args=(), device_types="cuda")
def attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, preset: str, int8: str, bf16: str,
                      smooth_k: Optional[bool]) -> Tuple[Tensor, Tensor]:
    """O and the natural LSE [B, H_q, N_q] (FP32) of contiguous BF16 [B, H, N, d] inputs; int8 and bf16:
    comma-separated product names switched from the preset."""
    o, saved = _run_forward(q, k, v, causal, _config(preset, int8, bf16, smooth_k))
    lse = torch.utils.dlpack.from_dlpack(saved.lse_dlpack(q.device.index))
    _saved[lse.data_ptr()] = saved
    return o, lse


@attention_forward.register_fake
def _(q, k, v, causal, preset, int8, bf16, smooth_k):
    _config(preset, int8, bf16, smooth_k)
    b, hq, nq, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, hq, nq), dtype=torch.float32)


@torch.library.custom_op("sagebwd::attention_backward", mutates_args=(), device_types="cuda")
def attention_backward(d_o: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV from dO and the forward's inputs, output and LSE (which holds the saved state)."""
    saved = _saved.get(lse.data_ptr())
    if saved is None:
        raise RuntimeError("sagebwd backward: the LSE tensor is not one returned by sagebwd::attention_forward "
                           "(the forward's saved state is found through it)")
    return _run_backward(saved, d_o, q, k, v, o)


@attention_backward.register_fake
def _(d_o, q, k, v, o, lse):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _op_setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.mark_non_differentiable(lse)


def _op_backward(ctx, d_o, _d_lse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.sagebwd.attention_backward(d_o, q, k, v, o, lse)
    return dq, dk, dv, None, None, None, None, None


attention_forward.register_autograd(_op_backward, setup_context=_op_setup_context)


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: Optional[float] = None,
              preset: str = "sagebwd", int8=None, bf16=None, smooth_k: Optional[bool] = None,
              layout: str = "bhnd") -> Tensor:
    """Softmax attention softmax(scale·QKᵀ)V with SageBwd's INT8 products, differentiable.

    q: [B, H_q, N_q, d], k and v: [B, H_kv, N_k, d] (layout="bhnd", as SDPA) or [B, N, H, d]
    (layout="bnhd", as flash-attn); bfloat16 or float16 CUDA tensors; H_q a multiple of H_kv (GQA);
    d 64 or 128. causal: the mask aligned to the end (query i sees keys up to i + N_k − N_q).
    scale: default 1/sqrt(d); another value multiplies Q by scale·sqrt(d) first (one elementwise op).
    preset: "sagebwd" (six products INT8, dP in BF16), "fpa" (all BF16) or "int8-all"; int8, bf16:
    products to switch (names "qk", "pv", "qk-bwd", "dv", "dp", "dq", "dk"); smooth_k: K-smoothing.
    float16 inputs are converted to bfloat16 (and O back to float16); bnhd inputs and
    non-contiguous inputs are copied to contiguous [B, H, N, d]. Returns O in the input's dtype and layout."""
    # The native path takes plain tensors outside torch.compile; fake tensors (FakeTensorMode, meta-device tracing)
    # and other tensor subclasses go through the custom op, whose fake implementation and dispatch they need.
    native = type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and not torch.compiler.is_compiling()
    key, hit = None, None
    if native:
        # An argument signature seen before passed every check: reuse its result (the checks are pure functions of
        # these values; the types are part of the key, so that 1 and True, 1 and 1.0 are told apart).
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, causal, type(causal),
               scale, type(scale), preset, _hashable(int8), _hashable(bf16), smooth_k, type(smooth_k), layout)
        try:
            hit = _checked.get(key)
        except TypeError:  # unhashable arguments: the full checks say what is wrong with them
            key = None
    if hit is None:
        factor, int8_s, bf16_s = _check(q, k, v, causal, scale, preset, int8, bf16, smooth_k, layout)
        if not native:
            return _call(q, k, v, layout, factor, lambda q, k, v: torch.ops.sagebwd.attention_forward(
                q, k, v, causal, preset, int8_s, bf16_s, smooth_k)[0])
        hit = (factor, _config(preset, int8_s, bf16_s, smooth_k))
        if key is not None:
            if len(_checked) >= 4096:
                _checked.clear()
            _checked[key] = hit
    factor, cfg = hit
    return _call(q, k, v, layout, factor, lambda q, k, v: _Attention.apply(q, k, v, causal, cfg))


def _check(q, k, v, causal, scale, preset, int8, bf16, smooth_k, layout):
    """Every argument check of `attention`: TypeError / ValueError, else the factor Q is multiplied by (or None) and
    the comma-joined int8 and bf16 product lists."""
    dims = _validate.check(tuple(q.shape), tuple(k.shape), tuple(v.shape),
                           (_validate.dtype_name(q.dtype), _validate.dtype_name(k.dtype), _validate.dtype_name(v.dtype)),
                           ((q.device.type, q.device.index), (k.device.type, k.device.index),
                            (v.device.type, v.device.index)),
                           causal=causal, scale=scale, layout=layout)
    int8_list, bf16_list = _validate.products(int8, "int8"), _validate.products(bf16, "bf16")
    if not isinstance(preset, str):
        raise TypeError(f"preset must be a string, got {type(preset).__name__}")
    if smooth_k is not None and not isinstance(smooth_k, bool):
        raise TypeError(f"smooth_k must be a bool or None, got {type(smooth_k).__name__}")
    return _validate.q_factor(scale, dims[5]), ",".join(int8_list), ",".join(bf16_list)


def _hashable(names):
    return names if names is None or isinstance(names, str) else tuple(names)


def _call(q, k, v, layout, factor, op):
    """`op` (the native autograd function, or the custom op) on checked arguments, between the
    layout and dtype conversions: op takes contiguous BF16 [B, H, N, d] Q, K, V and returns O."""
    in_dtype = q.dtype
    if layout == "bnhd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if in_dtype != torch.bfloat16:
        q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    if factor is not None:
        q = q * factor
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = op(q, k, v)
    if in_dtype != torch.bfloat16:
        o = o.to(in_dtype)
    if layout == "bnhd":
        o = o.transpose(1, 2)
    return o
