"""The README.md model card of an exported repo (front matter through huggingface_hub)."""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from .families import FAMILIES
from .recipe import Recipe


def is_hub_id(name: str) -> bool:
    return not Path(name).exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None

_BODY = """
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


_DCA_BODY = """
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

Requirements: `transformers>=5.17` and `torch>=2.11`; `triton` on CUDA (a fused forward kernel; elsewhere, and
whenever gradients are needed, a PyTorch reference runs). `attn_implementation="sdpa"` at load runs the base model's
plain RoPE attention with the same weights, for A/B comparisons.

{extra}
## Recipe

The exact recipe used (`cca_recipe.yaml` in this repo):

```yaml
{recipe}```
"""


def retarget(readme: Path, repo_id: str) -> bool:
    """Point an exported card at the Hub repo it is pushed to: every ``from_pretrained("...")`` snippet, the title
    and the model-index name (an export names its folder until it is pushed). Returns whether the card changed."""
    if not readme.is_file():
        return False
    text = readme.read_text()
    card = ModelCard(text)
    body = re.sub(r'from_pretrained\("[^"]*"', f'from_pretrained("{repo_id}"', card.text)
    body = re.sub(r"^# .*$", f"# {repo_id}", body, count=1, flags=re.MULTILINE)
    body = body.replace(LOCAL_NOTE, "")
    if getattr(card.data, "model_name", None):
        card.data.model_name = repo_id
    new = f"---\n{card.data.to_yaml()}\n---\n{body}"
    if new != text:
        readme.write_text(new)
    return new != text


# the export's usage snippets load the folder by its name; a pushed card loads the Hub id (``retarget``)
LOCAL_NOTE = ("# (this card is in a local folder: give its path; `cca-convert push` rewrites these lines with the "
              "Hub repo id)\n")


def build_model_card(
    config, recipe: Recipe, base_model: str, repo_name: str, *, finetuned: bool = False, extra: str = "",
    card_data: dict | None = None,
) -> str:
    """Render README.md. ``extra`` is inserted before the recipe (e.g. validation results);
    ``card_data`` adds front-matter keys (e.g. ``model-index``)."""
    # base_model must be a Hub id; a local folder is only named in the text.
    on_hub = is_hub_id(base_model)
    data = ModelCardData(
        base_model=base_model if on_hub else None,
        base_model_relation="finetune" if on_hub else None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=(["dca", "dual-chunk-attention"] if recipe.method == "dca" else ["cca", "core-context-aware-attention"])
        + ["long-context", "custom_code", config.model_type],
        **(card_data or {}),
    )
    family = FAMILIES[config.model_type]
    if recipe.method == "dca":
        d = config.dual_chunk_attention_config
        c_orig = d.get("original_max_position_embeddings")
        body = _DCA_BODY.format(
            name=repo_name, base=base_model, causal_lm=family.causal_lm, module=family.module_name("dca"),
            chunk=d["chunk_size"], local=d["local_size"], s_len=d["chunk_size"] - d["local_size"],
            temperature=f"logits x (0.1 ln(L/{c_orig}) + 1)^2 past {c_orig} tokens" if c_orig else "off",
            trained=config.dca_trained_context,
            max_pos=config.max_position_embeddings, repo=repo_name, extra=extra, recipe=recipe.to_yaml(),
            local_note="" if is_hub_id(repo_name) else LOCAL_NOTE)
        return str(ModelCard(f"---\n{data.to_yaml()}\n---\n{body}"))
    trained = (
        "The attention was then adapted with a short finetune (see the recipe)."
        if finetuned
        else "No finetune was run: quality may be below the base model's until one is."
    )
    pooling_note = "one core token per KV head" if config.cca_pooling == "kv" else "one core token per query head"
    replaced = getattr(config, "cca_replaced_sliding_window", None)
    sliding = sum(t == "sliding_attention" for t in getattr(config, "layer_types", None) or [])
    layers_note = (f" (CCA also replaces the base's {replaced}-token sliding window)" if replaced else
                   f" ({sliding} sliding-window layers keep their own attention)" if sliding else "")
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope) if isinstance(rope, dict) else {}
    body = _BODY.format(
        name=repo_name,
        base=base_model,
        trained=trained,
        causal_lm=family.causal_lm,
        layers_note=layers_note,
        module=family.module,
        g=config.cca_group_size,
        s=config.cca_local_window,
        pooling=config.cca_pooling,
        pooling_note=pooling_note,
        rope_theta=rope.get("rope_theta"),
        max_pos=config.max_position_embeddings,
        repo=repo_name,
        extra=extra,
        recipe=recipe.to_yaml(),
        local_note="" if is_hub_id(repo_name) else LOCAL_NOTE,
    )
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n{body}"))
