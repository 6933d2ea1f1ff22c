"""Argument checks of `sagebwd.attention`, on plain values (shapes, dtype names, devices), so that
they run under torch.compile's tracing and test without PyTorch."""

import math

LAYOUTS = ("bhnd", "bnhd")
DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128)
MAX_HEADS = 65535  # batch x query heads: the CUDA grid limit


def dtype_name(dtype):
    """`torch.bfloat16` -> `bfloat16` (also accepts the name itself)."""
    s = str(dtype)
    return s[len("torch."):] if s.startswith("torch.") else s


def check(q_shape, k_shape, v_shape, dtypes, devices, *, causal, scale, layout):
    """Checks the inputs and returns (B, H_q, H_kv, N_q, N_k, d) in the kernels' [B, H, N, d] terms.

    q_shape, k_shape, v_shape: tuples of ints in `layout`; dtypes: three dtype names; devices: three
    (type, index) pairs. Raises TypeError for wrong kinds of arguments, ValueError for values."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} ([B, H, N, d] or [B, N, H, d]), got {layout!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    for name, s in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(s) != 4:
            raise ValueError(f"{name} must be 4-D ({'[B, H, N, d]' if layout == 'bhnd' else '[B, N, H, d]'}), got shape {tuple(s)}")
    for name, dt in zip("qkv", dtypes):
        if dt not in DTYPES:
            raise TypeError(f"{name} has dtype {dt}; sagebwd.attention takes bfloat16 or float16 tensors")
    if len(set(dtypes)) != 1:
        raise TypeError(f"q, k, v must have one dtype, got {', '.join(dtypes)}")
    for name, (kind, _) in zip("qkv", devices):
        if kind != "cuda":
            raise ValueError(f"{name} is on {kind}; sagebwd.attention runs on CUDA tensors")
    if len(set(devices)) != 1:
        raise ValueError(f"q, k, v must be on one device, got {', '.join(f'{t}:{i}' for t, i in devices)}")

    def bhnd(s):
        return tuple(s) if layout == "bhnd" else (s[0], s[2], s[1], s[3])

    (b, hq, nq, d), (bk, hk, nk, dk), vs = bhnd(q_shape), bhnd(k_shape), bhnd(v_shape)
    if vs != (bk, hk, nk, dk):
        raise ValueError(f"k and v must have one shape, got {tuple(k_shape)} and {tuple(v_shape)}")
    if bk != b:
        raise ValueError(f"q and k must have one batch size, got {b} and {bk}")
    if dk != d:
        raise ValueError(f"q and k must have one head dimension, got {d} and {dk}")
    if min(b, hq, nq, hk, nk) < 1:
        raise ValueError(f"empty input: q {tuple(q_shape)}, k {tuple(k_shape)}")
    if hq % hk != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk}) (GQA)")
    if d not in HEAD_DIMS:
        raise ValueError(f"head dimension {d} is not supported: the kernels are built for d = 64 and 128")
    if b * hq > MAX_HEADS:
        raise ValueError(f"batch x query heads = {b * hq} exceeds the CUDA grid limit {MAX_HEADS}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be finite and positive, got {scale}")
    return b, hq, hk, nq, nk, d


def q_factor(scale, head_dim):
    """The factor Q is multiplied by so that the kernels' fixed 1/sqrt(d) gives softmax scale `scale`
    (None when no multiplication is needed)."""
    if scale is None:
        return None
    f = float(scale) * math.sqrt(head_dim)
    return None if abs(f - 1.0) < 1e-12 else f


def products(names, what):
    """A list of product names from None, one name, or an iterable of names."""
    if names is None:
        return []
    if isinstance(names, str):
        return [names]
    out = list(names)
    for n in out:
        if not isinstance(n, str):
            raise TypeError(f"{what} must name products (strings such as 'qk', 'dq'), got {n!r}")
    return out
