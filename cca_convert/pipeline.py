"""The conversion pipeline: named stages run in order over one ``Job``.

convert -> load -> [baseline] -> [finetune] -> [validate] -> export -> roundtrip -> commit -> [push]

Every stage writes only inside the job's staging folder; ``commit`` moves it into place, so a run
that fails at any stage leaves nothing that looks like a finished repo.
"""

from __future__ import annotations

import errno
import gc
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import export, extend, methods, multimodal, roundtrip
from .convert import build_config, read_base_config
from .errors import CCAError
from .finetune import stage_finetune
from .finetune.trainer import latest_checkpoint
from .model_card import build_model_card
from .output_guard import check_output, data_files_of, protected_paths
from .paths import portable_text
from .preflight import stage_preflight
from .publish import stage_push
from .recipe import Recipe
from .validate.config import relative_length
from .validate.runner import stage_baseline, stage_validate


def default_device() -> str:
    """This process's GPU (``accelerate launch`` sets LOCAL_RANK per process), else the CPU."""
    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"


@dataclass
class Job:
    source: str  # as the user named it (Hub id or folder): recorded as base_model
    base_dir: Path  # local folder holding the base model's files
    output: Path
    recipe: Recipe
    overwrite: bool = False
    resume: bool = False  # continue an interrupted finetune from its last checkpoint
    force: bool = False  # go on past failed validation gates
    push_to_hub: str | None = None  # Hub repo to upload the committed output to (stage "push")
    private: bool = False
    hub_revision: str | None = None  # branch of push_to_hub
    create_pr: bool = False
    device: str = field(default_factory=lambda: default_device())  # looked up at run time (tests patch it)
    command: str | None = None  # the command line that started the run, for messages that say how to re-run it
    log: Callable[[str], None] = print
    # Filled in by the stages.
    config: Any = None
    model: Any = None
    staging: Path | None = None
    finetuned: bool = False
    card_extra: str = ""
    card_data: dict = field(default_factory=dict)
    memory_estimates: dict[str, float] = field(default_factory=dict)  # stage -> estimated peak bytes per device
    relative_lengths: set[int] = field(default_factory=set)  # validation lengths the recipe gave relative to c
    roundtrip_ids: torch.Tensor | None = None
    roundtrip_logits: torch.Tensor | None = None
    timings: dict[str, float] = field(default_factory=dict)
    validation: Any = None  # held-out data and measurements shared by the baseline and validate stages
    push_url: str | None = None

    @property
    def work_dir(self) -> Path:
        """Survives failed runs (finetune checkpoints live here); removed once the output is committed."""
        return self.output.resolve().parent / f".{self.output.name}.work"

    @property
    def method(self) -> methods.Method:
        return methods.get(self.recipe.method)

    @property
    def family(self):
        from .families import FAMILIES

        return FAMILIES[self.config.model_type]

    @property
    def dtype(self) -> torch.dtype:
        """The export dtype: the recipe's, else the base config's, else float32 (configs may omit it)."""
        dtype = self.config.dtype or "float32"
        return dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)


def stage_convert(job: Job) -> None:
    job.config = build_config(job.base_dir, job.recipe)
    c = job.config
    # validation lengths given relative to the trained context ("8c") become tokens now that c is known
    trained = job.method.trained_context(c) or read_base_config(job.base_dir).get(
        "max_position_embeddings") or c.max_position_embeddings
    job.relative_lengths = {relative_length(n, trained) for n in job.recipe.validate.context_lengths
                            if isinstance(n, str)}  # the preflight may leave out those a device cannot afford
    job.recipe = job.recipe.model_copy(update={"validate": job.recipe.validate.resolved(trained)})
    job.recipe = extend.follow(job.recipe, trained, job.log)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    job.log(f"  {c.model_type}: {c.num_hidden_layers} layers, {c.num_attention_heads}/{c.num_key_value_heads} "
            f"heads, head_dim {head_dim}; {job.method.describe(c)}")


def check_finite_weights(model, where: str) -> None:
    """Refuse a checkpoint holding NaN/inf: it would poison every later number (ppl nan, loss nan...)."""
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point():
            continue
        # In slices: a bool mask of a whole 128K-vocab embedding would be another 0.5 GB on the GPU.
        if not all(bool(torch.isfinite(part).all()) for part in tensor.detach().reshape(-1).split(1 << 24)):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CCAError(f"{where}: weight {name} holds {bad} non-finite value(s) (NaN or inf): the checkpoint is "
                           "corrupt or was saved after a diverged training run; nothing was converted")


def stage_load(job: Job) -> None:
    from . import published

    model_cls = published.family_class(job.family, job.method)
    job.model, info = multimodal.from_pretrained(model_cls, job.base_dir, config=job.config, dtype=job.dtype,
                                                 output_loading_info=True)
    if info.get("missing_keys") or info.get("mismatched_keys"):
        bad = sorted(info.get("missing_keys") or []) + [str(k) for k in info.get("mismatched_keys") or []]
        raise CCAError(f"{job.base_dir}: the weights do not fill the model (missing or mismatched: {bad[:5]})")
    part = multimodal.folder_part(job.base_dir)
    if part:  # (the preflight has read every file's header by now)
        left_out = part.left_out(export.checkpoint_tensor_names(job.base_dir))
        job.log(f"  {left_out}")
        job.card_extra = f"**Text only**: {left_out}.\n\n{job.card_extra}"
    job.model.to(job.device)
    check_finite_weights(job.model, str(job.base_dir))
    job.log(f"  {sum(p.numel() for p in job.model.parameters()) / 1e6:.1f}M parameters, {job.dtype}, on {job.device}")


def free_device_memory() -> None:
    """Drop what the freed model and the validation left in the CUDA caching allocator: the round trip's clean process
    loads its own copy of the weights on the same GPU, and a reserve kept here would stand beside it (at Llama-3.1-8B
    after a 256K validation, ~49 GB reserved + 16 GB for the reload)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stage_export(job: Job) -> None:
    folder = job.staging
    recipe = job.recipe
    if recipe.export.roundtrip:  # reference logits from the model as it is in memory
        job.roundtrip_ids = roundtrip.probe_ids(job.config.vocab_size, recipe.export.roundtrip_tokens)
        job.roundtrip_logits = roundtrip.model_logits(job.model, job.roundtrip_ids)
    if job.finetuned:
        tensors, total = iter(job.model.state_dict().items()), len(job.model.state_dict())
    else:  # weights unchanged: stream them from the base files and free the in-memory copy first
        job.model = None
        free_device_memory()
        tensors, total = export.stream_base_tensors(job.base_dir), len(export.base_tensor_names(job.base_dir))
    skip = {"lm_head.weight"} if job.config.tie_word_embeddings else set()
    try:
        shards = export.write_shards(
            tensors, folder, dtype=job.dtype, max_shard_bytes=export.parse_size(recipe.export.max_shard_size),
            total=total, skip=skip,
        )
    except Exception as exc:  # OSError(ENOSPC), or safetensors' own error type with the same words
        if getattr(exc, "errno", None) not in (errno.ENOSPC, errno.EDQUOT) and "No space left" not in str(exc):
            raise
        need = export.export_bytes(export.weight_shapes(Path(job.base_dir)), job.dtype)
        free = shutil.disk_usage(folder).free
        raise CCAError(f"the disk of {job.output.resolve().parent} filled up while writing the weights: "
                       f"{free / 2**30:.1f} GiB free, the export needs about {need / 2**30:.1f} GiB; free space or "
                       "choose another --output (nothing was written to the output folder)") from None
    job.model = None
    free_device_memory()
    job.config.save_pretrained(folder)
    dropped = export.copy_code_and_tokenizer(job.base_dir, folder, job.family, job.method,
                                             context=job.config.max_position_embeddings)
    if dropped:
        job.log(f"  warning: tokenizer_config.json's auto_map named code this export does not ship; dropped "
                f"({'; '.join(dropped)}): the tokenizer loads without remote code")
    export.write_generation_config(job.base_dir, folder, job.config)
    (folder / "cca_recipe.yaml").write_text(recipe.to_yaml())
    card = build_model_card(
        job.config, recipe, base_model=job.source, repo_name=job.output.name, finetuned=job.finetuned,
        extra=job.card_extra, card_data=job.card_data,
    )
    (folder / "README.md").write_text(portable_text(card))
    job.log(f"  {len(shards)} weight shard(s), code, tokenizer and model card written")


def stage_roundtrip(job: Job) -> None:
    atol = 1e-4 if job.dtype == torch.float32 else 2e-2
    diff = roundtrip.roundtrip_check(job.staging, job.roundtrip_ids, job.roundtrip_logits, atol, job.device)
    job.log(f"  reloaded in a clean process with trust_remote_code: max |logit diff| = {diff:.2e} (limit {atol})")


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[Job], None]
    enabled: Callable[[Job], bool] = lambda job: True
    after_commit: bool = False  # runs on the committed output folder (e.g. push)


def stage_enabled(job: Job, name: str) -> bool:
    """Whether stage ``name`` of the current STAGES list runs for ``job`` (looked up when asked: tests swap stages)."""
    stage = next((s for s in STAGES if s.name == name), None)
    return bool(stage is not None and stage.enabled(job))


STAGES: list[Stage] = [
    Stage("convert", stage_convert),
    Stage("preflight", stage_preflight),  # before any weight is loaded: every problem found at once
    Stage("load", stage_load),
    # "baseline" measures base and CCA *before* the finetune: a finetune stage goes between it and "validate".
    Stage("baseline", stage_baseline, lambda job: job.recipe.validate.enabled and stage_enabled(job, "finetune")),
    Stage("finetune", stage_finetune, lambda job: job.recipe.finetune.enabled),
    Stage("validate", stage_validate, lambda job: job.recipe.validate.enabled),
    Stage("export", stage_export),
    Stage("roundtrip", stage_roundtrip, lambda job: job.recipe.export.roundtrip),
    Stage("push", stage_push, lambda job: job.push_to_hub is not None, after_commit=True),
]


def run_job(job: Job) -> Path | None:
    """Run every enabled stage; the output folder appears only if all of them pass. Under ``accelerate launch``
    only the main process writes the output; the others take part in the stages up to the finetune."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import PartialState

        if not PartialState().is_main_process:
            return _run_worker(job)
    with export.OutputLock(job.output):
        return _run_stages(job)


def _run_worker(job: Job) -> None:
    job.log = lambda msg: None
    if not stage_enabled(job, "finetune"):
        return None  # nothing here needs more than one process
    for stage in STAGES:
        if stage.name in ("preflight", "export", "roundtrip") or stage.after_commit or not stage.enabled(job):
            continue  # output checks and writing are the main process's
        if stage.name == "finetune":
            stage.run(job)
            return None
        stage.run(job)
    return None


def drop_work_dir_without_results(job: Job) -> Path | None:
    """A failed run leaves its work folder only when it holds something to go on from: a finetune checkpoint
    (``--resume``, ``--force``) or the validation report a failed gate points to. Else (a refusal, a crash before
    the first checkpoint) nothing of the run stays beside the output. Returns the checkpoint's folder if one stays."""
    work = job.work_dir
    checkpoint = latest_checkpoint(work / "finetune")
    if work.is_dir() and checkpoint is None and not (work / "validation").exists():
        shutil.rmtree(work, ignore_errors=True)
    return checkpoint.parent if checkpoint else None


def _run_stages(job: Job) -> Path:
    check_output(job.output, job.overwrite,
                 protected_paths(job.base_dir, job.recipe.file, data_files_of(job.recipe)))
    stages = [s for s in STAGES if s.enabled(job)]
    stages = [s for s in stages if not s.after_commit] + [s for s in stages if s.after_commit]

    def run(i: int, stage: Stage) -> None:
        job.log(f"[{i}/{len(stages)}] {stage.name}")
        start = time.perf_counter()
        stage.run(job)
        job.timings[stage.name] = time.perf_counter() - start

    with export.Staging(job.output) as staging:
        job.staging = staging.path
        for folder in staging.removed:
            job.log(f"  removed {folder.name}, left beside the output by a run that was killed")
        earlier = latest_checkpoint(job.work_dir / "finetune")  # an earlier run's: a refusal must not hide it
        try:
            for i, stage in enumerate(stages, 1):
                if not stage.after_commit:
                    run(i, stage)
        except CCAError as exc:
            kept = drop_work_dir_without_results(job)
            if earlier and kept and str(kept) not in str(exc) and exc.exit_code == 2:  # say what stays, and why
                raise type(exc)(f"{exc}\nthe finetune checkpoint of an earlier run stays in {kept} (continue it "
                                "with --resume, or delete it to start over)") from None
            raise
        except BaseException:
            drop_work_dir_without_results(job)
            raise
        staging.commit()
        if staging.undeleted is not None:
            job.log(f"  warning: the replaced output could not be deleted completely; remove {staging.undeleted} by hand")
    shutil.rmtree(job.work_dir, ignore_errors=True)
    job.staging = job.output
    for i, stage in enumerate(stages, 1):
        if stage.after_commit:
            run(i, stage)
    job.log(f"done: {job.output} ({', '.join(f'{k} {v:.1f}s' for k, v in job.timings.items())})")
    return job.output


__all__ = ["Job", "Stage", "STAGES", "run_job", "CCAError"]
