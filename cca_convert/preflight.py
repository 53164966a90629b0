"""Checks that run before any weight is loaded: everything that can be known about a run from its recipe,
its source files, its data and its output location is checked here, and every problem is reported at
once (one line each), so that a typo never costs the baseline evaluation of an 8B model first.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

from . import methods
from .errors import CCAError
from .export import TOKENIZER_FILES, export_bytes, weight_shapes


class Problems:
    def __init__(self):
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def check(self, fn, *args) -> None:
        """Run one check; its CCAError becomes a reported problem, and the other checks still run."""
        try:
            fn(*args)
        except CCAError as exc:
            self.errors.append(str(exc))


def read_weight_shapes(job) -> dict[str, tuple[int, ...]]:
    return weight_shapes(Path(job.base_dir))


def check_weight_shapes(job, shapes: dict) -> None:
    """Every tensor the model needs is there, with the shape the config implies."""
    from .export import check_tensor_names, model_shapes

    check_tensor_names(list(shapes), job.config, str(job.base_dir))
    for name, shape in model_shapes(job.config).items():
        if name in shapes and shapes[name] != shape:
            raise CCAError(f"{job.base_dir}: {name} has shape {list(shapes[name])} but config.json implies "
                           f"{list(shape)}: the weights do not belong to this config")


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES if name != "special_tokens_map.json")


def check_tokenizer(job) -> None:
    needs = [name for name, on in (("validation", job.recipe.validate.enabled),
                                   ("the finetune", job.recipe.finetune.enabled)) if on]
    if has_tokenizer(Path(job.base_dir)):
        return
    if needs:
        raise CCAError(f"{job.base_dir} has no tokenizer files, which {' and '.join(needs)} "
                       f"need{'s' if len(needs) == 1 else ''}: add them "
                       "(tokenizer.json, tokenizer_config.json, ...) or turn those stages off")
    if job.recipe.export.require_tokenizer:
        raise CCAError(f"{job.base_dir} has no tokenizer files: the published repo could not be used as its model card "
                       "shows; add them to the source, or --set export.require_tokenizer=false to export without one")


def check_finetune_data(job) -> None:
    ft = job.recipe.finetune
    if not ft.enabled or not ft.data.files:  # Hub datasets are checked when the stage opens them
        return
    from .finetune.data import check_first_sequence, load_documents

    if not has_tokenizer(Path(job.base_dir)):
        load_documents(ft.data)  # the missing tokenizer is reported by check_tokenizer
        return
    from .finetune.trainer import load_tokenizer

    check_first_sequence(ft, *load_tokenizer(job)[:2])


def check_validation_data(job) -> None:
    if not job.recipe.validate.enabled:
        return
    from .validate.runner import prepare

    prepare(job)  # reads and tokenizes the held-out text; checks every length has a full window


def check_output_space(job, shapes: dict) -> None:
    """The output's parent is writable and has room for the export (weights at the export dtype)."""
    parent = Path(job.output).resolve().parent
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise CCAError(f"--output {job.output}: {probe} is a file, not a folder; choose another --output")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise CCAError(f"--output {job.output}: {probe} is not writable; choose another --output")
    need = export_bytes(shapes, job.dtype)
    free = shutil.disk_usage(probe).free
    if free < need:
        raise CCAError(f"--output {job.output}: {free / 2**30:.1f} GiB free on its disk, the export needs about "
                       f"{need / 2**30:.1f} GiB; free space or choose another --output")


def _uses_reference_attention(recipe, device) -> bool:
    return methods.get(recipe.method).uses_reference_attention(recipe, device)


def _reference_memory(recipe, device) -> str | None:
    """What the method's PyTorch attention holds where it runs (``memory._reference_part``), None where kernels run."""
    return methods.get(recipe.method).reference_memory if _uses_reference_attention(recipe, device) else None


def memory_estimates(recipe, config, dtype, device, shapes: dict) -> list:
    """The peak-memory estimate per device of every memory-heavy stage ``recipe`` runs (``cca_convert.memory``)."""
    from . import memory

    shape = memory.Shape.of(config, sum(math.prod(s) for s in shapes.values()))
    cuda = str(device).startswith("cuda")
    reference = _reference_memory(recipe, device)
    out = []
    ft, v = recipe.finetune, recipe.validate
    if ft.enabled:
        out.append(memory.finetune_estimate(
            shape, method=ft.method, seq_len=ft.seq_len, micro_batch=ft.micro_batch_size,
            checkpointing=ft.gradient_checkpointing, weight_bytes=dtype.itemsize, lora_rank=ft.lora.r,
            world=_world(), fsdp=_fsdp(), reference_attention=reference, cuda=cuda))
    if v.enabled:
        out.append(memory.validate_estimate(shape, length=max(v.context_lengths), batch=v.batch_size,
                                            weight_bytes=dtype.itemsize, reference_attention=reference, cuda=cuda,
                                            generate=bool(v.tasks)))
    return out


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _fsdp() -> bool:
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")


def check_memory(job, shapes: dict) -> None:
    """Refuse, before any weight is loaded, a run whose estimated peak exceeds the device's memory; name what fits."""
    from . import memory

    estimates = memory_estimates(job.recipe, job.config, job.dtype, job.device, shapes)
    if not estimates:
        return
    budget, device = memory.device_memory(job.device)
    if _drop_unaffordable_relative_lengths(job, shapes, budget, device):
        estimates = memory_estimates(job.recipe, job.config, job.dtype, job.device, shapes)
    job.memory_estimates = {e.stage: e.total for e in estimates}
    job.log("  memory per device: " + ", ".join(f"{e.stage} ~{memory.gib(e.total)}" for e in estimates)
            + f" of {device}")
    over = [e for e in estimates if e.total > budget]
    if over:
        e = over[0]
        raise CCAError(f"memory: the {e.stage} stage needs about {memory.gib(e.total)} per device ({e.describe()}; "
                       f"GiB) but {device} has {memory.gib(budget)}; " + _what_fits(job, shapes, e.stage, budget))


def _drop_unaffordable_relative_lengths(job, shapes: dict, budget: float, device: str) -> bool:
    """Validation lengths a recipe gave relative to the trained context (``8c``: the defaults, which serve every base)
    that this device cannot afford are left out, with a note; lengths given in tokens are never dropped (the check
    refuses them instead). Returns whether any was dropped."""
    v = job.recipe.validate
    relative = getattr(job, "relative_lengths", set())
    if not v.enabled or not relative:
        return False

    def fits(n: int) -> bool:
        recipe = job.recipe.model_copy(update={"validate": v.model_copy(update={"context_lengths": [n]})})
        return all(e.total <= budget for e in memory_estimates(recipe, job.config, job.dtype, job.device, shapes)
                   if e.stage == "validate")

    dropped = [n for n in v.context_lengths if n in relative and not fits(n)]
    kept = [n for n in v.context_lengths if n not in dropped]
    if not dropped or not kept:
        return False
    job.recipe = job.recipe.model_copy(update={"validate": v.model_copy(update={"context_lengths": kept})})
    job.log(f"  note: validate.context_lengths {dropped} (given relative to the trained context) left out: one "
            f"window there needs more memory than {device} has; lengths {kept} are validated (give lengths in "
            "tokens to insist on longer ones)")
    return True


def _what_fits(job, shapes: dict, stage: str, budget: float) -> str:
    """The changes that would fit, each tried alone, as ``--set`` options (or a launcher)."""
    from . import memory

    def fits(**changes) -> bool:
        recipe = job.recipe
        for dotted, value in changes.items():
            section, key = dotted.split(".")
            recipe = recipe.model_copy(update={section: getattr(recipe, section).model_copy(update={key: value})})
        return all(e.total <= budget for e in memory_estimates(recipe, job.config, job.dtype, job.device, shapes)
                   if e.stage == stage)

    ideas = []
    if stage == "finetune":
        ft = job.recipe.finetune
        if ft.micro_batch_size > 1 and fits(**{"finetune.micro_batch_size": 1}):
            ideas.append("--set finetune.micro_batch_size=1 (raise gradient_accumulation_steps to keep the batch)")
        if not ft.gradient_checkpointing and fits(**{"finetune.gradient_checkpointing": True}):
            ideas.append("--set finetune.gradient_checkpointing=true")
        if ft.method != "lora" and fits(**{"finetune.method": "lora"}):
            ideas.append("--set finetune.method=lora")
        limit = job.config.max_position_embeddings  # check_seq_len's bound: the suggestion must pass it too
        n = next((n for n in memory.fitting_seq_lens(ft.seq_len) if n <= limit and fits(**{"finetune.seq_len": n})),
                 None)
        if n:
            ideas.append(f"--set finetune.seq_len={n}")
        if str(job.device).startswith("cuda") and ft.method != "lora" and not _fsdp():
            shape = memory.Shape.of(job.config, sum(math.prod(s) for s in shapes.values()))
            world = memory.gpus_needed(lambda w: memory.finetune_estimate(
                shape, method=ft.method, seq_len=ft.seq_len, micro_batch=ft.micro_batch_size,
                checkpointing=ft.gradient_checkpointing, weight_bytes=job.dtype.itemsize, world=w, fsdp=True), budget)
            if world:
                ideas.append(f"FSDP on {world} GPUs (the same command with --gpus {world})")
    else:
        v = job.recipe.validate
        if v.batch_size > 1 and fits(**{"validate.batch_size": 1}):
            ideas.append("--set validate.batch_size=1")
        lengths = sorted(v.context_lengths)
        limit = job.config.max_position_embeddings  # the methods' context check: the suggestion must pass it too
        kept = [n for n in lengths if n <= limit and fits(**{"validate.context_lengths": [n]})]
        if kept:
            ideas.append(f"--set 'validate.context_lengths={kept}'")
    if not str(job.device).startswith("cuda"):
        ideas.append("a GPU (this run is on the CPU" + (", where the reference attention holds an L x L score "
                                                         "matrix)" if _reference_memory(job.recipe, job.device) == "scores" else ")"))
    return ("would fit: " + "; or ".join(ideas) if ideas else "no single setting change fits: use a device with "
            "more memory") + ". Nothing was loaded or written"


def stage_preflight(job) -> None:
    start = time.perf_counter()
    problems = Problems()
    job.method.check_ranges(job, problems)
    try:
        shapes = read_weight_shapes(job)
    except CCAError as exc:
        problems.errors.append(str(exc))
    else:  # both need the headers' shapes
        before = len(problems.errors)
        problems.check(check_weight_shapes, job, shapes)
        if len(problems.errors) == before:  # weights the config does not describe have no meaningful estimate
            problems.check(check_memory, job, shapes)
        problems.check(check_output_space, job, shapes)
    from .finetune.trainer import check_seq_len

    if job.recipe.finetune.enabled:
        problems.check(check_seq_len, job)
    for fn in (check_tokenizer, check_finetune_data):
        problems.check(fn, job)
    if not problems.errors:  # tokenizing the held-out text is the slow part: only when the rest is sound
        problems.check(check_validation_data, job)
    if job.recipe.validate.enabled:
        from .validate import harness

        problems.errors += harness.problems(job.recipe.validate.lm_eval)
    for w in problems.warnings:
        job.log(f"  warning: {w}")
    if problems.errors:
        raise CCAError("\n".join(problems.errors))
    job.log(f"  recipe, weights, tokenizer, data and output checked in {time.perf_counter() - start:.1f}s")
