"""The benchmarks: what each measures, the command that reproduces the README's figures, and how it is verified
without a GPU. ``python benchmarks/run.py NAME`` runs one and keeps its record; ``benchmarks/results/INDEX.md`` is
generated from this table and the records (``python benchmarks/run.py --index``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str  # benchmarks/<script>
    measures: str
    command: str  # the arguments of the run the README quotes (after the script)
    verify: str  # how its code path is checked without a GPU (a test, or a smoke command)
    gpu: bool = True  # needs a CUDA GPU for its real run
    prefixes: tuple[str, ...] = ()  # earlier result files of this benchmark in benchmarks/results/ (names start so)


BENCHMARKS = {b.name: b for b in (
    Benchmark("attention", "attention.py", "CCA attention kernels (Triton) vs causal SDPA (cuDNN, flash) and the "
              "PyTorch reference: forward and forward+backward time, TFLOP/s, 4K-128K, Llama-3.1-8B heads",
              "--out benchmarks/results", "tests/test_benchmarks.py (the authors' path, medians, refusals); the "
              "kernels' correctness: tests/kernels/test_cca_triton.py", prefixes=("attention",)),
    Benchmark("dca", "dca.py", "DCA attention (fused Triton; Gluon on Hopper) vs causal SDPA and a three-call merge: "
              "prefill time and per-layer decode time inside CUDA graphs (batches: --decode-batches; tile configs: --decode-sweep); "
              "with --model, whole-model generate() decode", "--out benchmarks/results",
              "tests/kernels/test_dca_triton.py (kernels == reference)", prefixes=("dca",)),
    Benchmark("dca_defaults", "dca_defaults.py", "DCA settings chosen by measurement: ppl growth c..8c and passkey "
              "for four (C, w) choices x temperature off/on, on prose, pass-key and code bases (trains them first)",
              "--out benchmarks/results", "tests/test_benchmarks.py (a tiny base on the CPU)"),
    Benchmark("serve", "serve.py", "the exports served over HTTP (cca-convert serve) vs the stock model under "
              "transformers serve, eager and --compile: time to first token, decode tokens/s, latency at 32K prompts",
              "--out benchmarks/results", "tests/test_benchmarks.py (--smoke on the CPU); tests/test_serve.py"),
    Benchmark("decode", "decode.py", "ms/token inside one real generate() after a real prefill: exported CCA and DCA "
              "models vs full attention (stock eager, stock static-cache compiled, and on this package's kernels), "
              "Llama-3.1-8B shape",
              "--out benchmarks/results", "tests/test_benchmarks.py (--smoke on the CPU)", prefixes=("decode",)),
    Benchmark("decode_synthetic", "decode_synthetic.py", "decode step of the first releases' model class on synthetic "
              "caches: one layer and whole model, memory at 128K (secondary: decode.py is what users run)",
              "--out benchmarks/results/decode-h200", "none on the CPU (CUDA only)"),
    Benchmark("decode_profile", "decode_profile.py", "torch.profiler over one eager one-token step: kernels per step "
              "and GPU time by kernel", "--context 32768", "none on the CPU (CUDA only)"),
    Benchmark("dca_decode_profile", "dca_decode_profile.py", "DCA decode: the wrapper, the kernel launch alone, and "
              "the profiler's CPU vs CUDA totals", "", "none on the CPU (CUDA only)"),
    Benchmark("generate_profile", "generate_profile.py", "where a decode step's GPU time goes inside a real "
              "generate(): wall time, busy time, kernels by name", "--context 32768 --backend cca",
              "python benchmarks/generate_profile.py --smoke --device cpu --context 64",
              prefixes=("generate-profile",)),
    Benchmark("prefill", "prefill.py", "whole-model prefill, one pass and in chunks: exported CCA model vs stock "
              "full attention, time and peak memory", "--out benchmarks/results",
              "tests/test_benchmarks.py (--smoke on the CPU)", prefixes=("prefill",)),
    Benchmark("skinny_rows", "skinny_rows.py", "the Triton few-row products vs cuBLAS, 1-16 rows, Llama-3.1-8B "
              "shapes, inside a CUDA graph", "", "tests/kernels/test_skinny_triton.py (products == torch)"),
    Benchmark("sliding_window", "sliding_window.py", "a kept sliding-window layer's attention (Gemma-3-12B local "
              "layer): by blocks past 4 windows, as exported, vs transformers' one masked call; fwd and fwd+bwd",
              "--out benchmarks/results", "tests/test_benchmarks.py (CPU; outputs and gradients equal)",
              prefixes=("sliding_window",)),
    Benchmark("speculative", "speculative.py", "prompt-lookup decoding vs greedy in real generate(): ms/token and "
              "whether the tokens equal greedy's", "--out benchmarks/results",
              "tests/test_benchmarks.py (tiny model on the CPU)", prefixes=("speculative",)),
    Benchmark("fidelity", "fidelity.py", "quality on real text through the CLI: base vs CCA before vs after the "
              "finetune, perplexity and passkey by length (trains its own small base first)", "--quick",
              "make test-gpu runs --quick; tests/test_benchmarks.py", prefixes=("fidelity",)),
    Benchmark("gradient_sweep", "gradient_sweep.py", "the worst trainable gradient's error of the Triton backward "
              "against the fp32 reference, per family, over seeds", "", "tests/finetune/test_model_training.py",
              prefixes=("gradient",)),
    Benchmark("finetune_8b", "finetune_8b.py", "the real finetune stage on a Llama-3.1-8B shape: tokens/s and peak "
              "memory, CCA vs full attention; under accelerate launch, DDP/FSDP", "--seq-len 32768 --steps 3",
              "tests/test_benchmarks.py; tests/finetune/test_multigpu.py (2 GPUs)", prefixes=("scale",)),
    Benchmark("recipes_at_scale", "recipes_at_scale.py", "every shipped 7-30B recipe at its real shape: fits one "
              "GPU?, estimated vs measured peak memory, tokens/s CCA vs full, validation memory and time",
              "--rows llama-3.1-8b qwen3-8b", "python benchmarks/recipes_at_scale.py --tiny --device cpu "
              "(tests/test_benchmarks.py)", prefixes=("scale",)),
    Benchmark("recipe_cli", "recipe_cli.py", "the CLI with a family recipe's defaults (--set method=M, a local "
              "held-out file) on random weights of a released shape: every stage, the lengths the preflight keeps, "
              "validation time and memory per length", "--row llama-3.1-8b --method dca",
              "python benchmarks/recipe_cli.py --tiny (tests/test_benchmarks.py)", prefixes=("recipe-cli",)),
)}

# Helpers the benchmarks share (not benchmarks themselves).
HELPERS = {"registry.py", "run.py", "results_out.py", "step_clock.py", "read_floor.py"}
