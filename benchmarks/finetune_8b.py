#!/usr/bin/env python3
"""Finetune throughput and memory at scale: LoRA on q/k/v of a Llama-3.1-8B-shaped CCA model.

Random bf16 weights are built directly on the GPU (no download) and the data are random tokens made in
memory (no tokenizer, no ``datasets``); everything else is the real finetune stage
(``cca_convert.finetune.trainer.stage_finetune``: Accelerator, LoRA via peft, gradient checkpointing,
AdamW, clipping, metrics, final checkpoint, merge). Each backend runs in the same process on the same
weights; the first optimizer step (Triton compilation and autotuning) is left out of tokens/s.

    python benchmarks/finetune_8b.py                       # 8B, seq 32768, CCA (auto=Triton) vs full (SDPA)
    python benchmarks/finetune_8b.py --seq-len 16384 --steps 3 --backends auto
    # multi-GPU smoke tests of the same stage (tiny model): DDP with an interrupted + resumed run, FSDP:
    accelerate launch --num_processes 2 benchmarks/finetune_8b.py --resume-check
    accelerate launch --num_processes 2 --use_fsdp --fsdp_version 2 --mixed_precision bf16 \\
        --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer \\
        --fsdp_state_dict_type FULL_STATE_DICT benchmarks/finetune_8b.py --tiny --method qkv
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

from cca_convert import methods, published
from cca_convert.errors import CCAError
from cca_convert.families import FAMILIES
from cca_convert.finetune import trainer
from cca_convert.recipe import Recipe

LLAMA31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=128000, eos_token_id=128001,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
TINY = dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=8192, eos_token_id=1)


def _device() -> str:
    return os.environ.get("FT8B_DEVICE") or f"cuda:{os.environ.get('LOCAL_RANK', '0')}"


class BenchJob:
    """The fields of ``pipeline.Job`` that the finetune stage uses."""

    def __init__(self, recipe, config, model, device, root: Path, resume=False):
        self.recipe, self.config, self.model, self.device, self.resume = recipe, config, model, device, resume
        self.base_dir, self.output = root / "base", root / "out"
        self.staging = root / "staging"
        self.staging.mkdir(parents=True, exist_ok=True)
        self.finetuned, self.card_extra, self.card_data = False, "", {}
        self.log = print if int(os.environ.get("RANK", "0")) == 0 else (lambda m: None)

    @property
    def work_dir(self) -> Path:
        return self.output.parent / ".out.work"

    @property
    def dtype(self):
        return torch.bfloat16

    @property
    def method(self):
        return methods.get(self.recipe.method)


class RandomTokens:
    """Deterministic random blocks: micro-batch m of rank r is a function of (seed, m, r)."""

    seqs = None

    def __init__(self, vocab, seq_len, bsz, rank, world, seed):
        self.vocab, self.seq_len, self.bsz, self.rank, self.world, self.seed = vocab, seq_len, bsz, rank, world, seed

    def batches(self, start_micro=0):
        m = start_micro
        while True:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + m * self.world + self.rank)
            ids = torch.randint(0, self.vocab, (self.bsz, self.seq_len), generator=g)
            yield {"input_ids": ids, "labels": ids.clone()}
            m += 1


def stub_data(vocab):
    trainer.load_tokenizer = lambda job: (None, 1, 1)
    trainer.build_sequences = lambda ft, tok, eos, pad, rank, world, log: RandomTokens(
        vocab, ft.seq_len, ft.micro_batch_size, rank, world, ft.seed)


def build_model(shape: dict, device: str, backend: str):
    """The exported class (stock LlamaForCausalLM + CCAModelMixin) with the CLI's CCA settings, random weights."""
    config = transformers.LlamaConfig(**shape, use_cache=False, dtype="bfloat16")
    config.cca_group_size, config.cca_local_window, config.cca_pooling = 16, 1024, "kv"
    config.cca_attn_backend = backend
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = published.family_class(FAMILIES["llama"], methods.get("cca"))(config)
    finally:
        torch.set_default_dtype(torch.float32)
    return model


def recipe_for(args, backend):
    return Recipe.model_validate({
        "cca": {"group_size": 16, "local_window": 1024, "attn_backend": backend},
        "finetune": {"enabled": True, "method": args.method, "data": {"dataset": "random-tokens"},
                     "seq_len": args.seq_len, "micro_batch_size": 1, "gradient_accumulation_steps": args.ga,
                     "steps": args.steps, "learning_rate": 1e-4, "warmup_steps": 0, "bf16": True,
                     "gradient_checkpointing": True, "checkpoint_every": 0,
                     "lora": {"r": 16, "alpha": 32, "save_adapter": False}},
    })


def run_one(args, model, backend, root: Path, resume=False, on_step=None):
    device = _device()
    model.config.cca_attn_backend = backend
    job = BenchJob(recipe_for(args, backend), model.config, model, device, root, resume=resume)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.stage_finetune(job, on_step=on_step)
    if job.model is None:  # a non-main rank of a distributed run: rank 0 has the model and the metrics
        raise SystemExit(0)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    metrics = [json.loads(ln) for ln in (job.staging / "finetune" / "metrics.jsonl").read_text().splitlines()]
    return job, metrics, wall


def _print_step(step, record):
    """Each step as it ends (a run cut short by a time limit still shows its steps)."""
    print(json.dumps({**record, "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}), flush=True)


def summarize(backend, metrics, wall):
    timed = metrics[1:] or metrics
    return {
        "backend": backend,
        "losses": [round(m["loss"], 4) for m in metrics],
        "step_time_s": [round(m["step_time_s"], 3) for m in metrics],
        "tokens_per_s_median_after_step1": statistics.median(m["tokens_per_s"] for m in timed),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "stage_wall_s": wall,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--ga", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--method", default="lora", choices=["lora", "qkv", "full"])
    p.add_argument("--backends", nargs="+", default=["auto", "full"])
    p.add_argument("--tiny", action="store_true", help="small model (multi-GPU smoke test)")
    p.add_argument("--resume-check", action="store_true",
                   help="instead: tiny model, SIGTERM on rank 0 at step 2, resume, compare with a straight run")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--no-checkpoint", action="store_true",
                   help="shortcut, labelled in the output: skip writing the final checkpoint (an 8B full finetune's "
                        "is ~96 GB of weights + AdamW state; it is not part of tokens/s)")
    args = p.parse_args()
    if args.no_checkpoint:
        trainer.Checkpoints.save = lambda self, *a, **k: None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        args.backends = args.backends[:1]  # ranks > 0 leave after each run: one run per launch
    if args.tiny:
        args.seq_len, args.steps, args.ga = min(args.seq_len, 2048), max(args.steps, 4), 2
    shape = TINY if args.tiny else LLAMA31_8B
    stub_data(shape["vocab_size"])
    device = _device()
    torch.cuda.set_device(device)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    results = {"gpu": torch.cuda.get_device_name(), "seq_len": args.seq_len, "method": args.method,
               "final_checkpoint": "skipped (--no-checkpoint)" if args.no_checkpoint else "written",
               "world": int(os.environ.get("WORLD_SIZE", "1")), "shape": "tiny" if args.tiny else "llama-3.1-8b",
               "runs": []}
    root = Path(os.environ.get("FT8B_ROOT", "/tmp/ft8b-shared"))  # same path on every rank (one host)
    if rank0:
        shutil.rmtree(root, ignore_errors=True)
    t = time.perf_counter()
    model = build_model(shape, device, args.backends[0])
    if rank0:
        print(f"built {sum(x.numel() for x in model.parameters()) / 1e9:.2f}B-parameter model in "
              f"{time.perf_counter() - t:.1f}s on {device}", flush=True)
    from cca_convert.preflight import memory_estimates

    estimates = memory_estimates(recipe_for(args, args.backends[0]), model.config, torch.bfloat16, device,
                                 {n: tuple(p.shape) for n, p in model.named_parameters()})
    results["estimate_gib"] = {e.stage: round(e.total / 2**30, 1) for e in estimates}
    if rank0:
        print(f"preflight estimate per device: {results['estimate_gib']} (allocator: "
              f"{os.environ.get('PYTORCH_ALLOC_CONF') or os.environ.get('PYTORCH_CUDA_ALLOC_CONF') or 'default'})",
              flush=True)
    for backend in args.backends:
        try:
            job, metrics, wall = run_one(args, model, backend, root / backend, on_step=_print_step if rank0 else None)
        except SystemExit:
            raise  # non-zero ranks leave after training (rank 0 exports)
        except Exception as exc:  # OOM, a kernel failure: record it and go on with the next backend
            results["runs"].append({"backend": backend, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(json.dumps(results["runs"][-1]), flush=True)
            import traceback

            traceback.print_exc()
            gc.collect()
            torch.cuda.empty_cache()
            continue
        model = job.model  # merged (LoRA) weights, reused by the next backend
        gc.collect()
        torch.cuda.empty_cache()
        summary = summarize(backend, metrics, wall)
        results["runs"].append(summary)
        print(json.dumps(summary), flush=True)
    ok = [r for r in results["runs"] if "error" not in r]
    if len(ok) == 2:
        results["speedup_tokens_per_s"] = ok[0]["tokens_per_s_median_after_step1"] / ok[1]["tokens_per_s_median_after_step1"]
        print(f"speedup {ok[0]['backend']} vs {ok[1]['backend']}: {results['speedup_tokens_per_s']:.2f}x", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def resume_check():
    """Multi-process: an uninterrupted run vs one stopped by SIGTERM after step 2 and resumed."""
    args = argparse.Namespace(seq_len=1024, steps=4, ga=2, method=os.environ.get("FT_METHOD", "lora"))
    stub_data(TINY["vocab_size"])
    device = _device()
    torch.cuda.set_device(device)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    root = Path("/tmp/ft8b-resume")
    if rank0:
        shutil.rmtree(root, ignore_errors=True)
    out = {}
    for name in ("straight", "interrupted", "resumed"):
        model = build_model(TINY, device, "auto")

        def stop_at_2(step, record):
            if step == 2 and rank0:  # only rank 0 gets the signal: the ranks must agree to stop
                os.kill(os.getpid(), signal.SIGTERM)

        try:
            _, metrics, _ = run_one(args, model, "auto", root / ("a" if name == "straight" else "b"),
                                    resume=name == "resumed", on_step=stop_at_2 if name == "interrupted" else None)
            out[name] = [m["loss"] for m in metrics]
        except trainer.FinetuneInterrupted as exc:
            out[name] = str(exc)
        except SystemExit:
            out[name] = "rank exited after training"
            if name == "resumed":
                raise
        if name != "resumed" and torch.distributed.is_initialized():
            torch.distributed.barrier()
    if rank0:
        print(json.dumps(out), flush=True)
        same = out["straight"] == out["resumed"]
        diff = max(abs(a - b) for a, b in zip(out["straight"], out["resumed"]))
        print(f"resume check: losses identical={same}, max |diff|={diff:.3g}", flush=True)


if __name__ == "__main__":
    try:
        resume_check() if "--resume-check" in sys.argv else main()
    except CCAError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2)
