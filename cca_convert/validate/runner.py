"""Running the validation in the pipeline (stages ``baseline`` and ``validate``); ``cca_convert.validate_command`` runs
it on an exported model (``cca-convert validate DIR_OR_REPO``)."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import methods
from ..errors import CCAError, first_line
from . import gates as gates_mod
from . import harness
from . import report as report_mod
from .config import ValidateSection
from .data import check_no_overlap, load_texts, token_stream
from .passkey import make_trials, passkey_accuracy
from .tasks import make_samples
from .tasks import score as task_score
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
    samples: dict = field(init=False)  # (task, length) -> tasks.Sample list
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
        self.samples = {(t, n): make_samples(t, self.tokenizer, n, self.stream, s.task_samples, s.seed)
                        for t in s.tasks for n in s.context_lengths}
        self.data_info = {
            "source": s.data.describe(), "files": list(s.data.files or []),
            "hub_id": None if s.data.files else s.data.dataset, "config": s.data.config,
            "split": None if s.data.files else s.data.split,
            "tokens": int(self.stream.numel()), "documents": len(texts), "overlap": "; ".join(notes),
        }

    def measure(self, model, backend: str | None, label: str, tasks: bool = True) -> dict:
        """Perplexity and passkey at every length; the tasks too unless ``tasks`` is False (the converted model
        before its finetune: the report compares the base with the final model)."""
        s = self.section
        out: dict = {"perplexity": {}, "passkey": {}}
        start = time.perf_counter()
        with attention_backend(model, backend):
            for length in s.context_lengths:
                ppl = perplexity(model, self.stream, length, s.windows, s.stride, s.batch_size)
                if not math.isfinite(ppl["ppl"]):  # whatever the gates say: no gate can judge a nan
                    method = methods.of_config(model.config)
                    used = backend or (method.backend(model.config) if method else "n/a")
                    hint = (f", or try --set {method.name}.attn_backend=reference to rule out a kernel fault"
                            if method else "")
                    raise CCAError(f"validation failed: the {label} perplexity @ {length} is not finite "
                                   f"({ppl['ppl']}, attn_backend={used}); nothing was exported. Check the weights and "
                                   f"the finetune log{hint}")
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
            if tasks:
                out.update(self.generation_checks(model, label))
        out["seconds"] = time.perf_counter() - start
        return out

    def generation_checks(self, model, label: str) -> dict:
        """The configured tasks and lm-eval run (under the caller's attention backend): ``{"tasks": ..., "lm_eval":
        ...}``, each key only when configured."""
        s, out = self.section, {}
        if s.tasks:
            out["tasks"] = self.run_tasks(model, label)
        if s.lm_eval.tasks:
            out["lm_eval"] = harness.evaluate(model, self.tokenizer, s.lm_eval)
            self.log(f"    {label:<20} lm-eval: " + "; ".join(
                f"{t} " + ", ".join(f"{k} {v:.4g}" for k, v in m.items()) for t, m in out["lm_eval"].items()))
        return out

    def run_tasks(self, model, label: str) -> dict:
        """The RULER-style tasks at every length (under the caller's attention backend): task -> length -> score."""
        out: dict = {}
        for length in self.section.context_lengths:
            cells = []
            for task in self.section.tasks:
                samples = self.samples[(task, length)]
                if not samples:
                    out.setdefault(task, {})[str(length)] = {"accuracy": None, "samples": 0, "by_depth": {},
                                                             "note": "the task's prompt does not fit in this length"}
                    cells.append(f"{task} n/a")
                    continue
                result = task_score(model, self.tokenizer, samples)
                out.setdefault(task, {})[str(length)] = result
                cells.append(f"{task} {result['accuracy']:.2f}")
            self.log(f"    {label:<20} @ {length:>6}: " + ", ".join(cells))
        return out

    def speed(self, base_model, base_backend, model, backend, method) -> dict:
        """Prefill time and peak memory per length, base against the converted model of ``method`` (results under
        "base" and the method's name)."""
        if not self.section.speed:
            return {}
        out = {}
        for length in self.section.context_lengths:
            ids = self.stream[:length]
            with attention_backend(base_model, base_backend):
                b = prefill(base_model, ids, self.section.speed_repeats)
            with attention_backend(model, backend):
                c = prefill(model, ids, self.section.speed_repeats)
            out[str(length)] = {"base": b, method.name: c}
            name = method.label
            self.log(f"    prefill @ {length:>6}: base {b['latency_s'] * 1e3:.1f} ms, "
                     f"{name} {c['latency_s'] * 1e3:.1f} ms; peak memory base {report_mod._mib(b['peak_mem_bytes'])}, "
                     f"{name} {report_mod._mib(c['peak_mem_bytes'])}")
        return out


def model_info(config, name: str, base_model: str, finetuned: bool) -> dict:
    method = methods.of_config(config)
    return {"name": name, "method": method.name, "base_model": base_model, "base_model_type": config.model_type,
            **method.model_info(config), "dtype": str(config.dtype), "finetuned": finetuned,
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
    """Before the finetune: the base model (same weights, the method's own way back to the base's attention) and the
    converted model as converted."""
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
    state.results[f"{job.method.name}_before"] = state.suite.measure(job.model, None,
                                                                     f"{job.method.label} before finetune",
                                                                     tasks=not job.recipe.finetune.enabled)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": _baseline_key(job), "results": state.results}))


def stage_validate(job) -> None:
    """After the finetune (if any): the final converted model, prefill speed, gates, report and model card section."""
    state = prepare(job)
    section = job.recipe.validate
    results = state.results
    method = job.method
    name, before = method.label, f"{method.name}_before"
    if "base" not in results:
        results["base"] = state.suite.measure(job.model, "full", "base")
    if job.finetuned:
        final = f"{method.name}_after"
        results[final] = state.suite.measure(job.model, None, f"{name} after finetune")
    elif before in results:  # the finetune stage ran but changed nothing
        final = method.name
        results[final] = results.pop(before)
        if (section.tasks or section.lm_eval.tasks) and not {"tasks", "lm_eval"} & results[final].keys():
            with attention_backend(job.model, None):  # measured before the finetune without them
                results[final].update(state.suite.generation_checks(job.model, name))
    else:
        final = method.name
        results[final] = state.suite.measure(job.model, None, name)
    speed = state.suite.speed(job.model, "full", job.model, None, method)
    gates = gates_mod.evaluate(section, results, final, name, method.trained_context(job.config))
    report = report_mod.build(
        section, results, speed, gates, final=final,
        model=model_info(job.config, job.output.name, job.source, job.finetuned), data=state.suite.data_info,
        recipe_digest=job.recipe.digest(), forced=job.force, device=job.device, timings=dict(job.timings),
        base_note=f"{job.source} as converted, before any finetune, run with its own causal attention "
                  + method.base_note,
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
    reused = "the baseline measurements" + (" and the finished finetune are" if job.recipe.finetune.enabled else
                                            " are")
    raise CCAError(f"validation gates failed: {summary}. Nothing was exported; report in {kept}/report.md. "
                   f"To export (and push) anyway, run {_with_force(job.command)} ({reused} reused), or relax the "
                   "gates in the recipe's validate: section")


def _with_force(command: str | None) -> str:
    return f"`{command} --force`" if command else "the same command with --force"
