"""Hugging Face transformers backend: `sagebwd.hf.register()` adds "sagebwd" to transformers'
`AttentionInterface`, so that models written against it (Llama, Qwen2/3, Mistral, ...) train with
`attn_implementation="sagebwd"`.

Supported: causal or full attention over the whole sequence (no padding mask: pack sequences
instead), GQA, the model's own softmax scale, no attention dropout, no sliding window, no softcap.
Anything else is refused with a ValueError rather than computed differently."""

from .ops import attention

NAME = "sagebwd"
_options = {"preset": "sagebwd"}

def _no_mask(*args, attention_mask=None, **kwargs):
    """The mask builder registered for the backend: the kernels apply the causal mask themselves, so
    none is built. A padding mask that masks anything is passed on, for the attention function to
    refuse (checking it costs one device-to-host read, only when a mask was given)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        return attention_mask
    return None

def sagebwd_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function: query [B, H_q, N_q, d], key and value [B, H_kv, N_k, d];
    returns ([B, N_q, H_q, d], None)."""
    if attention_mask is not None:
        raise ValueError("the sagebwd attention backend takes no attention mask (padding): pack the sequences, "
                         "or pass attention_mask=None for causal language modelling")
    if dropout:
        raise ValueError(f"the sagebwd attention backend has no attention dropout (got {dropout})")
    for name in ("sliding_window", "softcap"):
        if kwargs.get(name) is not None:
            raise ValueError(f"the sagebwd attention backend does not support {name} (got {kwargs[name]})")
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = bool(getattr(module, "is_causal", True))
    # Decoding one query against a cache: end-aligned causal is full attention.
    o = attention(query, key, value, causal=bool(causal) and query.shape[2] > 1, scale=scaling, **_options)
    return o.transpose(1, 2).contiguous(), None

def register(preset="sagebwd", int8=None, bf16=None, smooth_k=None):
    """Registers the backend under "sagebwd" (with these method settings, as in `sagebwd.attention`)."""
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError("sagebwd.hf.register needs transformers (>= 4.48, which has AttentionInterface)") from e
    _options.clear()
    _options.update(preset=preset, int8=int8, bf16=bf16, smooth_k=smooth_k)
    AttentionInterface.register(NAME, sagebwd_attention_forward)
    try:  # transformers >= 4.53 builds masks per backend
        from transformers import AttentionMaskInterface

        AttentionMaskInterface.register(NAME, _no_mask)
    except ImportError:
        pass
    return NAME

__all__ = ["register", "sagebwd_attention_forward", "NAME"]
