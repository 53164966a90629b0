"""The base-model families cca-convert supports: one row each, read by the converter, the CLI help, the default
recipes, the finetune (which projections are Q/K/V) and the tests.

A family's model under a method is transformers' own causal-LM class with the method's mixin in front (e.g.
``CCAModelMixin``, ``modeling/cca_hf.py``); the exported repo's ``modeling_<method>_<model_type>.py`` is generated
from the row (``published.modeling_source``).
Adding a family = a row here + a shipped recipe (+ tiny-checkpoint sizes in ``tests/support/factories.TINY`` if the
defaults do not fit). What the row cannot
express is refused by ``config_problems`` with the reason, never converted approximately.
"""

from __future__ import annotations

from dataclasses import dataclass

QKV = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    causal_lm: str  # transformers' class (top-level import name)
    names: str  # the base models users bring
    recipe: str  # recipes/<file> used when no --recipe is given
    qkv: tuple[str, ...] = QKV  # attention input projections: trained by finetune.method=qkv, LoRA's targets
    notes: str = ""  # what differs from Llama, and how CCA treats it

    dca_recipe: str = "dca-default.yaml"  # the default recipe of method dca (--set method=dca)

    def class_name(self, method: str) -> str:
        return f"{method.upper()}{self.causal_lm}"

    def module_name(self, method: str) -> str:
        return f"modeling_{method}_{self.model_type}"


FAMILIES = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", "Llama 2/3/3.1/3.2", "llama-3.1-8b.yaml", dca_recipe="dca-llama-3.1-8b.yaml",
           notes="tied embeddings (3.2); llama3/linear/dynamic/yarn rope scaling"),
    Family("qwen2", "Qwen2ForCausalLM", "Qwen2/2.5", "qwen2.5-7b.yaml", dca_recipe="dca-qwen2.5-7b.yaml",
           notes="q/k/v bias; max_window_layers sliding layers keep their own attention"),
    Family("qwen3", "Qwen3ForCausalLM", "Qwen3", "qwen3-8b.yaml", notes="q/k-norm"),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3 MoE", "qwen3-30b-a3b.yaml", notes="q/k-norm; MoE MLP blocks"),
    Family("mistral", "MistralForCausalLM", "Mistral/Ministral (multimodal mistral3: its language model)",
           "mistral-7b.yaml",
           notes="a sliding_window on every layer is replaced by CCA (its local window + core tokens)"),
    Family("phi3", "Phi3ForCausalLM", "Phi-3/Phi-4", "phi-4.yaml", qkv=("qkv_proj",),
           notes="fused qkv_proj (trained and LoRA-adapted as one projection); longrope"),
    Family("olmo2", "Olmo2ForCausalLM", "OLMo 2", "olmo2-7b.yaml", notes="q/k-norm over all heads; post-norms"),
    Family("gemma3_text", "Gemma3ForCausalLM", "Gemma 3 (text; multimodal gemma3: its language model)",
           "gemma3-12b.yaml",
           notes="CCA on the global layers; the local (sliding) layers keep their own attention; "
                 "query_pre_attn_scalar scaling"),
)}

# Known model types that are refused, with the reason (anything else: "unsupported", listing FAMILIES).
REFUSED = {
    "gemma2": "caps attention logits (attn_logit_softcapping), which the CCA kernels do not implement",
    "phi": "rotates only part of each head (partial_rotary_factor), which CCA's core-token RoPE does not implement",
    "deepseek_v3": "uses multi-head latent attention, not the q/k/v attention CCA replaces",
}


def supported_text() -> str:
    return "; ".join(f"{f.model_type} ({f.names})" for f in FAMILIES.values())


def family_of(raw: dict) -> Family:
    """The row for a base ``config.json`` (as a dict); ValueError naming the supported ones otherwise."""
    model_type = raw.get("model_type")
    if model_type in REFUSED:
        raise ValueError(f"model_type={model_type!r} is not supported: it {REFUSED[model_type]}")
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported architecture model_type={model_type!r}; supported: {supported_text()}")
    return FAMILIES[model_type]


def config_problems(raw: dict) -> list[str]:
    """Base-config fields CCA would silently change; each is refused with its reason."""
    problems = []
    if raw.get("attn_logit_softcapping") is not None:
        problems.append(f"attn_logit_softcapping={raw['attn_logit_softcapping']}: the CCA kernels do not cap logits")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    partial = raw.get("partial_rotary_factor", rope.get("partial_rotary_factor") if isinstance(rope, dict) else None)
    if partial not in (None, 1, 1.0):
        problems.append(f"partial_rotary_factor={partial}: CCA rotates whole heads (core tokens are re-rotated at "
                        "their group middle)")
    if raw.get("attention_dropout"):
        problems.append(f"attention_dropout={raw['attention_dropout']}: CCA attention has no dropout")
    return problems


def kept_sliding_window(config) -> int:
    """The window of the sliding-window layers a mixed model keeps as they are (Gemma 3's local layers, Qwen's
    ``max_window_layers``); 0 when it has none, or when every layer slides (there CCA replaces the window)."""
    text = getattr(config, "text_config", None) or config
    types = getattr(text, "layer_types", None) or ()
    if "sliding_attention" not in types or all(t == "sliding_attention" for t in types):
        return 0
    return getattr(text, "sliding_window", None) or 0


def replaces_sliding_window(config) -> bool:
    """True when every layer of a (built) base config is a sliding-window layer (Mistral's ``sliding_window``):
    there CCA replaces the window itself — its local window plus core tokens of older groups — rather than leaving
    every layer as it is. Mixed models (Gemma 3, Qwen's ``max_window_layers``) keep their sliding layers."""
    if getattr(config, "sliding_window", None) is None:
        return False
    types = getattr(config, "layer_types", None)
    return types is None or all(t == "sliding_attention" for t in types)
