"""Running the validation: in the pipeline (stages ``baseline`` and ``validate``) and as
``cca-convert validate DIR_OR_REPO``."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import CCAError, first_line
from . import gates as gates_mod
from . import report as report_mod
from .config import ValidateSection
from .data import check_no_overlap, load_texts, token_stream
from .passkey import make_trials, passkey_accuracy
from .perplexity import attention_backend, perplexity
from .speed import prefill

CARD_START, CARD_END = "<!-- cca-validation:start -->", "<!-- cca-validation:end -->"


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # an exported folder's config is model_type cca: noise about it
    try:
        # trust_remote_code=False: the tokenizer needs no custom code (and the folder's auto_map would prompt)
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as exc:
        raise CCAError(f"validation needs the model's tokenizer, but {folder} has none that loads "
                       f"({type(exc).__name__}: {first_line(exc)}); add tokenizer files or skip with "
                       "--set validate.enabled=false") from None
    finally:
        hf_logging.set_verbosity(level)


@dataclass
class Suite:
    """Held-out tokens and passkey prompts, prepared once; ``measure`` runs them on a model."""

    section: ValidateSection
    tokenizer: object
    finetune: dict | None = None
    log: Callable[[str], None] = print
    stream: torch.Tensor = field(init=False)
    trials: dict = field(init=False)
    data_info: dict = field(init=False)

    def __post_init__(self):
        s = self.section
        notes = check_no_overlap(s.data, self.finetune)
        longest = max(s.context_lengths)
        budget = None if s.data.files else longest * s.windows * 2  # tokens; local files are read whole
        texts = load_texts(s.data, max_chars=budget * 8 if budget else None)
        self.stream = token_stream(self.tokenizer, texts, budget)
        for length in s.context_lengths:  # fail now, not after the first model ran
            from .perplexity import select_windows

            select_windows(self.stream.numel(), length, s.windows, s.stride)
        self.trials = {n: make_trials(self.tokenizer, n, s.passkey_depths, s.passkey_trials, s.passkey_digits, s.seed)
                       for n in s.context_lengths} if s.passkey_trials else {}
        self.data_info = {
            "source": s.data.describe(), "files": list(s.data.files or []),
            "hub_id": None if s.data.files else s.data.dataset, "config": s.data.config,
            "split": None if s.data.files else s.data.split,
            "tokens": int(self.stream.numel()), "documents": len(texts), "overlap": "; ".join(notes),
        }

    def measure(self, model, backend: str | None, label: str) -> dict:
        s = self.section
        out: dict = {"perplexity": {}, "passkey": {}}
        start = time.perf_counter()
        with attention_backend(model, backend):
            for length in s.context_lengths:
                ppl = perplexity(model, self.stream, length, s.windows, s.stride, s.batch_size)
                if not math.isfinite(ppl["ppl"]):  # whatever the gates say: no gate can judge a nan
                    used = backend or getattr(model.config, "attn_backend", "auto")
                    raise CCAError(f"validation failed: the {label} perplexity @ {length} is not finite "
                                   f"({ppl['ppl']}, attn_backend={used}); nothing was exported. Check the weights and "
                                   "the finetune log, or try --set cca.attn_backend=reference to rule out a kernel fault")
                out["perplexity"][str(length)] = ppl
                msg = (f"    {label:<20} @ {length:>6}: ppl {ppl['ppl']:.3f} "
                       f"({ppl['windows']} windows, {ppl['tokens']} tokens)")
                if self.trials.get(length):
                    pk = passkey_accuracy(model, self.trials[length], s.batch_size)
                    out["passkey"][str(length)] = pk
                    msg += f", passkey {pk['correct']}/{pk['trials']}"
                elif s.passkey_trials:
                    out["passkey"][str(length)] = {"accuracy": None, "correct": 0, "trials": 0, "by_depth": {},
                                                   "note": "the passkey prompt does not fit in this length"}
                self.log(msg)
        out["seconds"] = time.perf_counter() - start
        return out

    def speed(self, base_model, base_backend, cca_model, cca_backend, name: str = "CCA") -> dict:
        """Prefill time and peak memory per length, base against the converted model (``name``: its method's label,
        CCA or DCA, in the log lines)."""
        if not self.section.speed:
            return {}
        out = {}
        for length in self.section.context_lengths:
            ids = self.stream[:length]
            with attention_backend(base_model, base_backend):
                b = prefill(base_model, ids, self.section.speed_repeats)
            with attention_backend(cca_model, cca_backend):
                c = prefill(cca_model, ids, self.section.speed_repeats)
            out[str(length)] = {"base": b, "cca": c}
            self.log(f"    prefill @ {length:>6}: base {b['latency_s'] * 1e3:.1f} ms, "
                     f"{name} {c['latency_s'] * 1e3:.1f} ms; peak memory base {report_mod._mib(b['peak_mem_bytes'])}, "
                     f"{name} {report_mod._mib(c['peak_mem_bytes'])}")
        return out


def model_info(config, name: str, base_model: str, finetuned: bool) -> dict:
    from ..families import cca_settings

    dca = getattr(config, "dual_chunk_attention_config", None)
    if dca and getattr(config, "dca_trained_context", None):
        return {"name": name, "method": "dca", "base_model": base_model, "base_model_type": config.model_type,
                "chunk_size": dca["chunk_size"], "local_size": dca["local_size"],
                "c_orig": dca.get("original_max_position_embeddings") or 0,
                "trained_context": config.dca_trained_context, "dtype": str(config.dtype), "finetuned": finetuned,
                "layers": config.num_hidden_layers, "hidden_size": config.hidden_size}
    settings = cca_settings(config)
    return {"name": name, "method": "cca", "base_model": base_model, "base_model_type": config.model_type,
            "group_size": settings["group_size"], "local_window": settings["local_window"],
            "pooling": settings["pooling"],
            "dtype": str(config.dtype), "finetuned": finetuned,
            "layers": config.num_hidden_layers, "hidden_size": config.hidden_size}


def card_section(report: dict) -> str:
    return f"{CARD_START}\n{report_mod.card_markdown(report)}{CARD_END}\n"


# ----------------------------------------------------------------------------------------------------------------------
# Pipeline stages
# ----------------------------------------------------------------------------------------------------------------------
@dataclass
class _State:
    suite: Suite
    results: dict = field(default_factory=dict)
    report: dict | None = None


def _finetune_dump(recipe) -> dict | None:
    section = getattr(recipe, "finetune", None)
    return section.model_dump(mode="json") if section is not None else None


def prepare(job) -> _State:
    """The held-out tokens and passkey prompts of this job, read and checked once (preflight calls it first)."""
    if job.validation is None:
        section = job.recipe.validate
        suite = Suite(section, load_tokenizer(job.base_dir), _finetune_dump(job.recipe), job.log)
        job.validation = _State(suite)
        job.log(f"  held-out: {suite.data_info['source']}, {suite.data_info['tokens']:,} tokens; lengths "
                f"{', '.join(map(str, section.context_lengths))}")
    return job.validation


def _baseline_key(job) -> dict:
    return {"recipe": job.recipe.digest(), "base_dir": str(Path(job.base_dir).resolve())}


def stage_baseline(job) -> None:
    """Before the finetune: the base model (same weights, attn_backend full) and the CCA model as converted."""
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:  # under `accelerate launch` only rank 0 goes on after the finetune, and validates
        job.log(f"  rank {rank}: left to rank 0")
        return
    state = prepare(job)
    cache = job.work_dir / "validation-baseline.json"
    if cache.is_file():  # an earlier run of the same recipe on the same base (interrupted, or stopped by a gate)
        saved = json.loads(cache.read_text())
        if saved.get("key") == _baseline_key(job):
            state.results.update(saved["results"])
            job.log(f"  reusing the measurements of the interrupted run ({cache})")
            return
    state.results["base"] = state.suite.measure(job.model, "full", "base")
    state.results["cca_before"] = state.suite.measure(job.model, None, "CCA before finetune")
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": _baseline_key(job), "results": state.results}))


def stage_validate(job) -> None:
    """After the finetune (if any): the final converted model, prefill speed, gates, report and model card section."""
    state = prepare(job)
    section = job.recipe.validate
    results = state.results
    name = job.method.upper()
    if "base" not in results:
        results["base"] = state.suite.measure(job.model, "full", "base")
    if job.finetuned:
        final = "cca_after"
        results[final] = state.suite.measure(job.model, None, "CCA after finetune")
    elif "cca_before" in results:  # the finetune stage ran but changed nothing
        final = "cca"
        results[final] = results.pop("cca_before")
    else:
        final = "cca"
        results[final] = state.suite.measure(job.model, None, name)
    speed = state.suite.speed(job.model, "full", job.model, None, name)
    gates = gates_mod.evaluate(section, results, final, name, getattr(job.config, "dca_trained_context", None))
    report = report_mod.build(
        section, results, speed, gates, final=final,
        model=model_info(job.config, job.output.name, job.source, job.finetuned), data=state.suite.data_info,
        recipe_digest=job.recipe.digest(), forced=job.force, device=job.device, timings=dict(job.timings),
        base_note=f"{job.source} as converted, before any finetune, run with its own causal attention "
                  + ("(the same weights with plain RoPE positions, attn_implementation=sdpa)" if name == "DCA" else
                     "(the same weights with attn_backend=full)"),
    )
    report_mod.write(report, job.staging)
    job.card_extra = (job.card_extra + "\n" if job.card_extra else "") + card_section(report)
    job.card_data["model_name"] = job.output.name
    job.card_data["eval_results"] = report_mod.eval_results(report)
    state.report = report
    bad = gates_mod.failed(gates)
    if not bad:
        job.log(f"  {'all ' + str(len(gates)) + ' gate checks passed' if gates else 'no gates configured'}; "
                "report in validation/")
        return
    summary = gates_mod.summary(gates)
    if job.force:
        job.log(f"  WARNING: validation gates failed, exporting anyway (--force): {summary}")
        return
    kept = job.work_dir / "validation"  # the staging folder goes away with the failed run
    report_mod.write(report, job.work_dir)
    raise CCAError(f"validation gates failed: {summary}. Nothing was exported; report in {kept}/report.md. "
                   f"To export (and push) anyway, run {_with_force(job.command)} (the baseline measurements "
                   "and the finished finetune are reused), or relax the gates in the recipe's validate: section")


def _with_force(command: str | None) -> str:
    return f"`{command} --force`" if command else "the same command with --force"


# ----------------------------------------------------------------------------------------------------------------------
# cca-convert validate DIR_OR_REPO
# ----------------------------------------------------------------------------------------------------------------------
def validate_parser():
    import argparse

    from ..argparsing import OneLineParser

    p = OneLineParser(
        prog="cca-convert validate",
        description="Re-run the validation (perplexity, passkey, prefill speed, gates) of an exported CCA folder "
                    "or Hub repo. On a folder, the report goes to validation-<date>-vs-<base>/ inside it, leaving the "
                    "conversion's validation/ and model card as they were (--update-card replaces them).",
        epilog="examples:\n  cca-convert validate out/tiny-cca\n"
               "  cca-convert validate user/llama-3.1-8b-cca --output val-8b --set validate.data.files=[book.txt]\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", metavar="DIR_OR_REPO", help="exported folder, or Hub repo id of an exported model")
    p.add_argument("--revision", help="Hub revision of DIR_OR_REPO")
    p.add_argument("--recipe", type=Path, help="recipe whose validate: section to use (default: the folder's "
                                               "cca_recipe.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set validate.context_lengths=[512,1024]")
    p.add_argument("--base", metavar="PATH_OR_ID",
                   help="base model to compare with (default: the same weights with attn_backend=full)")
    p.add_argument("--output", type=Path, help="where validation/ goes (default: the folder itself; for a Hub "
                                               "repo ./<name>-validation)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--update-card", action="store_true",
                   help="replace the folder's validation/ report and the model card's table with this run's (by "
                        "default a re-run writes validation-<date>-vs-<base>/ beside them and changes nothing else)")
    return p


def _recipe_for(folder: Path, args, repo_id: str | None):
    import tempfile

    from ..recipe import load_recipe

    path = args.recipe
    if path is None and (folder / "cca_recipe.yaml").is_file():
        path = folder / "cca_recipe.yaml"
    if path is None and repo_id is not None:
        try:
            import huggingface_hub

            path = Path(huggingface_hub.hf_hub_download(repo_id, "cca_recipe.yaml", revision=args.revision))
        except Exception:
            path = None
    if path is None:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write("{}\n")
        try:
            return load_recipe(Path(f.name), args.overrides)[0]
        finally:
            Path(f.name).unlink()
    return load_recipe(path, args.overrides)[0]


def load_cca_model(folder: Path, device: str):
    from .. import published

    from transformers import AutoConfig

    from ..families import family_of

    raw = json.loads((folder / "config.json").read_text())
    method = "dca" if raw.get("dual_chunk_attention_config") and "dca_trained_context" in raw else "cca"
    if raw.get("model_type") == "cca":  # exported by cca-convert's first releases
        config = published.load("configuration_cca").CCAConfig.from_pretrained(folder)
        model_cls = published.load("modeling_cca").CCAForCausalLM
    else:
        try:
            model_cls = published.family_class(family_of(raw), method)
        except ValueError as exc:
            raise CCAError(f"{folder}: {exc}") from None
        config = AutoConfig.from_pretrained(folder)
    return model_cls.from_pretrained(folder, config=config, dtype=config.dtype).to(device).eval()


def update_card(readme: Path, report: dict) -> None:
    """Replace the validation section and the model-index of an exported README.md."""
    from huggingface_hub import ModelCard

    text = readme.read_text()
    section = card_section(report)
    if CARD_START in text and CARD_END in text:
        head, rest = text.split(CARD_START, 1)
        text = head + section.rstrip("\n") + rest.split(CARD_END, 1)[1]
    elif "\n## Recipe" in text:
        text = text.replace("\n## Recipe", "\n" + section + "\n## Recipe", 1)
    else:
        text += "\n" + section
    card = ModelCard(text)
    card.data.eval_results = report_mod.eval_results(report)
    card.data.model_name = report["model"]["name"]
    from ..paths import portable_text

    readme.write_text(portable_text(str(card)))


def run_validate(argv: list[str]) -> int:
    from ..hub import resolve_source

    args = validate_parser().parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    local = Path(args.target).expanduser()
    repo_id = None if local.is_dir() else args.target
    folder = resolve_source(args.target, args.revision)
    if not (folder / "config.json").is_file():
        raise CCAError(f"{args.target} has no config.json: pass an exported CCA folder")
    raw = json.loads((folder / "config.json").read_text())
    is_dca = bool(raw.get("dual_chunk_attention_config")) and "dca_trained_context" in raw
    if raw.get("model_type") != "cca" and "cca_group_size" not in raw and not is_dca:
        raise CCAError(f"{args.target} is not a converted model (its config.json has neither cca_* settings nor a "
                       "dual_chunk_attention_config from cca-convert): convert it first")
    from ..export import weight_shapes

    weight_shapes(folder)  # a truncated or corrupt shard is named first, before any setting or text is read
    output = args.output or (local if repo_id is None else Path(f"{args.target.split('/')[-1]}-validation"))
    recipe = _recipe_for(folder, args, repo_id)
    raw_config = json.loads((folder / "config.json").read_text())
    section = recipe.validate.resolved(raw_config.get("dca_trained_context") or raw_config["max_position_embeddings"])

    config = json.loads((folder / "config.json").read_text())
    context = config.get("max_position_embeddings")
    beyond = [n for n in section.context_lengths if context and n > context]
    if beyond:
        raise CCAError(f"validate.context_lengths {beyond} exceed the model's context (max_position_embeddings="
                       f"{context}); drop them with --set validate.context_lengths=[...]")
    base_folder = resolve_source(args.base) if args.base else None
    base_ctx = json.loads((base_folder / "config.json").read_text()).get("max_position_embeddings") if base_folder else None
    if base_ctx and any(n > base_ctx for n in section.context_lengths):
        print(f"warning: validate.context_lengths go past the base model's own context ({base_ctx}): its perplexity "
              "there is out of its trained range")
    tokenizer = load_tokenizer(folder)
    suite = Suite(section, tokenizer, _finetune_dump(recipe), print)
    print(f"held-out: {suite.data_info['source']}, {suite.data_info['tokens']:,} tokens; lengths "
          f"{', '.join(map(str, section.context_lengths))}; device {device}")
    model = load_cca_model(folder, device)
    readme = folder / "README.md"
    previous = report_mod.read(folder) or {}
    finetuned = bool(previous.get("model", {}).get("finetuned")) or (
        readme.is_file() and "adapted with a short finetune" in readme.read_text())
    base_name = args.base or "same weights, attn_backend=full"
    results = {}
    if args.base:
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=model.dtype).to(device).eval()
        results["base"] = suite.measure(base, None, "base")
        base_backend = None
    else:
        base, base_backend = model, "full"
        results["base"] = suite.measure(model, "full", "base")
    name = "DCA" if is_dca else "CCA"
    results["cca"] = suite.measure(model, None, name)
    speed = suite.speed(base, base_backend, model, None, name)
    gates = gates_mod.evaluate(section, results, "cca", name, raw.get("dca_trained_context"))
    name = repo_id or local.resolve().name
    report = report_mod.build(
        section, results, speed, gates, final="cca", model=model_info(model.config, name, base_name, finetuned),
        data=suite.data_info, recipe_digest=recipe.digest(), forced=False, device=device,
        base_note=f"{args.base} (--base)" if args.base else "this model's own weights with plain causal attention "
                  + ("(attn_implementation=sdpa: plain RoPE positions)" if is_dca else "(attn_backend=full)")
                  + "; after a finetune these are the finetuned weights, pass --base for the original",
    )
    in_place = repo_id is None and output.resolve() == local.resolve()
    if in_place and not args.update_card:
        # the conversion's report (and the card's table, "measured before upload") stay as they were: a re-run
        # writes beside them, named by its date and its base
        from datetime import datetime, timezone

        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        against = Path(args.base.rstrip("/")).name if args.base else "full-attention"
        out = report_mod.write(report, output, f"validation-{stamp}-vs-{against}")
    else:
        out = report_mod.write(report, output)
        if in_place and readme.is_file():
            update_card(readme, report)
    print(f"report: {out / 'report.md'}")
    if gates_mod.failed(gates):
        print(f"validation gates FAILED: {gates_mod.summary(gates)}")
        return 1
    print("all gates passed")
    return 0
