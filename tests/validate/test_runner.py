"""Validation before upload: perplexity, passkey, gates, report, model card, `cca-convert validate`."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from cca_convert import pipeline
from cca_convert.cli import main
from cca_convert.errors import CCAError
from cca_convert.recipe import load_recipe
from cca_convert.validate import gates
from cca_convert.validate.config import HeldoutData, ValidateSection
from cca_convert.validate.data import check_no_overlap, token_stream
from cca_convert.validate.passkey import make_trials, passkey_accuracy
from cca_convert.validate.perplexity import attention_backend, perplexity, select_windows
from cca_convert.validate.report import gates_table
from tests.support.factories import (
    cca_hf_model_from,
    cca_model_from,
    char_tokenizer,
    family_and_overrides,
    sample_text,
    save_base,
    tiny_base_model,
)


@pytest.fixture
def base_dir(tmp_path):
    path = save_base(tmp_path / "base", vocab_size=128, max_position_embeddings=1024)
    char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def texts(tmp_path):
    held, ft = tmp_path / "heldout.txt", tmp_path / "finetune.txt"
    held.write_text(sample_text(1, 3000))
    ft.write_text(sample_text(2, 3000))
    return held, ft


def write_recipe(tmp_path, heldout, **validate) -> Path:
    data = {
        "cca": {"group_size": 4, "local_window": 16},
        "export": {"dtype": "float32", "roundtrip": False},
        "validate": {"data": {"files": [str(heldout)]}, "context_lengths": [128, 256, 512], "windows": 2,
                     "passkey_depths": [0.2, 0.8], "passkey_trials": 1, "max_ppl_ratio": 2.0, **validate},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# ----------------------------------------------------------------------------------------------------------------------
# Perplexity
# ----------------------------------------------------------------------------------------------------------------------
def test_select_windows_full_length_evenly_spread():
    assert select_windows(1000, 100, 4) == [0, 300, 600, 900]
    assert select_windows(1000, 100, 1) == [0]
    assert select_windows(1000, 100, 50) == list(range(0, 901, 100))  # at most the candidates there are
    assert select_windows(1050, 100, 3, stride=50) == [0, 500, 950]
    assert all(o + 100 <= 1000 for o in select_windows(1099, 100, 20))
    with pytest.raises(CCAError, match="fewer than context length 200"):
        select_windows(150, 200, 2)


def direct_ppl(model, stream, offsets, length):
    total, n = 0.0, 0
    with torch.no_grad():
        for o in offsets:
            ids = stream[o:o + length][None]
            logits = model(ids, use_cache=False).logits[0].double()
            total += F.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum").item()
            n += length - 1
    return math.exp(total / n)


def test_perplexity_matches_direct_nll_and_base():
    base = tiny_base_model(max_position_embeddings=512)
    cca = cca_hf_model_from(base, group_size=4, local_window=16)
    stream = torch.randint(0, 96, (700,), generator=torch.Generator().manual_seed(0))
    got = perplexity(cca, stream, 128, windows=3, batch_size=2)
    assert got["windows"] == 3 and got["tokens"] == 3 * 127
    assert math.isclose(got["ppl"], direct_ppl(cca, stream, got["offsets"], 128), rel_tol=1e-5)
    # token-weighted: one window of each kind gives the exp of the mean NLL, not the mean of perplexities
    base_ppl = perplexity(base, stream, 128, windows=3)["ppl"]
    assert math.isclose(base_ppl, direct_ppl(base, stream, got["offsets"], 128), rel_tol=1e-5)
    with attention_backend(cca, "full"):  # the same weights with causal attention = the base model
        assert math.isclose(perplexity(cca, stream, 128, windows=3)["ppl"], base_ppl, rel_tol=1e-5)
    assert not hasattr(cca.config, "cca_attn_backend")  # left as it was: unset (the model's default, auto)
    assert not math.isclose(got["ppl"], base_ppl, rel_tol=1e-4)  # s < L: CCA really ran
    wide = cca_hf_model_from(base, group_size=4, local_window=128)  # s >= L: CCA equals full attention
    assert math.isclose(perplexity(wide, stream, 128, windows=3)["ppl"], base_ppl, rel_tol=1e-5)


def test_logits_chunking_does_not_change_the_result(monkeypatch):
    from cca_convert.validate import perplexity as ppl_mod

    base = tiny_base_model()
    stream = torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(1))
    whole = perplexity(base, stream, 100, windows=2)["ppl"]
    monkeypatch.setattr(ppl_mod, "LOGIT_BYTES", 4 * 96 * 7)  # 7 positions per chunk
    assert math.isclose(perplexity(base, stream, 100, windows=2)["ppl"], whole, rel_tol=1e-6)


def test_token_stream_and_passkey_prompts():
    tok = char_tokenizer()
    stream = token_stream(tok, ["ab", "cd"])
    assert stream.tolist() == [1, tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b"), 2,
                               1, tok.convert_tokens_to_ids("c"), tok.convert_tokens_to_ids("d"), 2]
    trials = make_trials(tok, 600, [0.0, 0.5, 1.0], 2, 5, seed=0)
    assert len(trials) == 6 and len({t.key for t in trials}) == 6
    for t in trials:
        text = tok.decode(t.input_ids, skip_special_tokens=True)
        assert len(t.input_ids) == 600 and text.endswith(f"The pass key is {t.key}")
        assert tok.decode(t.input_ids[t.answer_start:]) == f" {t.key}"
        pos = text.index(f"The pass key is {t.key}.")
        assert abs(pos / 600 - (0.05 + 0.6 * t.depth)) < 0.2  # needle near its depth inside the filler
    assert make_trials(tok, 100, [0.5], 1, 5, seed=0) == []  # does not fit


def test_passkey_scoring_is_greedy_decoding():
    """A model that always predicts the next prompt token scores 100%; greedy decoding agrees."""
    tok = char_tokenizer()
    trials = make_trials(tok, 300, [0.5], 2, 5, seed=3)
    base = tiny_base_model(vocab_size=128)
    acc = passkey_accuracy(base, trials)
    assert acc["trials"] == 2 and 0 <= acc["accuracy"] <= 1
    # greedy generation of the answer must match the teacher-forced verdict
    for t in trials:
        prompt = t.input_ids[:t.answer_start][None]
        out = base.generate(prompt, max_new_tokens=len(t.input_ids) - t.answer_start, do_sample=False,
                            attention_mask=torch.ones_like(prompt))
        ok = torch.equal(out[0, t.answer_start:], t.input_ids[t.answer_start:])
        assert passkey_accuracy(base, [t])["accuracy"] == float(ok)


# ----------------------------------------------------------------------------------------------------------------------
# Gates and held-out checks
# ----------------------------------------------------------------------------------------------------------------------
def _results(base_ppl, cca_ppl, base_pk, cca_pk):
    def one(ppl, pk):
        return {"perplexity": {"512": {"ppl": ppl}}, "passkey": {"512": {"accuracy": pk}}}
    return {"base": one(base_ppl, base_pk), "cca": one(cca_ppl, cca_pk)}


def test_gates_pass_fail_and_margins():
    section = ValidateSection(context_lengths=[512], max_ppl_ratio=1.1, min_passkey_accuracy=0.8, max_passkey_drop=0.1)
    ok = gates.evaluate(section, _results(10.0, 10.5, 1.0, 1.0), "cca", "CCA")
    assert [g["passed"] for g in ok] == [True, True, True] and not gates.failed(ok)
    assert ok[0]["margin"] == pytest.approx(0.05)
    bad = gates.evaluate(section, _results(10.0, 12.0, 1.0, 0.6), "cca", "CCA")
    assert [g["gate"] for g in gates.failed(bad)] == ["max_ppl_ratio", "min_passkey_accuracy", "max_passkey_drop"]
    msg = gates.summary(bad)
    assert "1.200 > 1.1 (over by 0.100)" in msg and "short by 0.20" in msg and "over by 0.30" in msg
    assert bad[0]["margin"] == pytest.approx(-0.1)
    off = ValidateSection(context_lengths=[512], max_ppl_ratio=None)
    assert gates.evaluate(off, _results(10.0, 99.0, 1.0, 0.0), "cca", "CCA") == []


def test_min_passkey_accuracy_is_capped_at_what_the_base_retrieves_within_its_trained_context():
    section = ValidateSection(context_lengths=[512, 1024, 2048], max_ppl_ratio=None, min_passkey_accuracy=0.6)

    def results(base_pk_at_c, converted):
        base = {"passkey": {"512": {"accuracy": base_pk_at_c}, "1024": {"accuracy": 0.0}, "2048": {"accuracy": 0.0}}}
        return {"base": base, "dca": {"passkey": {k: {"accuracy": v} for k, v in converted.items()}}}

    # The base retrieves nothing at its trained context 512: the gate does not apply, and says why.
    none = gates.evaluate(section, results(0.0, {"512": 0.0, "1024": 0.0, "2048": 0.0}), "dca", "DCA", 512)
    assert [g["passed"] for g in none] == [None, None, None] and not gates.failed(none)
    assert none[0]["detail"].startswith("not applicable: the base retrieves no passkey at 512")
    assert "not applicable" in gates_table({"gates": none})
    # The base retrieves 1/3 there: the bar is 1/3 (not 0.6), and a drop below it fails.
    third = gates.evaluate(section, results(1 / 3, {"512": 1 / 3, "1024": 1 / 3, "2048": 0.0}), "dca", "DCA", 512)
    assert [g["passed"] for g in third] == [True, True, False]
    assert third[2]["threshold"] == pytest.approx(1 / 3)
    # A base that retrieves everything keeps the recipe's 0.6; no trained context known: the recipe's bar.
    full = gates.evaluate(section, results(1.0, {"512": 1.0, "1024": 0.6, "2048": 0.5}), "dca", "DCA", 512)
    assert [g["passed"] for g in full] == [True, True, False] and full[2]["threshold"] == 0.6
    plain = gates.evaluate(section, results(0.0, {"512": 0.0, "1024": 0.0, "2048": 0.0}), "dca", "DCA")
    assert [g["passed"] for g in plain] == [False, False, False]


def test_heldout_must_not_overlap_finetune_data(tmp_path, texts):
    held, ft = texts
    data = HeldoutData(files=[str(held)])
    assert check_no_overlap(data, None) == ["no finetune data to compare with"]
    assert check_no_overlap(data, {"enabled": False, "data": {"files": [str(held)]}})  # finetune off
    with pytest.raises(CCAError, match="is also finetune data"):
        check_no_overlap(data, {"enabled": True, "data": {"files": [str(held)]}})
    copy = tmp_path / "copy.txt"
    copy.write_text(held.read_text())
    with pytest.raises(CCAError, match="same content"):
        check_no_overlap(data, {"enabled": True, "data": {"files": [str(tmp_path / "c*.txt")]}})
    lines = tmp_path / "lines.txt"
    held.write_text("".join(f"line number {i} of the held-out text, long enough to count\n" for i in range(50)))
    lines.write_text("".join(f"line number {i} of the held-out text, long enough to count\n" for i in range(0, 50, 5)))
    with pytest.raises(CCAError, match="20% of the lines"):
        check_no_overlap(data, {"enabled": True, "data": {"files": [str(lines)]}})
    assert check_no_overlap(data, {"enabled": True, "data": {"files": [str(ft)]}})  # disjoint: notes only
    ds = HeldoutData(dataset="org/books", split="test")
    with pytest.raises(CCAError, match="also the finetune dataset"):
        check_no_overlap(ds, {"enabled": True, "data": {"dataset": "org/books", "split": "test"}})
    assert check_no_overlap(ds, {"enabled": True, "data": {"dataset": "org/books", "split": "train"}})
    with pytest.raises(Exception, match="files: give at least one file"):
        HeldoutData(files=[])


def test_stage_order():
    names = [s.name for s in pipeline.STAGES]
    assert names.index("preflight") < names.index("load") < names.index("baseline") < names.index("validate") < names.index("export")
    if "finetune" in names:
        assert names.index("baseline") < names.index("finetune") < names.index("validate")
    assert names[-1] == "push" and pipeline.STAGES[-1].after_commit


# ----------------------------------------------------------------------------------------------------------------------
# The pipeline: report, model card, gates
# ----------------------------------------------------------------------------------------------------------------------
def run(base_dir, output, recipe_path, overrides=(), force=False):
    recipe = load_recipe(recipe_path, list(overrides))[0]
    job = pipeline.Job(source=str(base_dir), base_dir=base_dir, output=output, recipe=recipe, force=force,
                       device="cpu", log=lambda msg: None)
    pipeline.run_job(job)
    return job


def test_pipeline_writes_report_plot_and_card(tmp_path, base_dir, texts):
    from huggingface_hub import ModelCard

    out = tmp_path / "out"
    job = run(base_dir, out, write_recipe(tmp_path, texts[0]))
    assert [k for k in ("baseline", "validate") if k in job.timings] == ["validate"]  # no finetune: one stage
    report = json.loads((out / "validation" / "report.json").read_text())
    assert report["passed"] is True and report["models"] == ["base", "cca"]
    assert sorted(report["results"]["cca"]["perplexity"], key=int) == ["128", "256", "512"]
    assert report["results"]["cca"]["passkey"]["512"]["trials"] == 2
    assert report["results"]["cca"]["passkey"]["128"]["accuracy"] is None  # prompt does not fit
    assert report["recipe_digest"] == job.recipe.digest()
    assert {"torch", "transformers", "python"} <= set(report["versions"]) and report["hardware"]["device"] == "cpu"
    assert set(report["speed"]["256"]) == {"base", "cca"} and report["speed"]["256"]["cca"]["latency_s"] > 0
    assert [g["gate"] for g in report["gates"]] == ["max_ppl_ratio"] * 3
    md = (out / "validation" / "report.md").read_text()
    assert "| 512 |" in md and "All gates passed" in md and "](ppl.png)" in md
    assert (out / "validation" / "ppl.png").read_bytes()[:4] == b"\x89PNG"
    card = ModelCard.load(out / "README.md")
    assert "## Validation" in card.text and "](validation/ppl.png)" in card.text and "| 256 |" in card.text
    names = [r.metric_name for r in card.data.eval_results]
    assert "Perplexity @ 512 tokens" in names and "Passkey retrieval @ 512 tokens" in names
    ppl512 = next(r.metric_value for r in card.data.eval_results if r.metric_name == "Perplexity @ 512 tokens")
    assert ppl512 == pytest.approx(report["results"]["cca"]["perplexity"]["512"]["ppl"], rel=1e-3)


def test_failed_gate_stops_before_export_unless_force(tmp_path, base_dir, texts):
    recipe = write_recipe(tmp_path, texts[0], max_ppl_ratio=0.5, passkey_trials=0)
    out = tmp_path / "out"
    with pytest.raises(CCAError, match=r"validation gates failed: max_ppl_ratio @ 128: .* > 0.5 \(over by") as err:
        run(base_dir, out, recipe)
    assert "--force" in str(err.value)
    assert not out.exists()
    kept = tmp_path / ".out.work" / "validation" / "report.json"
    assert json.loads(kept.read_text())["passed"] is False

    job = run(base_dir, out, recipe, force=True)
    report = json.loads((out / "validation" / "report.json").read_text())
    assert report["passed"] is False and report["forced"] is True and "max_ppl_ratio @ 512" in report["failed_gates"]
    assert "Gates FAILED" in (out / "README.md").read_text()
    assert "export" in job.timings

    skipped = run(base_dir, tmp_path / "skip", recipe, ["validate.enabled=false"])
    assert "validate" not in skipped.timings and not (tmp_path / "skip" / "validation").exists()


def test_before_and_after_finetune(tmp_path, base_dir, texts, monkeypatch):
    """With a finetune stage, base and CCA are measured before it (stage baseline) and CCA again after."""
    def fake_finetune(job):
        with torch.no_grad():
            for layer in job.model.model.layers:
                layer.self_attn.q_proj.weight.mul_(1.5)
        job.finetuned = True

    stages = [s for s in pipeline.STAGES if s.name != "finetune"]
    at = [s.name for s in stages].index("validate")
    stages.insert(at, pipeline.Stage("finetune", fake_finetune))
    monkeypatch.setattr(pipeline, "STAGES", stages)
    out = tmp_path / "out"
    job = run(base_dir, out, write_recipe(tmp_path, texts[0], passkey_trials=0, speed=False))
    assert list(job.timings)[:6] == ["convert", "preflight", "load", "baseline", "finetune", "validate"]
    report = json.loads((out / "validation" / "report.json").read_text())
    assert report["models"] == ["base", "cca_before", "cca_after"] and report["final_model"] == "cca_after"
    r = report["results"]
    assert r["cca_before"]["perplexity"]["512"]["ppl"] != r["cca_after"]["perplexity"]["512"]["ppl"]
    md = (out / "validation" / "report.md").read_text()
    assert "CCA before finetune ppl" in md and "CCA after finetune ppl" in md


def test_validate_command_on_exported_folder(tmp_path, base_dir, texts, capsys):
    out = tmp_path / "out"
    run(base_dir, out, write_recipe(tmp_path, texts[0], passkey_trials=0))
    first = json.loads((out / "validation" / "report.json").read_text())
    card_before, report_before = (out / "README.md").read_text(), (out / "validation" / "report.json").read_text()
    assert main(["validate", str(out), "--set", "validate.context_lengths=[64,256]", "--device", "cpu"]) == 0
    # a re-run never rewrites history: its report goes beside the conversion's, card and report untouched
    (rerun,) = out.glob("validation-*-vs-full-attention")
    report = json.loads((rerun / "report.json").read_text())
    assert (out / "README.md").read_text() == card_before
    assert (out / "validation" / "report.json").read_text() == report_before
    assert report["context_lengths"] == [64, 256] and report["passed"]
    # the same weights and windows give the same numbers as in the pipeline
    assert report["results"]["cca"]["perplexity"]["256"]["ppl"] == pytest.approx(
        first["results"]["cca"]["perplexity"]["256"]["ppl"], rel=1e-5)
    # asked for: the card's table and validation/ are replaced
    assert main(["validate", str(out), "--set", "validate.context_lengths=[64,256]", "--device", "cpu",
                 "--update-card"]) == 0
    assert json.loads((out / "validation" / "report.json").read_text())["context_lengths"] == [64, 256]
    readme = (out / "README.md").read_text()
    assert readme.count("## Validation") == 1 and "| 64 |" in readme and "Perplexity @ 64 tokens" in readme
    # a gate that fails: exit status 1, report says so
    assert main(["validate", str(out), "--set", "validate.max_ppl_ratio=0.5", "--set", "validate.speed=false"]) == 1
    assert "validation gates FAILED: max_ppl_ratio" in capsys.readouterr().out
    # an explicit base model folder
    assert main(["validate", str(out), "--base", str(base_dir), "--output", str(tmp_path / "v2"),
                 "--set", "validate.speed=false"]) == 0
    with_base = json.loads((tmp_path / "v2" / "validation" / "report.json").read_text())
    assert with_base["results"]["base"]["perplexity"]["256"]["ppl"] == pytest.approx(
        first["results"]["base"]["perplexity"]["256"]["ppl"], rel=1e-5)
    assert main(["validate", str(base_dir)]) == 2  # not a CCA model


def test_a_base_with_sliding_window_layers_says_its_speed_up_includes_their_blocking(tmp_path, base_dir, texts, capsys):
    """transformers runs Gemma 3's local layers as one call under an L x L mask; the export runs them by blocks past
    4 windows. A --base comparison past that length says so in its log and report; within it, or on a base without
    sliding layers, nothing is added."""
    family, shape = family_and_overrides("gemma3_text")  # local layers of window 16 beside a global one
    gemma = save_base(tmp_path / "gemma", family=family, **{**shape, "vocab_size": 128, "max_position_embeddings": 1024})
    char_tokenizer().save_pretrained(gemma)
    lengths = ["--set", "validate.context_lengths=[32,128]", "--set", "validate.passkey_trials=0"]
    for base, name in ((gemma, "g"), (base_dir, "l")):
        out = tmp_path / f"out-{name}"
        run(base, out, write_recipe(tmp_path, texts[0], passkey_trials=0, enabled=False))
        capsys.readouterr()
        assert main(["validate", str(out), "--base", str(base), "--output", str(tmp_path / f"v-{name}"),
                     "--device", "cpu", *lengths]) == 0
        printed = capsys.readouterr().out
        note = json.loads((tmp_path / f"v-{name}" / "validation" / "report.json").read_text())["base_note"]
        if base is gemma:
            assert "note: the base model's sliding-window layers (window 16)" in printed
            assert "past 64 tokens" in note and "speed-up at 128 includes that" in note
        else:
            assert note.endswith("base (--base)") and "note:" not in printed
    # within 4 windows the two run the same one call: no note
    assert main(["validate", str(tmp_path / "out-g"), "--base", str(gemma), "--output", str(tmp_path / "v-short"),
                 "--device", "cpu", "--set", "validate.context_lengths=[32,64]", "--set",
                 "validate.passkey_trials=0"]) == 0
    assert json.loads((tmp_path / "v-short" / "validation" / "report.json").read_text())["base_note"].endswith(
        "gemma (--base)")


@pytest.mark.parametrize("flags,message", [
    (["--device", "banana"], "--device banana: the validation runs on cpu, cuda or cuda:N"),
    (["--device", "mps"], "--device mps: the validation runs on cpu, cuda or cuda:N"),
    (["--device", "cuda:64"], "--device cuda:64: this machine has "),
    (["--lm-eval", ","], "--lm-eval ',' names no task"),
    (["--lm-eval", ""], "--lm-eval '' names no task"),
])
def test_validate_flags_are_checked_before_anything_loads(tmp_path, capsys, flags, message):
    """One error line, exit 2, no folder written: before the target is even looked up."""
    assert main(["validate", str(tmp_path / "nope"), *flags]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_non_finite_perplexity_fails_whatever_the_gates(tmp_path, base_dir, texts):
    from transformers import AutoTokenizer

    from cca_convert.validate.runner import Suite

    section = ValidateSection(data={"files": [str(texts[0])]}, context_lengths=[32], windows=1,
                              passkey_trials=0, speed=False, max_ppl_ratio=None)
    suite = Suite(section, AutoTokenizer.from_pretrained(base_dir), None, log=lambda m: None)
    model = cca_model_from(tiny_base_model(vocab_size=128), group_size=4, local_window=8)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("inf"))
    with pytest.raises(CCAError, match=r"perplexity @ 32 is not finite"):
        suite.measure(model, None, "CCA")


# ----------------------------------------------------------------------------------------------------------------------
# One data module for the finetune and the validation
# ----------------------------------------------------------------------------------------------------------------------
def test_heldout_jsonl_gives_exactly_the_perplexity_of_the_same_documents_as_txt(tmp_path, base_dir):
    from transformers import AutoTokenizer

    from cca_convert.validate.runner import Suite

    docs = [sample_text(10 + i, 900).rstrip("\n") + ' "quoted" \\ line\nnext line' for i in range(4)]
    txt_dir = tmp_path / "txt"
    txt_dir.mkdir()
    for i, doc in enumerate(docs):  # plain text: one document per file
        (txt_dir / f"doc{i}.txt").write_text(doc)
    jsonl = tmp_path / "held.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    parquet_free = tmp_path / "held.json"  # a JSON array file goes through the same builder
    parquet_free.write_text(json.dumps([{"text": d} for d in docs]))

    tok = AutoTokenizer.from_pretrained(base_dir)
    model = cca_model_from(tiny_base_model(vocab_size=128, max_position_embeddings=1024), group_size=4,
                           local_window=16)
    ppl = {}
    for name, files in {"txt": [str(txt_dir / "doc*.txt")], "jsonl": [str(jsonl)], "json": [str(parquet_free)]}.items():
        section = ValidateSection(data={"files": files}, context_lengths=[256], windows=3, passkey_trials=0,
                                  speed=False)
        suite = Suite(section, tok, None, log=lambda m: None)
        assert suite.data_info["documents"] == 4
        ppl[name] = suite.measure(model, None, name)["perplexity"]["256"]
    assert ppl["txt"]["tokens"] == ppl["jsonl"]["tokens"] == ppl["json"]["tokens"]
    assert ppl["txt"]["ppl"] == ppl["jsonl"]["ppl"] == ppl["json"]["ppl"]
    # the JSON quoting is not read as text: the stream is the documents' own characters
    stream = token_stream(tok, [d for d in docs])
    assert torch.equal(Suite(ValidateSection(data={"files": [str(jsonl)]}, context_lengths=[256], windows=1,
                                             passkey_trials=0, speed=False), tok, None, log=lambda m: None).stream,
                       stream)


@pytest.mark.parametrize("data,message", [
    ({"files": ["nope/missing.txt"]}, r"validate.data.files: file not found: nope/missing.txt"),
    ({"files": ["{tmp}/*.none"]}, r"validate.data.files: no file matches"),
    ({"files": ["{tmp}/held.jsonl"], "text_field": "content"}, r"validate.data.text_field: .* no column 'content'"),
    ({"files": ["{tmp}/held.csv"]}, r"cannot tell the format"),
])
def test_heldout_data_errors_are_the_finetune_errors_under_their_section(tmp_path, data, message):
    (tmp_path / "held.jsonl").write_text(json.dumps({"text": "some text"}) + "\n")
    (tmp_path / "held.csv").write_text("text\nsome text\n")
    data = {k: [f.format(tmp=tmp_path) for f in v] if k == "files" else v for k, v in data.items()}
    from cca_convert.validate.data import load_texts

    with pytest.raises(CCAError, match=message):
        load_texts(HeldoutData(**data))


def test_old_heldout_key_names_still_load():
    data = HeldoutData.model_validate({"dataset": "org/x", "dataset_config": "en", "text_column": "body"})
    assert (data.config, data.text_field) == ("en", "body")


def test_force_after_a_failed_gate_reuses_the_finished_finetune(tmp_path, base_dir, texts, capsys):
    """The sequence the gate's message describes: fail -> same command + --force -> exported, no retraining."""
    data = yaml.safe_load(write_recipe(tmp_path, texts[0], max_ppl_ratio=0.5, passkey_trials=0, speed=False,
                                       context_lengths=[128]).read_text())
    data["finetune"] = {"enabled": True, "method": "qkv", "seq_len": 64, "steps": 2, "gradient_accumulation_steps": 1,
                        "warmup_steps": 0, "checkpoint_every": 0, "data": {"files": [str(texts[1])]}}
    recipe = tmp_path / "ft.yaml"
    recipe.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    cmd = [str(base_dir), "--recipe", str(recipe), "--output", str(out)]
    assert main(cmd) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: validation gates failed") and f"run `cca-convert {' '.join(cmd)} --force`" in err
    assert not out.exists()
    metrics = tmp_path / ".out.work" / "finetune" / "metrics.jsonl"
    before = metrics.read_text()

    assert main(cmd + ["--force"]) == 0
    printed = capsys.readouterr().out
    assert "reusing the finished finetune" in printed and "reusing the measurements" in printed
    assert (out / "finetune" / "metrics.jsonl").read_text() == before  # not trained again
    assert json.loads((out / "validation" / "report.json").read_text())["forced"] is True


# ----------------------------------------------------------------------------------------------------------------------
# lm-eval-harness (the [eval] extra)
# ----------------------------------------------------------------------------------------------------------------------
def _local_task(tmp_path, heldout) -> Path:
    """A local lm-eval task over the held-out file (no download), as examples/lm_eval/heldout_rolling.yaml."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    task = yaml.safe_load((Path(__file__).parents[2] / "examples" / "lm_eval" / "heldout_rolling.yaml").read_text())
    task.update(task="local_rolling", dataset_kwargs={"data_files": {"test": str(heldout)}, "sample_by": "document"})
    (folder / "local_rolling.yaml").write_text(yaml.safe_dump(task))
    return folder


@pytest.mark.slow
def test_lm_eval_runs_base_and_converted_into_the_report_and_the_card(tmp_path, base_dir, texts, capsys):
    pytest.importorskip("lm_eval")  # the [test] extra installs it: CI runs this
    tasks = _local_task(tmp_path, texts[0])
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path, texts[0], passkey_trials=0, speed=False,
                          lm_eval={"tasks": ["local_rolling"], "include_path": str(tasks)})
    run(base_dir, out, recipe)
    report = json.loads((out / "validation" / "report.json").read_text())
    base, cca = (report["results"][m]["lm_eval"]["local_rolling"] for m in ("base", "cca"))
    assert set(base) == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    assert all(math.isfinite(v) and v > 0 for v in [*base.values(), *cca.values()])
    assert base["word_perplexity"] != cca["word_perplexity"]  # the base ran with full attention, CCA with CCA
    assert "## lm-eval-harness" in (out / "validation" / "report.md").read_text()
    assert "| local_rolling | word_perplexity |" in (out / "README.md").read_text()
    # the validate command's --lm-eval: the same numbers on the export
    assert main(["validate", str(out), "--lm-eval", "local_rolling", "--set",
                 f"validate.lm_eval.include_path={tasks}", "--set", "validate.speed=false", "--device", "cpu"]) == 0
    (rerun,) = out.glob("validation-*-vs-full-attention")
    again = json.loads((rerun / "report.json").read_text())["results"]["cca"]["lm_eval"]["local_rolling"]
    assert again["word_perplexity"] == pytest.approx(cca["word_perplexity"], rel=1e-5)
    # bad input: one line naming the problem, exit 2, before any weight is loaded
    assert main(["validate", str(out), "--lm-eval", "no_such_task", "--set",
                 f"validate.lm_eval.include_path={tasks}"]) == 2
    assert "lm-eval knows no task no_such_task" in capsys.readouterr().err
    assert main(["validate", str(out), "--lm-eval", "local_rolling", "--set",
                 f"validate.lm_eval.include_path={tmp_path / 'nowhere'}"]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_lm_eval_missing_names_the_extra(monkeypatch):
    import importlib.util

    from cca_convert.validate import harness
    from cca_convert.validate.config import LmEvalSection

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    assert harness.problems(LmEvalSection()) == []  # no tasks: nothing needed
    (msg,) = harness.problems(LmEvalSection(tasks=["hellaswag"]))
    assert "not installed" in msg and 'pip install "cca-convert[eval]"' in msg
