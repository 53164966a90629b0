"""The finetune stage: LoRA on q/k/v (merged before export), q/k/v only, or full; resumable.

One code path for every setup: an ``accelerate.Accelerator`` drives the loop, so a plain run uses one
process (CPU or one GPU) and the same command under ``accelerate launch`` trains on several GPUs
(DDP, or FSDP for full/qkv: see ``cca_convert/finetune/accelerate_*.yaml``).

Checkpoints live in ``job.work_dir / "finetune"``: the trainable weights, the optimizer and LR
schedule, every rank's RNG state and the step; the data order is a function of the seed and the
step (see ``data.py``), so ``--resume`` replays exactly what an uninterrupted run would have done.
SIGINT/SIGTERM finish the current optimizer step, write a checkpoint and stop with a CCAError.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import multimodal
from ..errors import CCAError, first_line
from .chunked_loss import ChunkedLoss
from .config import FinetuneSection
from .data import build_sequences, describe



class FinetuneInterrupted(CCAError):
    """Training stopped on SIGINT/SIGTERM after writing a checkpoint."""

    exit_code = 130


# --------------------------------------------------------------------------------------------------
# checks that run before anything is trained


def check_seq_len(job) -> None:
    ft, config = job.recipe.finetune, job.config
    limit = config.max_position_embeddings
    if ft.seq_len > limit:
        raise CCAError(
            f"finetune.seq_len={ft.seq_len} exceeds the model's max_position_embeddings={limit} (RoPE was trained "
            f"that far): lower finetune.seq_len, or extend the context with --set extend.factor="
            f"{-(-ft.seq_len // limit)} (the exported context becomes that many times {limit}, its RoPE stretched "
            "to match)")


def load_tokenizer(job):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(job.base_dir)
    except (OSError, ValueError) as exc:
        raise CCAError(f"finetune needs the base model's tokenizer, which {job.base_dir} lacks: "
                       f"{first_line(exc)}") from None
    tok.model_max_length = int(1e30)  # documents are cut into seq_len blocks later; no length warnings
    eos = tok.eos_token_id
    if eos is None:
        eos = job.config.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    if eos is None:
        raise CCAError(f"{job.base_dir}: the tokenizer has no EOS token to separate packed documents")
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    return tok, eos, pad


# --------------------------------------------------------------------------------------------------
# model preparation


def qkv_modules(config) -> tuple[str, ...]:
    """The model's attention input projections (``qkv_proj`` for Phi-3, ``q_proj/k_proj/v_proj`` elsewhere)."""
    from ..families import FAMILIES, QKV

    family = FAMILIES.get(config.model_type)
    return family.qkv if family else QKV


def lora_targets(ft: FinetuneSection, config) -> list[str]:
    return list(ft.lora.target_modules or qkv_modules(config))


def lora_config(ft: FinetuneSection, config):
    from peft import LoraConfig

    return LoraConfig(r=ft.lora.r, lora_alpha=ft.lora.alpha, lora_dropout=ft.lora.dropout,
                      target_modules=lora_targets(ft, config), bias="none", task_type="CAUSAL_LM")


def prepare_trainable(model, ft: FinetuneSection, upcast: bool):
    """Freeze / wrap ``model`` for the method; returns the model to train (a PeftModel for LoRA)."""
    if ft.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if ft.method == "lora":
        from peft import get_peft_model

        try:
            model = get_peft_model(model, lora_config(ft, model.config))
        except ValueError as exc:
            names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
            raise CCAError(f"finetune.lora.target_modules={lora_targets(ft, model.config)}: {str(exc).splitlines()[0]} "
                           f"(linear layers of this model: {', '.join(names)})") from None
    else:
        qkv = qkv_modules(model.config)
        for name, p in model.named_parameters():
            p.requires_grad_(ft.method == "full" or any(f".{m}." in f".{name}" for m in qkv))
    if upcast:  # fp32 master copy of what is trained; compute runs under bf16 autocast
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
    model.train()
    return model


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}


# --------------------------------------------------------------------------------------------------
# checkpoints


def _fingerprint(job) -> dict:
    """What a resumed run must share with the checkpoint: the finetune's trajectory and the method's settings."""
    method = job.recipe.method
    return {"finetune": job.recipe.finetune.trajectory_dict(),
            method: getattr(job.recipe, method).model_dump(mode="json")}


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint under ``root`` (``<work_dir>/finetune``), if any: ``checkpoint``, else ``checkpoint.old``
    (which survives a crash between the two renames of ``Checkpoints.save``)."""
    for p in (root / "checkpoint", root / "checkpoint.old"):
        if (p / "state.json").is_file():
            return p
    return None


class Checkpoints:
    """``<work_dir>/finetune/checkpoint``: the last checkpoint, replaced atomically."""

    def __init__(self, root: Path, accelerator):
        self.root, self.acc = root, accelerator
        self.path, self.tmp, self.old = root / "checkpoint", root / "checkpoint.tmp", root / "checkpoint.old"
        self.fsdp = accelerator.distributed_type.value == "FSDP"

    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)

    def read_state(self, path: Path) -> dict:
        return json.loads((path / "state.json").read_text())

    def save(self, step: int, model, optimizer, scheduler, meta: dict) -> None:
        acc = self.acc
        if acc.is_main_process:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        if self.fsdp:  # sharded weights + optimizer through accelerate (RNG states included)
            acc.save_state(str(self.tmp / "accelerate"))
        else:
            torch.save(_rng_state(), self.tmp / f"rng-{acc.process_index}.pt")
            if acc.is_main_process:
                torch.save(trainable_state(acc.unwrap_model(model)), self.tmp / "trainable.pt")
                torch.save(optimizer.state_dict(), self.tmp / "optimizer.pt")
        acc.wait_for_everyone()
        if acc.is_main_process:
            torch.save(scheduler.state_dict(), self.tmp / "scheduler.pt")
            (self.tmp / "state.json").write_text(json.dumps({"step": step, **meta}, indent=1))  # written last
            shutil.rmtree(self.old, ignore_errors=True)
            if self.path.exists():
                self.path.rename(self.old)
            self.tmp.rename(self.path)
            shutil.rmtree(self.old, ignore_errors=True)
        acc.wait_for_everyone()

    def load(self, path: Path, model, optimizer, scheduler) -> None:
        acc = self.acc
        if self.fsdp:
            acc.load_state(str(path / "accelerate"))
        else:
            state = torch.load(path / "trainable.pt", map_location="cpu")
            params = dict(acc.unwrap_model(model).named_parameters())
            missing = [n for n, p in params.items() if p.requires_grad and n not in state]
            if missing or set(state) - set(params):
                raise CCAError(f"checkpoint {path} does not match this model/method "
                               f"(e.g. {(missing or sorted(set(state) - set(params)))[0]}); delete it to start over")
            with torch.no_grad():
                for n, t in state.items():
                    params[n].copy_(t)
            optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))
            _set_rng_state(torch.load(path / f"rng-{acc.process_index}.pt", weights_only=False))
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))


# --------------------------------------------------------------------------------------------------
# signals


class StopOnSignal:
    """SIGINT/SIGTERM set a flag (the loop checkpoints and stops); a second one aborts at once."""

    def __init__(self, say):
        self.signum, self.say, self.old = None, say, {}

    def _handle(self, signum, frame):
        if self.signum is not None:
            if signum == signal.SIGTERM and os.environ.get("TORCHELASTIC_RUN_ID"):
                return  # a launcher forwards each signal it gets: under one, a repeated SIGTERM is not a second request
            self.__exit__()
            raise KeyboardInterrupt
        self.signum = signum
        self.say(f"{signal.Signals(signum).name}: stopping after this optimizer step and writing a checkpoint "
                 "(send it again to abort without one)")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self.old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)
        self.old = {}


# --------------------------------------------------------------------------------------------------
# metrics


class Metrics:
    def __init__(self, root: Path, enabled: bool, tensorboard: bool, keep_until: int):
        self.path, self.enabled, self.tb = root / "metrics.jsonl", enabled, None
        if not enabled:
            return
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        kept = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", 0) <= keep_until]
        self.path.write_text("".join(ln + "\n" for ln in kept))  # drop steps the checkpoint does not have
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(root / "tensorboard"), purge_step=keep_until + 1)
            except ImportError:
                pass

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k in ("loss", "lr", "grad_norm", "tokens_per_s"):
                if record.get(k) is not None:
                    self.tb.add_scalar(f"finetune/{k}", record[k], record["step"])

    def close(self):
        if self.tb is not None:
            self.tb.close()


# --------------------------------------------------------------------------------------------------
# the stage


def _mixed_precision(ft: FinetuneSection, device: str) -> str:
    if ft.bf16 == "auto":
        on = device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    else:
        on = ft.bf16
    return "bf16" if on else "no"


@dataclass
class Run:
    """One finetune in progress: what ``prepare`` builds and ``resume``, ``loop`` and ``finish`` use."""

    job: Any
    acc: Any
    ft: FinetuneSection
    root: Path
    ckpts: Checkpoints
    log: Callable[[str], None]
    resume_from: Path | None
    finished: bool  # the checkpoint is of a completed run of this recipe: nothing to train
    data: Any = None
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    params: list = field(default_factory=list)
    use_cache: bool = True
    chunked_loss: ChunkedLoss | None = None
    start: int = 0
    meta: dict = field(default_factory=dict)


def stage_finetune(job, on_step=None) -> None:
    """Train ``job.model`` in place per ``job.recipe.finetune``; ``on_step(step, record)`` is a test hook."""
    from accelerate import Accelerator

    ft = job.recipe.finetune
    check_seq_len(job)
    tokenizer, eos_id, pad_id = load_tokenizer(job)
    acc = Accelerator(cpu=str(job.device) == "cpu", mixed_precision=_mixed_precision(ft, str(job.device)))
    run = prepare(job, acc, tokenizer, eos_id, pad_id)
    try:
        resume(run)
        loop(run, on_step)
    except BaseException:
        if run.chunked_loss is not None:  # the model goes back to its own forward, whatever happens next
            run.chunked_loss.remove()
        raise
    finish(run)


def prepare(job, acc, tokenizer, eos_id: int, pad_id: int) -> Run:
    """Checkpoint state and data first (every problem before any weight is touched), then the trainable model,
    the optimizer and transformers' LR schedule, all through ``acc.prepare``."""
    from accelerate.utils import set_seed
    from transformers import get_scheduler

    ft, main, world, rank = job.recipe.finetune, acc.is_main_process, acc.num_processes, acc.process_index
    log = job.log if main else (lambda msg: None)
    root = job.work_dir / "finetune"
    ckpts = Checkpoints(root, acc)
    resume_from = ckpts.latest()
    finished = resume_from is not None and ckpts.read_state(resume_from).get("finished", False)
    if resume_from is not None and not job.resume and not finished:
        step = ckpts.read_state(resume_from).get("step")
        raise CCAError(f"an interrupted finetune left a checkpoint (step {step}) in {root}: re-run with --resume "
                       f"to continue it, or delete that folder to start over")
    if finished:  # e.g. a re-run with --force after a failed gate: the same recipe's training is done
        log(f"  reusing the finished finetune in {resume_from} (same recipe; delete {root} to train again)")
    if job.resume and resume_from is None:
        log(f"  --resume: no finetune checkpoint in {root}; starting from step 0")
    if resume_from is not None:
        _check_resumable(ckpts.read_state(resume_from), job, world)
    run = Run(job, acc, ft, root, ckpts, log, resume_from, finished)

    run.data = None if finished else build_sequences(ft, tokenizer, eos_id, pad_id, rank, world, log)
    vocab = job.config.vocab_size
    seqs = getattr(run.data, "seqs", None)
    if seqs is not None and len(seqs) and max(int(x.max()) for x in seqs) >= vocab:
        raise CCAError(f"the tokenizer of {job.base_dir} yields ids >= the model's vocab_size={vocab}")

    set_seed(ft.seed)
    model = job.model
    run.use_cache, model.config.use_cache = model.config.use_cache, False
    if acc.distributed_type.value == "FSDP":  # FSDP flattens parameters of one dtype; its policy casts for compute
        model.float()
    run.chunked_loss = ChunkedLoss(model).install()  # no whole-sequence fp32 logits (removed in finish)
    model = prepare_trainable(model, ft, upcast=acc.mixed_precision == "bf16")
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in model.parameters())
    log(f"  method {ft.method}: {n_train / 1e6:.2f}M trainable of {n_all / 1e6:.1f}M parameters; "
        f"{world} process(es), {acc.distributed_type.value}, mixed precision {acc.mixed_precision}")

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": ft.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=ft.lr, betas=tuple(ft.adam_betas))
    run.model, run.optimizer = acc.prepare(model, optimizer)  # together: FSDP2 swaps the parameters
    run.params = [p for p in run.model.parameters() if p.requires_grad]
    name, kwargs = SCHEDULES[ft.lr_schedule](ft)
    run.scheduler = get_scheduler(name, run.optimizer, num_warmup_steps=ft.warmup_steps,
                                  num_training_steps=ft.steps, scheduler_specific_kwargs=kwargs)
    run.meta = {"fingerprint": _fingerprint(job), "world": world, "steps": ft.steps}
    return run


# recipe's lr_schedule -> transformers' get_scheduler name and its arguments (every one ends at min_lr_ratio x lr,
# except constant)
SCHEDULES = {
    "cosine": lambda ft: ("cosine_warmup_with_min_lr", {"min_lr_rate": ft.min_lr_ratio}),
    "linear": lambda ft: ("polynomial", {"lr_end": ft.lr * ft.min_lr_ratio, "power": 1.0}),
    "constant": lambda ft: ("constant_with_warmup", {}),
}


def resume(run: Run) -> None:
    """Continue from the checkpoint (weights, optimizer, schedule, RNG), or start a fresh checkpoint folder."""
    acc, ft = run.acc, run.ft
    if run.resume_from is not None:
        run.ckpts.load(run.resume_from, run.model, run.optimizer, run.scheduler)
        run.start = run.ckpts.read_state(run.resume_from)["step"]
        run.log(f"  resumed from {run.resume_from} at step {run.start}/{ft.steps}")
        return
    from accelerate.utils import set_seed

    if acc.is_main_process:
        shutil.rmtree(run.root, ignore_errors=True)
        run.root.mkdir(parents=True)
    acc.wait_for_everyone()
    set_seed(ft.seed + acc.process_index)  # dropout masks differ across ranks, the same across restarts


def loop(run: Run, on_step=None) -> None:
    """Optimizer steps from ``run.start`` to ``ft.steps``: accumulation, clipping, a non-finite check before each
    update, metrics, periodic checkpoints; SIGINT/SIGTERM checkpoint and stop."""
    from tqdm.auto import tqdm

    acc, ft, ckpts, model = run.acc, run.ft, run.ckpts, run.model
    main, world = acc.is_main_process, acc.num_processes
    metrics = Metrics(run.root, main, ft.tensorboard, keep_until=run.start)
    ga, mb = ft.gradient_accumulation_steps, ft.micro_batch_size
    run.log(f"  {ft.steps} steps x {ga} micro-batches x {mb} x {world} process(es) x {ft.seq_len} tokens, "
            f"lr {ft.lr:g} ({ft.lr_schedule}, warmup {ft.warmup_steps})")
    batches = run.data.batches(start_micro=run.start * ga) if run.data is not None else iter(())
    bar = tqdm(total=ft.steps, initial=run.start, disable=not main, unit="step", desc="  finetune", dynamic_ncols=True)
    step, first_loss, last_loss, t_begin, tokens_total = run.start, None, None, time.perf_counter(), 0
    try:
        step, first_loss, last_loss, tokens_total = _steps(run, on_step, bar, metrics, batches)
    finally:  # closed before any error is printed: the last line on stderr is the error, not the bar's frame
        bar.close()
        metrics.close()
    if step > run.start or run.resume_from is None:
        ckpts.save(step, model, run.optimizer, run.scheduler, {**run.meta, "finished": True})
    elapsed = time.perf_counter() - t_begin
    if step > run.start:
        run.log(f"  trained steps {run.start + 1}-{step}: loss {first_loss:.4f} -> {last_loss:.4f}, "
                f"{tokens_total:,} tokens in {elapsed:.1f}s ({tokens_total / max(elapsed, 1e-9):,.0f} tokens/s)")


def _steps(run: Run, on_step, bar, metrics, batches):
    """The optimizer steps (see ``loop``); returns (last step, first loss, last loss, tokens)."""
    job, acc, ft, ckpts, model = run.job, run.acc, run.ft, run.ckpts, run.model
    main, world = acc.is_main_process, acc.num_processes
    ga = ft.gradient_accumulation_steps
    step, first_loss, last_loss, tokens_total = run.start, None, None, 0
    with StopOnSignal(bar.write if main else (lambda m: None)) as stop:
        while step < ft.steps:
            if _agree(acc, stop.signum is not None):
                ckpts.save(step, model, run.optimizer, run.scheduler, run.meta)
                name = signal.Signals(stop.signum).name if stop.signum else "a signal on another rank"
                raise FinetuneInterrupted(
                    f"finetune interrupted ({name}) after step {step}/{ft.steps}; checkpoint saved in {ckpts.path}: "
                    "re-run the same command with --resume to continue")
            t0 = time.perf_counter()
            losses, n_tok = [], 0
            for i in range(ga):
                batch = {k: v.to(acc.device) for k, v in next(batches).items()}
                n_tok += int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
                sync = contextlib.nullcontext() if i == ga - 1 else acc.no_sync(model)
                with sync:
                    loss = model(**batch).loss
                    acc.backward(loss / ga)
                losses.append(loss.detach().float())
            # max_norm inf measures the norm without clipping: it is checked below either way.
            grad_norm = float(acc.clip_grad_norm_(run.params, ft.max_grad_norm or math.inf))
            loss_t = torch.stack(losses).mean()
            tok_t = torch.tensor([n_tok], device=acc.device, dtype=torch.float64)
            if world > 1:
                loss_t, tok_t = acc.reduce(loss_t, "mean"), acc.reduce(tok_t, "sum")
            loss_v, step_tokens = loss_t.item(), int(tok_t.item())
            if not (math.isfinite(loss_v) and math.isfinite(grad_norm)):  # before the update: weights stay good
                raise _non_finite(job, step + 1, loss_v, grad_norm, ckpts)
            lr = run.scheduler.get_last_lr()[0]
            run.optimizer.step()
            run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
            step += 1
            dt = time.perf_counter() - t0
            tokens_total += step_tokens
            first_loss = loss_v if first_loss is None else first_loss
            last_loss = loss_v
            record = {"step": step, "loss": loss_v, "lr": lr, "grad_norm": grad_norm,
                      "tokens": step_tokens, "tokens_per_s": step_tokens / dt, "step_time_s": dt}
            if step % ft.log_every == 0 or step == ft.steps:
                metrics.log(record)
            bar.set_postfix(loss=f"{loss_v:.4f}", tok_s=f"{step_tokens / dt:,.0f}", lr=f"{lr:.2e}", refresh=False)
            bar.update(1)
            if ft.checkpoint_every and step % ft.checkpoint_every == 0 and step < ft.steps:
                ckpts.save(step, model, run.optimizer, run.scheduler, run.meta)
            if on_step is not None:
                on_step(step, record)
    return step, first_loss, last_loss, tokens_total


def _non_finite(job, step: int, loss: float, grad_norm: float, ckpts: Checkpoints) -> CCAError:
    method = job.method
    backend = method.backend(job.config)
    if backend == "auto":
        backend = "auto (triton)" if str(job.device).startswith("cuda") else "auto (reference)"
    last = ckpts.latest()
    kept = (f"the last good checkpoint (step {ckpts.read_state(last)['step']}) is kept in {last}" if last
            else "no checkpoint had been written yet")
    return CCAError(f"finetune stopped at step {step}: loss {loss} / gradient norm {grad_norm} is not finite "
                    f"(attn_backend {backend}); {kept} and nothing was exported. Try a lower finetune.learning_rate, "
                    f"or --set {method.name}.attn_backend=reference to rule out a kernel fault")


def _agree(acc, flag: bool) -> bool:
    """True on every rank if any rank got a stop signal."""
    if acc.num_processes == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=acc.device)
    return bool(acc.reduce(t, "sum").item() > 0)


def _check_resumable(saved: dict, job, world: int) -> None:
    if saved.get("world") != world:
        raise CCAError(f"the finetune checkpoint was written by {saved.get('world')} process(es), this run has {world}: "
                       "resume with the same number (the data order depends on it)")
    old, new = saved.get("fingerprint", {}), _fingerprint(job)
    if old != new:
        diffs = []
        for section in new:
            a, b = old.get(section, {}), new[section]
            diffs += [f"{section}.{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        raise CCAError(f"--resume: the recipe changed since the checkpoint ({'; '.join(diffs[:3])}); "
                       "restore it, or delete the checkpoint folder to start over")


def as_exported(model, dtype: torch.dtype):
    """The trained model in the export's dtype, as a clean load of the export has it: parameters cast, buffers kept.
    ``model.to(dtype)`` would also cast RoPE's fp32 ``inv_freq`` (bf16 positions: the in-process validation and the
    round trip's reference logits would come from a model that the exported folder does not give)."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


def finish(run: Run) -> None:
    """Merge/unwrap the trained model into ``job.model`` and ship its metrics (rank 0). Other ranks of a
    distributed run end with ``job.model = None``: the pipeline stops there for them (rank 0 exports)."""
    job, acc, ft, model = run.job, run.acc, run.ft, run.model
    if run.chunked_loss is not None:
        run.chunked_loss.remove()
    acc.wait_for_everyone()
    fsdp = acc.distributed_type.value == "FSDP"
    full_state = acc.get_state_dict(model) if fsdp else None  # collective: every rank takes part
    if not acc.is_main_process:
        job.model = None
        return
    if fsdp:  # rebuild an unsharded copy on rank 0 from the base weights and the gathered state
        from .. import published
        from ..families import FAMILIES

        cls = published.family_class(FAMILIES[job.config.model_type], job.method)
        if (Path(job.base_dir) / "config.json").is_file():
            fresh = multimodal.from_pretrained(cls, job.base_dir, config=job.config, dtype=torch.float32)
        else:  # no base files (benchmarks): every weight comes from the gathered state anyway
            fresh = cls(job.config).float()
        if ft.method == "lora":
            from peft import get_peft_model

            fresh = get_peft_model(fresh, lora_config(ft, fresh.config))
        fresh.load_state_dict(full_state)
        trained = fresh
    else:
        trained = acc.unwrap_model(model, keep_fp32_wrapper=False)
    if ft.method == "lora":
        if ft.lora.save_adapter:
            # Embeddings are never trained here; "auto" would re-read the base config as a CCA config (a warning).
            trained.save_pretrained(str(job.staging / "adapter"), save_embedding_layers=False)
            describe_adapter(job.staging / "adapter", job, ft)
        trained = trained.merge_and_unload()
    (getattr(trained, "activation_checkpointing_disable", None) or trained.gradient_checkpointing_disable)()
    trained = as_exported(trained.to(job.device), job.dtype).eval()
    trained.config.use_cache = run.use_cache
    job.model, job.finetuned = trained, True
    root = run.root

    out = job.staging / "finetune"
    out.mkdir(parents=True, exist_ok=True)
    if (root / "metrics.jsonl").exists():
        shutil.copy2(root / "metrics.jsonl", out / "metrics.jsonl")
    if (root / "tensorboard").is_dir():
        shutil.copytree(root / "tensorboard", out / "tensorboard", dirs_exist_ok=True)
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()] if (out / "metrics.jsonl").exists() else []
    job.card_extra += _card_section(ft, records, acc.num_processes, job.config)


ADAPTER_README = """# LoRA adapter (already merged into this repo's weights)

The LoRA deltas (rank {r}, alpha {alpha:g}, on {targets}) that cca-convert's finetune trained on top of **{base}**
running CCA attention. The model in this repo's root already has them merged: load that to use the model. This
folder is for applying the same deltas to the base weights yourself (to inspect, rescale or drop them).

They were trained through CCA attention, so they belong on the base's weights inside the CCA model; on the stock
base model they give neither the base's outputs nor this model's. As peft loads them:

```python
from peft import PeftModel
from transformers import {imports}

repo = "{repo}"  # this repo's Hub id, or its local folder
model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)  # the CCA code (and the merged weights)
{base_weights}
model = PeftModel.from_pretrained(model, repo, subfolder="adapter")  # base + deltas: the merged model's outputs
```
"""


def describe_adapter(folder: Path, job, ft: FinetuneSection) -> None:
    """Replace peft's blank card with what the adapter is and how to load it, and point ``base_model_name_or_path``
    at the source's Hub id (a local source's path means nothing once the repo is pushed: it is left out)."""
    from ..export import checkpoint_tensor_names
    from ..hub import is_hub_id

    source = getattr(job, "source", None)
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    if source and is_hub_id(source):
        config["base_model_name_or_path"] = source
    else:
        config["base_model_name_or_path"] = None
        job.log(f"  note: the LoRA adapter's base_model_name_or_path is left empty: the source ({source}) is a local "
                "folder, not a Hub id")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    base = source if source and is_hub_id(source) else "BASE (the base model's Hub id or folder)"
    part = multimodal.folder_part(job.base_dir) if getattr(job, "base_dir", None) else None
    if part:  # the language model of a multimodal base, under the text model's names
        cls = job.family.causal_lm
        imports = f"AutoConfig, AutoModelForCausalLM, {cls}"
        base_weights = (f'text = AutoConfig.from_pretrained("{base}").get_text_config()  # the base\'s language model\n'
                        f'model.load_state_dict({cls}.from_pretrained("{base}", config=text, key_mapping='
                        f'{part.key_mapping(checkpoint_tensor_names(job.base_dir))!r}).state_dict())')
    else:
        imports = "AutoModelForCausalLM"
        base_weights = (f'model.load_state_dict(AutoModelForCausalLM.from_pretrained("{base}").state_dict())  '
                        "# the base's weights")
    (folder / "README.md").write_text(ADAPTER_README.format(
        r=ft.lora.r, alpha=ft.lora.alpha, targets=", ".join(lora_targets(ft, job.config)), base=base,
        imports=imports, base_weights=base_weights, repo=job.output.name if hasattr(job, "output") else "REPO"))


def _card_section(ft: FinetuneSection, records: list[dict], world: int, config) -> str:
    what = {"lora": f"LoRA (r={ft.lora.r}, alpha={ft.lora.alpha:g}) on {', '.join(lora_targets(ft, config))}, merged into "
                    "the weights" + (" (the adapter itself is in `adapter/`)" if ft.lora.save_adapter else ""),
            "qkv": "only the q/k/v projections trained (the paper's partial finetuning)",
            "full": "all parameters trained"}[ft.method]
    tokens = sum(r.get("tokens", 0) for r in records) if ft.log_every == 1 else None
    lines = ["## Finetuning", "", f"- method: {what}", f"- data: {describe(ft.data)}",
             f"- {ft.steps} optimizer steps of {ft.gradient_accumulation_steps} x {ft.micro_batch_size} x {world} "
             f"sequences of {ft.seq_len} tokens" + (f" ({tokens:,} tokens)" if tokens else ""),
             f"- learning rate {ft.lr:g}, {ft.lr_schedule} schedule, {ft.warmup_steps} warmup steps"]
    if records:
        lines.append(f"- training loss {records[0]['loss']:.4f} (step {records[0]['step']}) -> "
                     f"{records[-1]['loss']:.4f} (step {records[-1]['step']}); per-step metrics in "
                     "`finetune/metrics.jsonl`")
    return "\n".join(lines) + "\n\n"
