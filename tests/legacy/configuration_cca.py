"""Configuration of a Core Context Aware (CCA) attention model.

A CCA model keeps its base model's architecture and weights (Llama 2/3/3.1/3.2, Qwen2/2.5) and only
changes how attention is computed, so the config is the base's Llama-style fields plus four CCA
fields. ``group_size`` and ``local_window`` may be overridden at load time (paper Sec. 4.3):
``from_pretrained(repo, trust_remote_code=True, group_size=8, local_window=2048)``.
"""

from transformers import LlamaConfig

POOLING_MODES = ("kv", "query")
ATTN_BACKENDS = ("auto", "triton", "reference", "full")


class CCAConfig(LlamaConfig):
    model_type = "cca"

    # Tokens pooled into one core token.
    group_size: int = 16
    # Raw keys each query sees at least (its most recent ~s positions).
    local_window: int = 1024
    # "kv": one core token per KV head (GQA-friendly); "query": one per query head (the paper's).
    pooling: str = "kv"
    # "auto": Triton on CUDA, PyTorch reference elsewhere; "full": plain causal attention (A/B runs).
    attn_backend: str = "auto"
    # Bias on o_proj; None means "same as attention_bias" (Llama). Qwen2 has q/k/v bias but none on o_proj.
    attention_out_bias: bool | None = None
    # The architecture this model was converted from ("llama" or "qwen2").
    base_model_type: str = "llama"

    def __setattr__(self, name, value):
        # Checked on every assignment, not only in __init__: from_pretrained(..., group_size=8) sets the
        # overrides on the built config, and a typo there must fail at load, not run CCA silently.
        if name in ("group_size", "local_window"):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CCAConfig.{name} must be an integer >= 1, got {value!r}")
        elif name == "pooling" and value not in POOLING_MODES:
            raise ValueError(f"CCAConfig.pooling must be one of {POOLING_MODES}, got {value!r}")
        elif name == "attn_backend" and value not in ATTN_BACKENDS:
            raise ValueError(f"CCAConfig.attn_backend must be one of {ATTN_BACKENDS}, got {value!r}")
        super().__setattr__(name, value)

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.attention_out_bias is None:
            self.attention_out_bias = self.attention_bias
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")


__all__ = ["CCAConfig"]
