"""What every attention method's shim (cca_hf.py, dca_hf.py) needs from transformers' stock attention modules.

transformers passes an attention function q, k, v after RoPE and neither the layer's rotary tables nor its cache; a
forward pre-hook keeps both on the module. The registry holds one function per name while every exported repo ships
its own copy of the shim (several may share a process), so the registered function runs the implementation the hook
stored: the one of the copy that built the module.
"""

import sys


def capture_hook(method: str, implementation):
    """A forward pre-hook storing (position_embeddings, past_key_values, implementation) on the attention module."""

    def capture(module, args, kwargs):
        if kwargs.get("position_embeddings") is None:
            raise RuntimeError(f"{type(module).__name__} was not called with position_embeddings=...: this "
                               f"transformers version is not supported by {method.upper()}'s attention hook")
        module._method_ctx = (kwargs["position_embeddings"], kwargs.get("past_key_values"), implementation)

    return capture


def dispatching(method: str):
    """The function to register as ``method``: it runs the implementation captured for the module."""

    def attention_forward(module, *args, **kwargs):
        ctx = getattr(module, "_method_ctx", None)
        if ctx is None:
            raise RuntimeError(f"{type(module).__name__} runs attn_implementation={method!r} but was not built by "
                               f"a {method.upper()} model class (its mixin registers the hook that feeds it)")
        return ctx[2](module, *args, **kwargs)

    attention_forward.__name__ = f"{method}_attention_forward"
    return attention_forward


def unrope(module, x, cos, sin):
    """The exact inverse of the family's own RoPE (rotation by -theta; YaRN-style scaling divided out), in fp32."""
    rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
    s2 = cos[..., :1].float() ** 2 + sin[..., :1].float() ** 2
    xf = x.float()
    return rope(xf, xf, cos.float() / s2, -sin.float() / s2)[0]
