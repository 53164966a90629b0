"""What every attention method's shim (cca_hf.py, dca_hf.py) needs from transformers' stock attention modules.

transformers passes an attention function q, k, v after RoPE and neither the layer's rotary tables nor its cache; a
forward pre-hook keeps both on the module for the call. The registry holds one function per name while every
exported repo ships its own copy of the shim (several may share a process), so the registered function runs the
implementation the hook stored: the one of the copy that built the module.
"""

import dataclasses
import sys

from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

logger = logging.get_logger(__name__)

# transformers 5.24 renamed the cache argument and output field ``past_key_values`` to ``cache`` (the old name works
# until 5.40, with a warning): the shims take either name and pass on the one this version speaks.
CACHE_ARG = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


def given_cache(cache, past_key_values):
    """The cache a caller passed as ``cache=`` or ``past_key_values=`` (two different ones: a clear error)."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("both cache= and past_key_values= were passed, with different caches: pass one (cache= "
                         "from transformers 5.24 on)")
    return past_key_values if cache is None else cache


class MethodModelMixin:
    """What a method's mixin (``CCAModelMixin``, ``DCAModelMixin``) shares, in front of a stock causal-LM class: the
    attention implementation defaults to the method's registered function, its pre-hook sits on every attention
    module, another ``attn_implementation`` runs the base's own attention (with a warning), and attention weights,
    which the method never forms, are refused rather than returned as ``None``."""

    method = ""  # the registered attention function's name ("cca", "dca")
    no_weights = ""  # why output_attentions cannot be honoured

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _name_for_pipelines(cls)

    def _hook_attention_modules(self, implementation):
        for module in self.modules():
            if hasattr(module, "layer_idx") and hasattr(module, "o_proj"):  # the attention modules
                module.register_forward_pre_hook(capture_hook(self.method, implementation), with_kwargs=True)
                module.register_forward_hook(release_context, always_call=True)
                yield module

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        if attn_implementation is None or attn_implementation == self.method:
            return self.method
        name = self.method.upper()
        logger.warning_once(f"attn_implementation={attn_implementation!r}: this model runs its base model's own "
                            f"attention, without {name} (leave attn_implementation unset for {name})")
        return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)

    def _refuse_attention_weights(self, output_attentions):
        if output_attentions and self.config._attn_implementation == self.method:
            raise ValueError(f"output_attentions=True: {self.no_weights}; load the model with "
                             "attn_implementation='eager' to inspect the base model's attention weights")

    def _stock_kwargs(self, kwargs: dict, output_attentions, logits_to_keep) -> dict:
        """The keyword arguments of the stock forward, with the two a method's forward names in its signature:
        generate() passes ``logits_to_keep`` only to a forward whose signature shows it (without it a prefill computes
        the vocabulary's logits at every prompt position, e.g. 34 GB for 128K tokens of Llama-3.1-8B)."""
        self._refuse_attention_weights(output_attentions)
        if output_attentions is not None:
            kwargs["output_attentions"] = output_attentions
        if not isinstance(logits_to_keep, int) or logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        return kwargs


def _name_for_pipelines(cls) -> None:
    """transformers' text-generation pipeline logs a multi-kilobyte "not supported" error for any causal LM whose class
    name is not in its causal-LM name table (``check_model_type``), although it runs it. The family classes
    (``CCALlamaForCausalLM``...) are listed there under a key of their own, which no config's ``model_type`` can be:
    no model lookup ever resolves through it, only the pipeline's name check sees it."""
    if not cls.__name__.endswith("ForCausalLM"):
        return
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(f"{cls.__name__} (remote code)", cls.__name__)


def crop_length(length: int, tokens) -> int:
    """The length a cache keeps after ``crop(tokens)``: ``-n`` drops ``n`` columns and 0 keeps all (transformers >=
    5.18), a positive value is the length to keep (older versions, which also pass 0-d tensors)."""
    tokens = int(tokens)
    return length + tokens if tokens <= 0 else min(tokens, length)


class BatchOpsMixin:
    """``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave`` (beam search, contrastive search)
    for a cache layer that applies a function to each of its batch-first tensors with ``_map(fn)``."""

    def reorder_cache(self, beam_idx):
        self._map(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_select_indices(self, indices):
        self._map(lambda x: x[indices])

    def batch_repeat_interleave(self, repeats: int):
        self._map(lambda x: x.repeat_interleave(repeats, dim=0))


def capture_hook(method: str, implementation):
    """A forward pre-hook storing (position_embeddings, the cache, implementation) on the attention module."""

    def capture(module, args, kwargs):
        if kwargs.get("position_embeddings") is None:
            raise RuntimeError(f"{type(module).__name__} was not called with position_embeddings=...: this "
                               f"transformers version is not supported by {method.upper()}'s attention hook")
        cache = given_cache(kwargs.get("cache"), kwargs.get("past_key_values"))
        module._method_ctx = (kwargs["position_embeddings"], cache, implementation)

    return capture


def release_context(module, args, output):
    """A forward hook dropping what ``capture_hook`` stored: kept past the call, it would hold the last cache (and
    its captured decode steps) and rotary tables alive after ``generate()`` returned."""
    module._method_ctx = None


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


def inverse_rope(cos, sin):
    """The tables that undo a RoPE of tables ``(cos, sin)``: rotation by -theta, YaRN-style scaling divided out; fp32.
    Every layer of a forward shares them: a caller running many layers may compute them once."""
    s2 = cos[..., :1].float() ** 2 + sin[..., :1].float() ** 2
    return cos.float() / s2, -sin.float() / s2


def family_rope(module):
    """The ``apply_rotary_pos_emb`` of the module's family (modeling file)."""
    rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
    return getattr(rope, "cca_stock", rope)  # (while decode_graph defers a step's RoPE: the rotation itself)


def unrope(module, q, k, cos, sin, inverse=None):
    """``q`` and ``k`` before the family's own RoPE (its ``apply_rotary_pos_emb``, one call for both), in fp32;
    ``inverse``: ``inverse_rope(cos, sin)`` when the caller has it."""
    icos, isin = inverse or inverse_rope(cos, sin)
    return family_rope(module)(q.float(), k.float(), icos, isin)
