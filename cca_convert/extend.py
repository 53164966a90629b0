"""Context extension as one recipe key: ``extend.factor: N`` makes the exported context N x c (c: the base's trained
context, its ``max_position_embeddings``).

A method that finetunes (CCA) gets its RoPE stretched so that N x c positions look like the c it was trained on, then
adapts during the finetune: ``rope: theta`` raises the RoPE base by NTK-aware scaling, theta x N^(d/(d-2)) (the CCA
paper extends Llama-2 to 32K by a larger theta); ``rope: yarn`` asks transformers for YaRN with factor N where the
family's config takes it. A training-free method (DCA) keeps its RoPE: re-indexing positions inside c is what it does,
so only the claimed context changes. The finetune's ``seq_len`` becomes N x c and the validation adds c and N x c to
its lengths, unless ``--set`` gives them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .errors import CCAError
from .schema import Section

STRETCHABLE = ("default", "linear", "llama3")  # RoPE types whose base theta is the whole story of the frequencies


class ExtendSection(Section):
    factor: float = Field(1.0, ge=1, le=64, description="exported context = factor x the base's trained context c "
                                                        "(1: keep c)")
    rope: Literal["theta", "yarn"] = Field("theta", description="how a finetuned method's RoPE is stretched: theta "
                                                                "(NTK-aware base scaling) or yarn (transformers' YaRN)")


def context(factor: float, trained: int) -> int:
    return int(round(factor * trained))


def _rope_parameters(config) -> tuple[dict, dict]:
    """(the whole rope_parameters, the dict of the layers whose attention the method replaces)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma 3): the full attention layers
        rope["full_attention"] = dict(rope["full_attention"])
        return rope, rope["full_attention"]
    return rope, rope


def apply(config, recipe, method, trained: int) -> dict | None:
    """Stretch a converted config to ``factor`` x ``trained`` (in place); returns what it did, for the card and the
    config (``context_extension``), or None when the factor is 1."""
    ext = recipe.extend
    if ext.factor == 1:
        return None
    where = recipe.where("extend", "factor")
    section = method.settings(recipe)
    clashing = [k for k in ("rope_theta", "max_position_embeddings") if getattr(section, k, None) is not None]
    if clashing:
        raise CCAError(f"{where}: extend.factor sets the context and the RoPE itself; drop "
                       + " and ".join(f"{method.name}.{k}" for k in clashing) + " (or extend.factor)")
    target = context(ext.factor, trained)
    rope, layer_rope = _rope_parameters(config)
    kind = layer_rope.get("rope_type", "default")
    done = {"trained_context": trained, "factor": ext.factor, "context": target, "rope": None}
    if not method.training_free:  # the finetune adapts the model to stretched positions
        if ext.rope == "theta":
            if kind not in STRETCHABLE:
                raise CCAError(f"{where}: the base's RoPE is {kind!r}, whose frequencies are not one theta: use "
                               "--set extend.rope=yarn, or extend without cca-convert")
            theta = float(layer_rope.get("rope_theta") or getattr(config, "rope_theta", 10000.0))
            dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
            dim = int(dim * float(layer_rope.get("partial_rotary_factor", 1.0)))
            new = theta * ext.factor ** (dim / (dim - 2))
            layer_rope["rope_theta"] = new
            done["rope"] = {"type": "theta", "rope_theta_before": theta, "rope_theta": new}
        else:
            if kind not in ("default", "linear"):
                raise CCAError(f"{where}: extend.rope=yarn replaces the RoPE type, and the base's is {kind!r} (its "
                               "own scaling would be lost): use --set extend.rope=theta")
            layer_rope.update(rope_type="yarn", factor=float(ext.factor), original_max_position_embeddings=trained)
            done["rope"] = {"type": "yarn", "factor": float(ext.factor), "original_max_position_embeddings": trained}
        config.rope_parameters = rope
    elif kind not in STRETCHABLE:
        # a training-free method keeps the RoPE, whose yarn/longrope tables read max_position_embeddings
        raise CCAError(f"{where}: the base's RoPE is {kind!r}, which derives its scaling from the context: raising "
                       "the context would change it")
    config.max_position_embeddings = target
    config.context_extension = done
    return done


def follow(recipe, trained: int, log=print):
    """The recipe with the finetune's seq_len and the validation lengths following the extended context (a copy),
    except where ``--set`` gave them."""
    ext = recipe.extend
    if ext.factor == 1:
        return recipe
    target = context(ext.factor, trained)

    def given(*loc):
        return recipe.where(*loc).startswith("--set")

    update = {}
    if recipe.finetune.enabled and not given("finetune", "seq_len") and recipe.finetune.seq_len != target:
        update["finetune"] = recipe.finetune.model_copy(update={"seq_len": target})
        log(f"  extend x{ext.factor:g}: finetune.seq_len {recipe.finetune.seq_len} -> {target}")
    lengths = recipe.validate.context_lengths
    if recipe.validate.enabled and not given("validate", "context_lengths"):
        more = [n for n in (trained, target) if n not in lengths]
        past = [n for n in lengths if n > target]  # e.g. DCA's 8c with factor 2: past the exported context
        if more or past:
            new = sorted((set(lengths) - set(past)) | set(more))
            update["validate"] = recipe.validate.model_copy(update={"context_lengths": new})
            log(f"  extend x{ext.factor:g}: validate.context_lengths "
                + ", ".join(([f"+ {more}"] if more else []) + ([f"- {past} (past {target})"] if past else [])))
    return recipe.model_copy(update=update) if update else recipe


def card_line(config) -> str | None:
    done = getattr(config, "context_extension", None)
    if not done:
        return None
    rope = done.get("rope") or {}
    how = ("RoPE theta {rope_theta_before:,.0f} -> {rope_theta:,.0f} (NTK-aware)".format(**rope)
           if rope.get("type") == "theta" else f"YaRN factor {rope['factor']:g}" if rope.get("type") == "yarn"
           else "RoPE unchanged (the method keeps positions inside the trained context)")
    return (f"trained context {done['trained_context']:,} tokens, extended x{done['factor']:g} to "
            f"{done['context']:,} ({how})")
