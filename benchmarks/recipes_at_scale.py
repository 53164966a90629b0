#!/usr/bin/env python3
"""The shipped recipes at their real shapes: does each fit one GPU, how close is the preflight's estimate, how fast
does CCA train against full attention.

For each row: the released model's config (public config.json fields, below) goes through the converter's own
``build_config`` under the shipped recipe; the preflight's memory estimate is computed from the parameter shapes
(what it reads from the weights' headers); a row over the device's memory is reported as refused, with the
preflight's reason. Otherwise random bf16 weights are built on the GPU and the real finetune stage runs
(``trainer.stage_finetune``: the recipe's method, seq_len, micro-batch, checkpointing, LoRA; random tokens instead
of the recipe's dataset, the first step left out of tokens/s), once per attention backend on the same weights.
Then the validation's scoring pass (``perplexity.window_nll``: one window of random tokens, hidden states in one
pass, logits in chunks) at each validation length, for the base's full attention and for CCA.

    python benchmarks/recipes_at_scale.py --rows llama-3.1-8b llama-3.1-8b@65536 qwen3-8b --json out.json
    python benchmarks/recipes_at_scale.py --rows llama-3.1-8b --validate-lengths 32768,131072 --steps 0
    python benchmarks/recipes_at_scale.py --tiny --device cpu    # the same code on tiny shapes (tests run this)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cca_convert.allocator import configure_allocator  # noqa: E402

configure_allocator()  # as the CLI does, before CUDA starts

import torch  # noqa: E402
import transformers  # noqa: E402

from cca_convert import memory, methods, published  # noqa: E402
from cca_convert.convert import build_config  # noqa: E402
from cca_convert.families import FAMILIES  # noqa: E402
from cca_convert.finetune import trainer  # noqa: E402
from cca_convert.preflight import memory_estimates  # noqa: E402
from cca_convert.recipe import RECIPES_DIR, load_recipe  # noqa: E402
from cca_convert.validate.perplexity import attention_backend, eval_mode, window_nll  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finetune_8b import BenchJob, stub_data  # noqa: E402

# recipe -> (family, the released model's config.json fields that set its shape)
MODELS = {
    "llama-3.1-8b": ("llama", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001, dtype="bfloat16",
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen3-8b": ("qwen3", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        dtype="bfloat16")),
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, norm_topk_prob=True, decoder_sparse_step=1,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        dtype="bfloat16")),
    "gemma3-12b": ("gemma3_text", dict(
        vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
        max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="bfloat16",
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)])),
    "qwen2.5-7b": ("qwen2", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False,
        use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        dtype="bfloat16")),
    "mistral-7b": ("mistral", dict(  # v0.3: no sliding window
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
        sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, dtype="bfloat16")),
    "olmo2-7b": ("olmo2", dict(
        vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, pad_token_id=100277, bos_token_id=None,
        eos_token_id=100257, dtype="bfloat16")),
    "llama-2-7b-32k": ("llama", dict(  # Llama-2-7B; the recipe extends it to 32K (rope_theta 500000)
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dtype="bfloat16")),
    "phi-4": ("phi3", dict(
        vocab_size=100352, hidden_size=5120, intermediate_size=17920, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=10, max_position_embeddings=16384, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 250000.0}, pad_token_id=100349, bos_token_id=100257,
        eos_token_id=100265, dtype="bfloat16")),
}
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)


def parse_row(row: str) -> tuple[str, int | None]:
    name, _, seq = row.partition("@")
    if name not in MODELS:
        raise SystemExit(f"error: unknown row {row!r}; rows: {', '.join(MODELS)} (optionally @SEQ_LEN)")
    return name, int(seq) if seq else None


def base_config(name: str, tiny: bool, folder: Path):
    family, fields = MODELS[name]
    if tiny:
        fields = {**fields, **TINY, "dtype": "float32"}
        if "layer_types" in fields:
            fields["layer_types"] = ["sliding_attention", "full_attention"]
            fields["sliding_window"] = 16
        fields.update({k: v for k, v in dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2).items()
                       if k in fields})
        fields.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    transformers.AutoConfig.for_model(family, **fields).save_pretrained(folder)
    return family


def recipe_for(name: str, seq_len: int | None, steps: int, tiny: bool):
    overrides = [f"finetune.steps={max(steps, 1)}", "finetune.checkpoint_every=0", "finetune.warmup_steps=0",
                 "finetune.gradient_accumulation_steps=1", "finetune.lora.save_adapter=false",
                 "finetune.tensorboard=false"]
    if seq_len:
        overrides.append(f"finetune.seq_len={seq_len}")
    if tiny:
        overrides += ["finetune.seq_len=96", "cca.group_size=4", "cca.local_window=16", "cca.attn_backend=reference",
                      "validate.context_lengths=[64,128]", "export.dtype=float32"]
    return load_recipe(RECIPES_DIR / f"{name}.yaml", overrides)[0]


def build_model(family: str, config, device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = published.family_class(FAMILIES[family], methods.get("cca"))(config)
    finally:
        torch.set_default_dtype(torch.float32)
    return model


def peak() -> dict:
    if not torch.cuda.is_available():
        return {}
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


def reset():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def finetune(args, recipe, model, backend: str, root: Path) -> dict:
    recipe = recipe.model_copy(update={"cca": recipe.cca.model_copy(update={"attn_backend": backend})})
    model.config.cca_attn_backend = backend
    job = BenchJob(recipe, model.config, model, args.device, root)
    job.log = lambda msg: None
    reset()
    t0 = time.perf_counter()
    trainer.stage_finetune(job)
    wall = time.perf_counter() - t0
    metrics = [json.loads(ln) for ln in (job.staging / "finetune" / "metrics.jsonl").read_text().splitlines()]
    timed = metrics[1:] or metrics
    out = {"backend": backend, "tokens_per_s": sorted(m["tokens_per_s"] for m in timed)[len(timed) // 2],
           "losses": [round(m["loss"], 4) for m in metrics], "wall_s": round(wall, 1), **peak()}
    return out, job.model


def validate(args, model, length: int, backend: str) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    reset()
    with attention_backend(model, "full" if backend == "full" else "auto"), eval_mode(model):
        t0 = time.perf_counter()
        nll, n = window_nll(model, ids)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    assert math.isfinite(nll) and n == length - 1
    return {"length": length, "backend": backend, "seconds": round(dt, 2), **peak()}


def run_row(args, row: str) -> dict:
    name, seq_len = parse_row(row)
    folder = Path(tempfile.mkdtemp(prefix="cca-scale-"))
    family = base_config(name, args.tiny, folder)
    recipe = recipe_for(name, seq_len, args.steps, args.tiny)
    config = build_config(folder, recipe)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in published.family_class(FAMILIES[family], methods.get("cca"))(config)
                  .named_parameters()}
    lengths = args.validate_lengths or [max(recipe.validate.context_lengths)]
    lengths = [n for n in lengths if n <= config.max_position_embeddings]
    estimates = {e.stage: e for e in memory_estimates(recipe, config, dtype, args.device, shapes)}
    if lengths:
        estimates["validate"] = memory.validate_estimate(
            memory.Shape.of(config, sum(math.prod(s) for s in shapes.values())), length=max(lengths), batch=1,
            weight_bytes=dtype.itemsize, cuda=args.device.startswith("cuda"),
            reference_attention="scores" if recipe.cca.attn_backend == "reference" else None)
    budget, device = (80 * 2**30, "(estimate only)") if args.estimate_only else memory.device_memory(args.device)
    ft = recipe.finetune
    out = {"row": row, "recipe": f"recipes/{name}.yaml", "family": family, "device": device,
           "params_b": sum(math.prod(s) for s in shapes.values()) / 1e9,
           "finetune": {"method": ft.method, "seq_len": ft.seq_len, "micro_batch": ft.micro_batch_size,
                        "checkpointing": ft.gradient_checkpointing},
           "estimate_gib": {k: round(e.total / 2**30, 1) for k, e in estimates.items()},
           "estimate_parts_gib": {k: {p: round(b / 2**30, 2) for p, b in e.parts.items()} for k, e in estimates.items()},
           "budget_gib": round(budget / 2**30, 1), "runs": [], "validate": []}
    print(f"{row}: {out['params_b']:.2f}B params; estimates " + ", ".join(
        f"{k} {v} GiB" for k, v in out["estimate_gib"].items()) + f" of {device}", flush=True)
    if args.estimate_only:
        return out
    if any(e.total > budget for e in estimates.values()):
        out["refused"] = "estimate over the device's memory: " + ", ".join(
            f"{k} {memory.gib(e.total)}" for k, e in estimates.items() if e.total > budget)
        print(f"  refused by the preflight: {out['refused']}", flush=True)
        return out
    t = time.perf_counter()
    model = build_model(family, config, args.device, dtype)
    print(f"  built on {args.device} in {time.perf_counter() - t:.1f}s", flush=True)
    stub_data(config.vocab_size)
    if args.steps:
        for backend in args.backends:
            try:
                run, model = finetune(args, recipe, model, backend, folder / backend)
            except torch.OutOfMemoryError as exc:
                run = {"backend": backend, "error": f"OutOfMemoryError: {str(exc)[:200]}", **peak()}
                model = None
            out["runs"].append(run)
            print(f"  finetune {backend}: {json.dumps(run)}", flush=True)
            if model is None:
                return out
        ok = [r for r in out["runs"] if "error" not in r]
        if len(ok) == 2:
            out["speedup"] = ok[0]["tokens_per_s"] / ok[1]["tokens_per_s"]
    model.eval()
    for length in lengths:
        for backend in ("full", "cca"):
            try:
                v = validate(args, model, length, backend)
            except torch.OutOfMemoryError as exc:
                v = {"length": length, "backend": backend, "error": f"OutOfMemoryError: {str(exc)[:200]}", **peak()}
            out["validate"].append(v)
            print(f"  validate {json.dumps(v)}", flush=True)
    del model
    reset()
    return out


def table(results: list[dict]) -> str:
    lines = ["| row | GPU | fits? | finetune est. / measured peak GiB (reserved) | tokens/s CCA / full | speedup | "
             "validate L: est. / measured GiB, s full / CCA |", "|---|---|---|---|---|---|---|"]
    for r in results:
        runs = {x["backend"]: x for x in r["runs"]}
        cca, full = runs.get("auto") or runs.get("triton") or runs.get("reference"), runs.get("full")
        if "refused" in r:
            fits = "refused (preflight)"
        elif any("error" in x for x in r["runs"]):
            fits = "OOM"
        else:
            fits = "yes"
        measured = max((x.get("peak_reserved_gib", 0) for x in r["runs"]), default=0)
        ft = f"{r['estimate_gib'].get('finetune', '-')} / {measured:.1f}" if r["runs"] else \
            f"{r['estimate_gib'].get('finetune', '-')} / -"
        tps = f"{cca['tokens_per_s']:,.0f} / {full['tokens_per_s']:,.0f}" if cca and full and "error" not in cca \
            and "error" not in full else "-"
        val = {}
        for v in r["validate"]:
            val.setdefault(v["length"], {})[v["backend"]] = v
        vtext = "; ".join(
            f"{n}: {r['estimate_gib'].get('validate', '-') if n == max(val) else '-'} / "
            f"{max(x.get('peak_reserved_gib', 0) for x in d.values()):.1f}, "
            + " / ".join(f"{d[b]['seconds']}" if "seconds" in d.get(b, {}) else "OOM" for b in ("full", "cca"))
            for n, d in sorted(val.items()))
        lines.append(f"| {r['row']} | {r['device'].split(' (')[0]} | {fits} | {ft} | {tps} | "
                     f"{r.get('speedup', 0):.2f}x | {vtext or '-'} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=list(MODELS), help="recipe names, optionally @SEQ_LEN")
    p.add_argument("--steps", type=int, default=3, help="finetune steps per backend (0: validation only)")
    p.add_argument("--backends", nargs="+", default=["auto", "full"])
    p.add_argument("--validate-lengths", type=lambda s: [int(x) for x in s.split(",")],
                   help="validation lengths (default: the recipe's longest)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--tiny", action="store_true", help="tiny shapes of the same families (CPU smoke test)")
    p.add_argument("--estimate-only", action="store_true",
                   help="print the preflight's estimates for --device without building anything (no GPU needed)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.tiny:
        args.backends = ["reference" if b == "auto" else b for b in args.backends]
        os.environ.setdefault("FT8B_DEVICE", args.device)
    results = []
    for row in args.rows:
        results.append(run_row(args, row))
        if args.json:
            args.json.write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                             "command": " ".join(sys.argv), "results": results}, indent=1))
    if not args.estimate_only:
        print(table(results), flush=True)


if __name__ == "__main__":
    main()
