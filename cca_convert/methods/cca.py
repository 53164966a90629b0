"""Core Context Aware attention (docs/CCA-SPEC.md): groups of g tokens pooled into core tokens plus a local window of
s raw keys, one softmax; adapted with a short finetune."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..families import replaces_sliding_window
from ..kernels.cca_params import CHOICES, DEFAULTS, MINIMUM
from ..schema import Section
from .base import Method, base_context


class CCASection(Section):
    group_size: int = Field(DEFAULTS["group_size"], ge=MINIMUM["group_size"],
                            description="tokens pooled into one core token (g)")
    local_window: int = Field(DEFAULTS["local_window"], ge=MINIMUM["local_window"],
                              description="raw keys each query keeps (s)")
    pooling: Literal[CHOICES["pooling"]] = DEFAULTS["pooling"]
    rope_theta: float | None = Field(None, gt=0, description="override the base RoPE theta (long-context finetunes)")
    max_position_embeddings: int | None = Field(None, ge=1, description="override the base context length")
    attn_backend: Literal[CHOICES["attn_backend"]] = DEFAULTS["attn_backend"]


class CCA(Method):
    name, label, title = "cca", "CCA", "Core Context Aware attention"
    module, mixin_name = "cca_hf", "CCAModelMixin"
    what = "whose full attention layers run CCA (cca_hf.py says how; everything else is the stock model)"
    section = CCASection
    tags = ("cca", "core-context-aware-attention")
    base_note = "(the same weights with attn_backend=full)"
    # cca-convert's whole-model prefill benchmark (benchmarks/prefill.py)
    gpu_speed_note = ("on one H100 the Triton kernels make a Llama-3.1-8B-shaped model's whole prefill 1.40x faster "
                      "than full attention at 32K tokens and 2.72x at 128K (cca-convert's `benchmarks/prefill.py`, "
                      "`benchmarks/results/prefill-h100-bffba6f.json`)")

    def mixin(self) -> type:
        from ..modeling.cca_hf import CCAModelMixin

        return CCAModelMixin

    def build_config(self, base_dir, family, config, recipe) -> None:
        cca = recipe.cca
        if replaces_sliding_window(config):
            config.cca_replaced_sliding_window = config.sliding_window
            if getattr(config, "layer_types", None):
                # every layer is CCA's now; sliding_window stays (Gemma 3's model builds its window mask whatever the
                # layer types, and fails without it) but no layer is of the type it applies to
                config.layer_types = ["full_attention"] * len(config.layer_types)
                rope = config.rope_parameters
                if isinstance(rope, dict) and isinstance(rope.get("sliding_attention"), dict):
                    # per layer type (Gemma 3): the layers keep the rotation they were trained with
                    config.rope_parameters = {**rope, "full_attention": dict(rope["sliding_attention"])}
            else:
                config.sliding_window = None
        if cca.rope_theta is not None:
            rope = dict(config.rope_parameters)
            if isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma 3): CCA's layers are the full ones
                rope["full_attention"] = {**rope["full_attention"], "rope_theta": cca.rope_theta}
            else:
                rope["rope_theta"] = cca.rope_theta
            config.rope_parameters = rope
        if cca.max_position_embeddings is not None:
            config.max_position_embeddings = cca.max_position_embeddings
        for key in DEFAULTS:
            setattr(config, f"cca_{key}", getattr(cca, key))

    def describe(self, config) -> str:
        replaced = getattr(config, "cca_replaced_sliding_window", None)
        return (f"CCA g={config.cca_group_size} s={config.cca_local_window} pooling={config.cca_pooling}"
                + (f"; CCA replaces its sliding window ({replaced})" if replaced else ""))

    def check_ranges(self, job, problems) -> None:
        super().check_ranges(job, problems)
        context, cca = job.config.max_position_embeddings, job.recipe.cca
        if cca.group_size > context:
            problems.errors.append(f"cca.group_size={cca.group_size} exceeds the model's context "
                                   f"(max_position_embeddings={context}): no group would ever be pooled; use a group "
                                   "size well below it (e.g. 16)")
        if cca.local_window > context:
            problems.warnings.append(f"cca.local_window={cca.local_window} >= the context ({context}): every query "
                                     "sees all its keys raw, so CCA is plain causal attention here (no saving)")
        elif cca.local_window < cca.group_size:
            problems.warnings.append(f"cca.local_window={cca.local_window} < cca.group_size={cca.group_size}: the "
                                     "newest queries of a group then see fewer than g raw keys (allowed; the paper "
                                     "uses s >= g)")
        v = job.recipe.validate
        if v.enabled:
            beyond = [n for n in v.context_lengths if n > context]
            if beyond:
                problems.errors.append(f"validate.context_lengths {beyond} exceed the model's context "
                                       f"(max_position_embeddings={context}); drop them, or extend the context with "
                                       f"--set extend.factor={-(-max(beyond) // context)} (and a finetune)")
            base_ctx = base_context(job)
            if base_ctx and not beyond and any(n > base_ctx for n in v.context_lengths):
                problems.warnings.append(f"validate.context_lengths go past the base model's own context ({base_ctx}): "
                                         "its perplexity there is out of its trained range")

    def detects(self, config: dict) -> bool:
        return "cca_group_size" in config

    def model_info(self, config) -> dict:
        return {key: getattr(config, f"cca_{key}", DEFAULTS[key]) for key in ("group_size", "local_window", "pooling")}

    def settings_text(self, info: dict) -> str:
        return f"CCA g={info.get('group_size')}, s={info.get('local_window')}, pooling {info.get('pooling')}"

    def card_body(self, config, family, finetuned: bool, **fields) -> str:
        sliding = sum(t == "sliding_attention" for t in getattr(config, "layer_types", None) or [])
        replaced = getattr(config, "cca_replaced_sliding_window", None)
        rope = config.rope_parameters
        rope = rope.get("full_attention", rope) if isinstance(rope, dict) else {}
        return BODY.format(
            **fields, causal_lm=family.causal_lm, module=family.module_name(self.name),
            layers_note=(f" (CCA also replaces the base's {replaced}-token sliding window)" if replaced else
                         f" ({sliding} sliding-window layers keep their own attention)" if sliding else ""),
            g=config.cca_group_size, s=config.cca_local_window, pooling=config.cca_pooling,
            pooling_note="one core token per KV head" if config.cca_pooling == "kv" else "one core token per query head",
            rope_theta=rope.get("rope_theta"), max_pos=config.max_position_embeddings,
            trained="The attention was then adapted with a short finetune (see the recipe)." if finetuned
            else "No finetune was run: quality may be below the base model's until one is.")


BODY = """
# {name}

This is **{base}** converted to **Core Context Aware (CCA) attention** (Chen et al., "Core Context
Aware Transformers for Long Context Language Modeling", ICML 2025) with cca-convert. {trained}

CCA pools every group of `g` tokens into one *core token* (weights from the group's last query) and
lets each query attend, in one softmax, to the core tokens of distant groups plus the raw keys of its
most recent ~`s` tokens. Attention costs O(L²/g + L·s) instead of O(L²), and the KV cache keeps only
core tokens and the local window. No parameters were added: the weights have the base model's names, and the
model is transformers' own `{causal_lm}` with its full-attention layers running CCA{layers_note}.

| setting | value |
| --- | --- |
| group size `g` | {g} |
| local window `s` | {s} |
| pooling | `{pooling}` ({pooling_note}) |
| RoPE theta | {rope_theta} |
| context length (max_position_embeddings) | {max_pos} |

## Usage

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

{local_note}tokenizer = AutoTokenizer.from_pretrained("{repo}")  # the base model's tokenizer
# trust_remote_code: the model class is {module}.py (the stock class + cca_hf.py's CCA attention).
model = AutoModelForCausalLM.from_pretrained("{repo}", trust_remote_code=True, dtype="auto")
# g and s can be changed at load time without retraining (paper Sec. 4.3):
# AutoModelForCausalLM.from_pretrained("{repo}", trust_remote_code=True, cca_group_size=8, cca_local_window=2048)
```

Requirements: `transformers>=5.17` and `torch>=2.11` (older transformers cannot load this code);
`triton` on CUDA only. On CUDA the attention runs as a Triton kernel (`pip install triton`); elsewhere a
PyTorch reference implementation is used (`cca_attn_backend="triton"` without a GPU is an error that says so).
`cca_attn_backend="full"` at load time runs plain causal attention with the same weights, for A/B comparisons;
`attn_implementation="sdpa"` runs the base model's own attention. On CUDA, `generate()` replays each one-token decode
step from a CUDA graph (captured on the first step, again when the cache's buffers change), with the model's norms
and MLPs compiled by `torch.compile`, its linear layers run as Triton few-row products and the step's RoPE done by
the CCA decode kernel inside it (the first steps take seconds longer); `cca_cuda_graphs=False` at load time decodes eagerly, `cca_compile_decode=False` captures
the stock code. There `generate()` also reads its stopping flag one step late (transformers' `DeferredStopCheck`,
which it uses by itself only on MPS): the host queues each step while the previous one runs, and the output is the
same; `cca_defer_stop_checks=False` keeps the per-step sync.

{extra}
## Recipe

The exact recipe used (`cca_recipe.yaml` in this repo):

```yaml
{recipe}```
"""
