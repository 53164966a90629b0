"""The memory preflight: a run that cannot fit is refused before any weight is loaded, with what would fit."""

import os
import re
import time
from pathlib import Path

import pytest

from cca_convert import memory
from cca_convert.cli import main
from tests.support.factories import LLAMA31_8B, save_base, save_sparse_checkpoint

GiB = 2**30


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory):
    return save_sparse_checkpoint(tmp_path_factory.mktemp("sparse") / "llama-3.1-8b", "llama", **LLAMA31_8B)


def test_the_sparse_checkpoint_writes_no_pages(llama8b):
    st = os.stat(llama8b / "model.safetensors")
    assert st.st_size > 16 * 10**9  # the 8B model's bytes as the header declares them
    assert st.st_blocks * 512 < 10 * 2**20  # and almost nothing on disk


def test_8b_with_its_recipe_on_a_24_gib_cpu_is_refused_before_loading(llama8b, tmp_path, capsys, monkeypatch):
    """The CI machine's case: 2 cores, 24 GiB. The shipped recipe (LoRA at 32K, validation to 32K) would load 16 GB
    of weights and run for hours; the preflight refuses it from the headers alone."""
    from cca_convert import pipeline, preflight

    monkeypatch.setattr(memory, "device_memory", lambda device: (24 * GiB, "CPU RAM (24.0 GiB, 24.0 available)"))
    monkeypatch.setattr(preflight, "check_output_space", lambda job, shapes: None)  # a small CI disk is not the point
    monkeypatch.chdir(tmp_path)
    loaded = []

    monkeypatch.setattr(pipeline, "stage_load", lambda job: loaded.append(job))
    start = time.perf_counter()
    assert main([str(llama8b), "--output", str(tmp_path / "out")]) == 2
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    line = lines[0]
    assert re.search(r"memory: the finetune stage needs about [\d.]+ GiB per device \(.*weights 15\.0", line), line
    assert "CPU RAM (24.0 GiB" in line and "would fit:" in line and "a GPU" in line
    assert "Nothing was loaded or written" in line
    assert not loaded and not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    print(f"refused in {elapsed:.1f}s: {line}")


def test_the_estimate_names_the_fixes_that_fit(llama8b, tmp_path, capsys, monkeypatch):
    """On an 80 GB GPU's budget a full finetune of 8B at 32K does not fit; LoRA and FSDP on more GPUs do."""
    from cca_convert import preflight

    monkeypatch.setattr(memory, "device_memory", lambda device: (79 * GiB, "NVIDIA H100 80GB HBM3 (79.2 GiB)"))
    monkeypatch.setattr(preflight, "_uses_reference_attention", lambda recipe, device: False)
    monkeypatch.setattr(preflight, "check_output_space", lambda job, shapes: None)
    monkeypatch.setattr("cca_convert.pipeline.default_device", lambda: "cuda:0")
    monkeypatch.chdir(tmp_path)
    assert main([str(llama8b), "--output", "out", "--set", "finetune.method=full", "--set",
                 "validate.enabled=false"]) == 2
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")][0]
    assert "finetune.method=lora" in line and re.search(r"FSDP on \d GPUs", line), line


def test_a_suggested_seq_len_stays_within_the_models_context(tmp_path, capsys, monkeypatch):
    """A base trained to 2048 with the 8B recipe's seq_len 32768 on a small CPU: both problems are named, and the
    memory line's seq_len is one the context check accepts (not the largest that would fit, 8192)."""
    from cca_convert import preflight

    save_base(tmp_path / "base", max_position_embeddings=2048)
    monkeypatch.setattr(memory, "device_memory", lambda device: (24 * GiB, "CPU RAM (24.0 GiB, 24.0 available)"))
    monkeypatch.setattr(preflight, "check_output_space", lambda job, shapes: None)
    monkeypatch.setattr(preflight, "check_finetune_data", lambda job: None)
    monkeypatch.setattr(preflight, "check_validation_data", lambda job: None)
    monkeypatch.chdir(tmp_path)
    assert main([str(tmp_path / "base"), "--output", "out", "--set", "finetune.seq_len=32768"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert any("finetune.seq_len=32768 exceeds the model's max_position_embeddings=2048" in ln for ln in lines), lines
    fit = next(ln for ln in lines if "would fit:" in ln)
    suggested = [int(n) for n in re.findall(r"--set finetune.seq_len=(\d+)", fit)]
    assert suggested and all(n <= 2048 for n in suggested), fit
    assert not (tmp_path / "out").exists()


def test_suggested_validation_lengths_stay_within_the_models_context(tmp_path, capsys, monkeypatch):
    """Lengths past a base's context that also do not fit: the memory line suggests only lengths the context check
    accepts (here none: the context error beside it says what to drop), never [4096, 8192] for a 512-token model."""
    from cca_convert import preflight

    save_base(tmp_path / "base", max_position_embeddings=512)
    monkeypatch.setattr(memory, "device_memory", lambda device: (24 * GiB, "CPU RAM (24.0 GiB, 24.0 available)"))
    monkeypatch.setattr(preflight, "check_output_space", lambda job, shapes: None)
    monkeypatch.setattr(preflight, "check_validation_data", lambda job: None)
    monkeypatch.chdir(tmp_path)
    for lengths, allowed in (("[256, 4096, 8192, 32768]", {256}), ("[4096, 8192, 32768]", set())):
        assert main([str(tmp_path / "base"), "--output", "out", "--set", "finetune.enabled=false",
                     "--set", f"validate.context_lengths={lengths}"]) == 2
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
        assert any("exceed the model's context (max_position_embeddings=512)" in ln for ln in lines), lines
        fit = next(ln for ln in lines if "would fit:" in ln)
        suggested = re.findall(r"--set 'validate.context_lengths=\[([\d, ]+)\]'", fit)
        assert {int(n) for s in suggested for n in s.split(",")} == allowed, fit
    assert not (tmp_path / "out").exists()


def test_a_tiny_model_fits_and_the_estimate_is_logged(tmp_path, capsys):
    save_base(tmp_path / "base", max_position_embeddings=512)
    (tmp_path / "held.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    assert main([str(tmp_path / "base"), "--output", str(tmp_path / "out"), "--set", "finetune.enabled=false",
                 "--set", "validate.context_lengths=[64]", "--set", "validate.speed=false",
                 "--set", "validate.passkey_trials=0", "--set", "export.dtype=float32", "--set",
                 f"validate.data={{files: [{tmp_path / 'held.txt'}]}}"]) == 0
    assert re.search(r"memory per device: validate ~[\d.]+ GiB of CPU RAM", capsys.readouterr().out)


@pytest.mark.parametrize("method", ["lora", "qkv", "full"])
def test_estimates_grow_with_what_is_trained_and_shrink_with_fsdp(method):
    from transformers import LlamaConfig

    shape = memory.Shape.of(LlamaConfig(**LLAMA31_8B), 8_030_261_248)
    one = memory.finetune_estimate(shape, method=method, seq_len=32768, micro_batch=1, checkpointing=True,
                                   weight_bytes=2)
    no_ckpt = memory.finetune_estimate(shape, method=method, seq_len=32768, micro_batch=1, checkpointing=False,
                                       weight_bytes=2)
    sharded = [memory.finetune_estimate(shape, method=method, seq_len=32768, micro_batch=1, checkpointing=True,
                                        weight_bytes=2, world=w, fsdp=True).total for w in (2, 4, 8)]
    assert no_ckpt.total > one.total
    assert sharded[0] > sharded[1] > sharded[2]
    assert one.parts["weights"] + one.parts["trained (fp32) + gradients + AdamW"] >= 2 * shape.params * (
        8 if method == "full" else 1)


def test_relative_default_lengths_a_gpu_cannot_afford_are_left_out_with_a_note(llama8b, tmp_path, capsys, monkeypatch):
    """`--set method=dca` on Llama-3.1-8B (c = 128K) with its default [c, 2c, 4c, 8c] on an 80 GB card: 512K and 1M
    are left out (one window there needs more than the card), 128K and 256K validated; lengths in tokens never are."""
    from cca_convert import pipeline, preflight

    monkeypatch.setattr(memory, "device_memory", lambda device: (79 * GiB, "NVIDIA H100 80GB HBM3 (79.2 GiB)"))
    monkeypatch.setattr(preflight, "_uses_reference_attention", lambda recipe, device: False)
    monkeypatch.setattr("cca_convert.pipeline.default_device", lambda: "cuda:0")
    monkeypatch.setattr(preflight, "check_validation_data", lambda job: None)  # no held-out text download here
    monkeypatch.setattr(preflight, "check_output_space", lambda job, shapes: None)
    seen = []

    def stop(job):
        seen.append(list(job.recipe.validate.context_lengths))
        raise pipeline.CCAError("stopped after the preflight (test)")

    monkeypatch.setattr(pipeline, "stage_load", stop)
    monkeypatch.setattr(pipeline, "STAGES", [s if s.name != "load" else pipeline.Stage("load", stop)
                                             for s in pipeline.STAGES])
    monkeypatch.chdir(tmp_path)
    assert main([str(llama8b), "--output", "out", "--set", "method=dca"]) == 2
    printed = capsys.readouterr().out
    assert seen == [[131072, 262144]]
    assert "validate.context_lengths [524288, 1048576] (given relative to the trained context) left out" in printed
    # the same lengths given in tokens are refused, not dropped
    assert main([str(llama8b), "--output", "out", "--set", "method=dca", "--set",
                 "validate.context_lengths=[131072,1048576]"]) == 2
    assert "memory: the validate stage needs about" in capsys.readouterr().err and len(seen) == 1


@pytest.mark.gpu
def test_the_round_trip_starts_with_the_converters_cuda_reserve_handed_back(tmp_path, monkeypatch):
    """The round trip loads the export in a second process on the same GPU; what the converter's caching allocator
    kept from the validation would stand beside it (Llama-3.1-8B after a 256K validation on one H100: 48.8 GB kept by
    the CLI + 16 GB loaded by the child, 65.0 GB on the card). The export hands it back before the reload starts.
    Here a 4 GiB block freed after the load stands for the validation's reserve: a tiny validation would prove
    nothing, as the converter still holds 0.44 GB at that point after one (0.30 GB of it example tensors kept by
    torch's inductor pattern matcher, which no converter can free; measured on an H100)."""
    import torch

    from cca_convert import pipeline

    seen = {}
    stages = {s.name: s for s in pipeline.STAGES}

    def load_then_reserve(job):
        stages["load"].run(job)
        block = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda:0")
        del block  # freed, but kept by the caching allocator: what a long validation leaves behind
        seen["after_load"] = torch.cuda.memory_reserved()

    def measured_roundtrip(job):
        seen["roundtrip"] = torch.cuda.memory_reserved()
        stages["roundtrip"].run(job)

    swapped = {"load": load_then_reserve, "roundtrip": measured_roundtrip}
    monkeypatch.setattr(pipeline, "STAGES", [pipeline.Stage(s.name, swapped.get(s.name, s.run), s.enabled)
                                             for s in pipeline.STAGES])
    monkeypatch.setattr("cca_convert.pipeline.default_device", lambda: "cuda:0")
    monkeypatch.chdir(tmp_path)
    examples = Path(__file__).resolve().parents[1] / "examples"
    assert main([str(examples / "tiny-llama"), "--output", "out", "--set", "finetune.enabled=false",
                 "--set", "validate.enabled=false"]) == 0
    assert seen["after_load"] >= 4 * GiB, seen
    assert seen["roundtrip"] < GiB, seen


def test_dca_on_a_cpu_is_estimated_linear_in_length_not_as_a_score_matrix():
    """DCA's PyTorch path runs through SDPA (no L x L matrix): its estimate grows with L, CCA's reference with L^2.
    examples/tiny-llama (8/2 heads of 32) at 16K: ~0.22 GiB against the score matrix's 16 GiB; the CLI measured a
    386 MiB prefill peak for the whole DCA model there (benchmarks/results/dca-cpu-sdpa.md)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(Path(__file__).parents[1] / "examples" / "tiny-llama")
    shape = memory.Shape.of(config, 3_800_000)
    at = {n: memory.validate_estimate(shape, length=n, batch=1, weight_bytes=2, reference_attention="dca", cuda=False)
          .parts["DCA's PyTorch attention"] for n in (16384, 32768)}
    scores = memory.validate_estimate(shape, length=16384, batch=1, weight_bytes=2, reference_attention="scores",
                                      cuda=False).parts["reference attention scores"]
    assert 0.1 * GiB < at[16384] < 0.5 * GiB and scores == 16 * GiB
    assert 1.9 < at[32768] / at[16384] < 2.1
    with pytest.raises(ValueError, match="reference_attention"):
        memory.validate_estimate(shape, length=16, batch=1, weight_bytes=2, reference_attention=True)


def test_the_methods_name_what_their_pytorch_attention_holds():
    from cca_convert import methods
    from cca_convert.preflight import _reference_memory
    from cca_convert.recipe import Recipe

    for name, kind in (("cca", "scores"), ("dca", "dca")):
        recipe = Recipe.model_validate({"method": name})
        assert _reference_memory(recipe, "cpu") == kind and methods.get(name).reference_memory == kind
        assert _reference_memory(recipe, "cuda:0") is None  # the kernels run there


def test_sliding_window_layers_cost_one_blocks_mask_past_four_windows():
    """Gemma 3's local layers attend by blocks past 4 windows (``cca_hf._sliding_attention``): at 32K the estimate
    holds one block's mask (2w x (3w - 1)), not the (L, L) one it once measured (8 GiB), which would refuse or shrink
    runs that fit; up to 4 windows the single (L, L) call's mask still counts."""
    import transformers

    fields = dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=256, sliding_window=1024,
                  layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)])
    shape = memory.Shape.of(transformers.Gemma3TextConfig(**fields), 11_766_000_000)
    assert shape.sliding and shape.window == 1024
    assert memory.sliding_mask_bytes(shape, 1, 32768) == 8 * 2048 * 3071
    assert memory.sliding_mask_bytes(shape, 2, 4096) == 8 * 2 * 4096 * 4096
    part = memory.validate_estimate(shape, length=32768, batch=1, weight_bytes=2).parts["sliding-window mask"]
    assert part < 0.06 * 2**30
    llama = memory.Shape.of(transformers.LlamaConfig(**LLAMA31_8B), 8_030_261_248)
    assert memory.sliding_mask_bytes(llama, 1, 32768) == 0
