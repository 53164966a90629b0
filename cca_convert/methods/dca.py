"""Dual Chunk Attention (docs/DCA-SPEC.md): training-free context extension by re-indexing RoPE positions in chunks,
with Qwen2.5-1M's ``dual_chunk_attention_config`` keys."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ..errors import CCAError
from ..kernels.dca_params import BACKENDS, check_params, default_sizes
from ..schema import Section
from .base import Method

logger = logging.getLogger("cca_convert")


class DCASection(Section):
    """Dual Chunk Attention (DCA-SPEC.md): Qwen2.5-1M's ``dual_chunk_attention_config`` keys. Unset (null) values come
    from the base's own ``dual_chunk_attention_config`` if it has one (used verbatim), else the ChunkLlama default
    ``chunk_size = 3c/4``, ``local_size = c/8`` (``c`` = the base's trained context), temperature off."""

    chunk_size: int | None = Field(None, ge=2, description="C: the largest RoPE position a query gets (not the chunk "
                                                            "length, which is chunk_size - local_size)")
    local_size: int | None = Field(None, ge=0, description="w: queries at in-chunk offset <= w see the previous "
                                                            "chunk at exact distances")
    trained_context: int | None = Field(
        None, ge=1, description="c: the base's trained context (null: its max_position_embeddings); chunk_size <= c; "
                                "also the length past which the temperature applies")
    temperature: bool | None = Field(None, description="multiply logits by (0.1 ln(L/c) + 1)^2 past c (Qwen2.5-1M); "
                                                       "null: as the base's dual_chunk_attention_config, else off")
    max_position_embeddings: int | None = Field(
        None, ge=1, description="the converted model's context (null: 8 x the trained context c)")
    attn_backend: Literal[BACKENDS] = "auto"

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        if isinstance(data, dict) and "original_max_position_embeddings" in data:
            raise ValueError("dca.original_max_position_embeddings is now dca.trained_context (the base's trained "
                             "context c); the exported dual_chunk_attention_config keeps Qwen's "
                             "original_max_position_embeddings, which holds c when the temperature is on and 0 when off")
        return data

    @field_validator("local_size")
    @classmethod
    def _local_below_chunk_length(cls, v, info: ValidationInfo):
        chunk = info.data.get("chunk_size")
        if v is not None and chunk is not None and v > (chunk - v) - 1:
            raise ValueError(f"must be < the chunk length chunk_size - local_size = {chunk - v} (chunk_size={chunk}); "
                             "larger values behave exactly like local_size = chunk length - 1")
        return v


def problems_with(config) -> list[str]:
    """What DCA (which re-indexes the RoPE of full-attention layers) refuses in a built base config, with why."""
    problems = []
    types = getattr(config, "layer_types", None)
    if getattr(config, "sliding_window", None) is not None and (
            "sliding_attention" in types if types else getattr(config, "use_sliding_window", True)):
        problems.append(f"sliding_window={config.sliding_window}: DCA re-indexes full attention; a sliding "
                        "window never sees past its window, so there is nothing to extend (convert it with CCA, "
                        "which replaces the window, or a checkpoint without one)")
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type") if isinstance(rope, dict) else None
    if rope_type == "dynamic":
        problems.append("rope_type='dynamic': its frequencies change with the input length, while DCA needs the "
                        "trained ones at every length; convert with a static rope type")
    if getattr(config, "attention_dropout", 0):
        problems.append(f"attention_dropout={config.attention_dropout}: the DCA attention has no dropout")
    return problems


class DCA(Method):
    name, label, title = "dca", "DCA", "Dual Chunk Attention"
    module, mixin_name = "dca_hf", "DCAModelMixin"
    what = ("whose attention layers run DCA's chunked RoPE positions (dca_hf.py says how; everything else is the "
            "stock model)")
    section = DCASection
    tags = ("dca", "dual-chunk-attention")
    reference_memory = "dca"  # its PyTorch path runs through SDPA: no (L x L) matrix
    training_free = "its Triton kernel has no backward"
    base_note = "(the same weights with plain RoPE positions, attn_implementation=sdpa)"

    def mixin(self) -> type:
        from ..modeling.dca_hf import DCAModelMixin

        return DCAModelMixin

    def default_recipe(self, family) -> str:
        return family.dca_recipe

    def build_config(self, base_dir: Path, family, config, recipe) -> None:
        """``dual_chunk_attention_config`` (Qwen2.5-1M's keys), ``dca_attn_backend`` and ``dca_trained_context``.
        A base's own ``dual_chunk_attention_config`` (Qwen2.5-1M) is used verbatim: the recipe's sizes apply to bases
        without one (a warning names any that were set and not applied)."""
        problems = problems_with(config)
        if problems:
            raise CCAError(f"{base_dir / 'config.json'}: DCA cannot convert this model: {'; '.join(problems)}")
        dca = recipe.dca
        own = dict(getattr(config, "dual_chunk_attention_config", None) or {})
        if own:  # Qwen2.5-1M style: the checkpoint's own settings, verbatim (DCA-SPEC.md); keys the spec does not use stay
            chunk, local = own.get("chunk_size"), own.get("local_size")
            c_orig = own.get("original_max_position_embeddings") or 0
            trained = c_orig or config.max_position_embeddings
            ignored = [k for k in ("chunk_size", "local_size", "trained_context", "temperature",
                                   "max_position_embeddings") if getattr(dca, k) is not None]
            if ignored:
                logger.warning(f"{base_dir / 'config.json'} has its own dual_chunk_attention_config, used verbatim: "
                               + ", ".join(recipe.where("dca", k) for k in ignored) + " not applied")
        else:  # the spec's default: ChunkLlama's C = 3c/4, w = c/8, no temperature
            trained = dca.trained_context or config.max_position_embeddings
            default_chunk, default_local = default_sizes(trained)
            chunk = dca.chunk_size or default_chunk
            local = dca.local_size if dca.local_size is not None else default_local
            c_orig = trained if dca.temperature else 0
        try:
            check_params(chunk, local, trained)
        except ValueError as exc:
            key = "chunk_size" if "exceeds" in str(exc) else "local_size"
            where = f"{base_dir / 'config.json'}: dual_chunk_attention_config" if own else recipe.where("dca", key)
            raise CCAError(f"{where}: {exc} (c = {trained}: the base's max_position_embeddings, or "
                           "dca.trained_context)") from None
        config.dual_chunk_attention_config = {**own, "chunk_size": chunk, "local_size": local,
                                              "original_max_position_embeddings": c_orig}
        config.dca_attn_backend = dca.attn_backend
        config.dca_trained_context = trained  # c: what the validation compares longer inputs with
        # The context the converted model claims (Qwen2.5-1M writes its longest input there). Only where the RoPE
        # tables do not read it: longrope/yarn derive their scaling from max_position_embeddings.
        rope = config.rope_parameters if isinstance(getattr(config, "rope_parameters", None), dict) else {}
        if not own and rope.get("rope_type", "default") in ("default", "linear", "llama3"):
            config.max_position_embeddings = max(config.max_position_embeddings,
                                                 dca.max_position_embeddings or 8 * trained)

    def trained_context(self, config) -> int | None:
        return getattr(config, "dca_trained_context", None)

    def describe(self, config) -> str:
        d = config.dual_chunk_attention_config
        return (f"DCA chunk_size C={d['chunk_size']} local_size w={d['local_size']} (chunk length "
                f"{d['chunk_size'] - d['local_size']}), temperature "
                + (f"past {d['original_max_position_embeddings']}" if d.get("original_max_position_embeddings")
                   else "off"))

    def check_ranges(self, job, problems) -> None:
        super().check_ranges(job, problems)
        context, v = job.config.max_position_embeddings, job.recipe.validate
        beyond = [n for n in v.context_lengths if n > context] if v.enabled else []
        if beyond:
            problems.errors.append(f"validate.context_lengths {beyond} exceed the converted model's context "
                                   f"(max_position_embeddings={context}); drop them, or raise "
                                   "dca.max_position_embeddings")

    def detects(self, config: dict) -> bool:
        return bool(config.get("dual_chunk_attention_config")) and "dca_trained_context" in config

    def run_as_base(self, config) -> tuple[str, object]:
        return "_attn_implementation", "sdpa"  # the base's own attention: plain RoPE positions through SDPA

    def model_info(self, config) -> dict:
        d = config.dual_chunk_attention_config
        return {"chunk_size": d["chunk_size"], "local_size": d["local_size"],
                "c_orig": d.get("original_max_position_embeddings") or 0, "trained_context": config.dca_trained_context}

    def settings_text(self, info: dict) -> str:
        return (f"DCA chunk_size={info.get('chunk_size')}, local_size={info.get('local_size')}, trained context "
                f"{info.get('trained_context')}, temperature "
                + (f"past {info['c_orig']}" if info.get("c_orig") else "off"))

    def card_body(self, config, family, finetuned: bool, **fields) -> str:
        d = config.dual_chunk_attention_config
        c_orig = d.get("original_max_position_embeddings")
        return BODY.format(
            **fields, causal_lm=family.causal_lm, module=family.module_name(self.name),
            chunk=d["chunk_size"], local=d["local_size"], s_len=d["chunk_size"] - d["local_size"],
            temperature=f"logits x (0.1 ln(L/{c_orig}) + 1)^2 past {c_orig} tokens" if c_orig else "off",
            trained=config.dca_trained_context, max_pos=config.max_position_embeddings)


BODY = """
# {name}

This is **{base}** with **Dual Chunk Attention (DCA)** (An et al., "Training-Free Long-Context Scaling of Large
Language Models", ICML 2024), converted with cca-convert. No weight was changed and nothing was trained.

DCA changes only the RoPE positions given to queries and keys: the sequence is cut into chunks of `s` tokens, a key
is rotated at its offset inside its chunk, and a query at its own offset (keys of its chunk), at `min(offset + s, C)`
(the previous chunk) or at `C` (older chunks). Every relative distance RoPE sees stays within `[0, C]`, inside what
the base was trained on, however long the input; attention stays full causal (one softmax, the base's cost and KV
cache). Inputs of up to `C + 1` tokens give exactly the base model's outputs. The model is transformers' own
`{causal_lm}`; its `dual_chunk_attention_config` uses the keys of Qwen2.5-7B/14B-Instruct-1M.

| setting | value |
| --- | --- |
| `chunk_size` `C` | {chunk} |
| `local_size` `w` | {local} |
| chunk length `s = C - w` | {s_len} |
| temperature | {temperature} |
| base trained context `c` | {trained} |
| context length (max_position_embeddings) | {max_pos} |

## Usage

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

{local_note}tokenizer = AutoTokenizer.from_pretrained("{repo}")  # the base model's tokenizer
# trust_remote_code: the model class is {module}.py (the stock class + dca_hf.py's DCA attention).
model = AutoModelForCausalLM.from_pretrained("{repo}", trust_remote_code=True, dtype="auto")
```

Requirements: `transformers>=5.17` and `torch>=2.11`; `triton` on CUDA (a fused forward kernel, written in Gluon for
prefill on Hopper GPUs with triton 3.6; elsewhere, and whenever gradients are needed, a PyTorch reference runs).
`attn_implementation="sdpa"` at load runs the base model's plain RoPE attention with the same weights, for A/B
comparisons. On CUDA, `generate()` replays each one-token decode step from a CUDA graph (captured on the first step,
with the model's norms and MLPs compiled by `torch.compile` and its linear layers run as Triton few-row products; the
first steps take seconds longer), sizes the cache once for the whole sequence where that fits in free memory, and
reads its stopping flag one step late (the output is the same).
`dca_cuda_graphs=False` at load time decodes eagerly, `dca_compile_decode=False` captures the stock code,
`dca_defer_stop_checks=False` keeps generate()'s per-step sync.

{extra}
## Recipe

The exact recipe used (`cca_recipe.yaml` in this repo):

```yaml
{recipe}```
"""
