"""The finetune stage on tiny random CCA models (CPU, fp32): loss falls, interrupted runs resume
bit-exactly, LoRA merges exactly, bad data specs fail before any training."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from cca_convert.errors import CCAError
from cca_convert.finetune.trainer import FinetuneInterrupted, stage_finetune
from cca_convert.pipeline import STAGES, Job
from cca_convert.recipe import Recipe, load_recipe
from tests.support.factories import cca_hf_model_from, tiny_base_model, write_text


def save_tokenizer(folder: Path, text: str, vocab_size: int = 90) -> None:
    """A tiny BPE tokenizer (vocab < the tiny models' 96) saved in transformers format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>", "<unk>"])
    tok.train_from_iterator([text], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.save_pretrained(folder)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    train = write_text(root / "train.txt", seed=0)
    base = root / "base"
    base.mkdir()
    save_tokenizer(base, train.read_text())
    return root


def make_job(tmp_path: Path, corpus: Path, resume=False, overrides=(), seed=0, **ft) -> Job:
    settings = dict(enabled=True, method="lora", seq_len=64, micro_batch_size=2, gradient_accumulation_steps=2,
                    steps=6, learning_rate=3e-3, warmup_steps=1, gradient_checkpointing=True, checkpoint_every=2,
                    data={"files": [str(corpus / "train.txt")], "sample_by": "paragraph"},
                    lora={"r": 4, "alpha": 8, "dropout": 0.1})
    settings.update(ft)
    recipe = Recipe.model_validate({"cca": {"group_size": 4, "local_window": 8}, "finetune": settings})
    for key, value in overrides:
        section, name = key.split(".", 1)
        setattr(getattr(recipe, section), name, value)
    model = cca_hf_model_from(tiny_base_model(seed=seed), group_size=4, local_window=8)
    model.config.dtype = torch.float32
    job = Job(source="tiny", base_dir=corpus / "base", output=tmp_path / "out", recipe=recipe, resume=resume,
              device="cpu", log=lambda msg: None)
    job.config, job.model = model.config, model
    job.staging = tmp_path / "staging"
    job.staging.mkdir(parents=True, exist_ok=True)
    return job


def losses(job: Job) -> list[float]:
    lines = (job.staging / "finetune" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(ln)["loss"] for ln in lines]


@pytest.mark.parametrize("method", ["lora", "qkv", "full"])
def test_loss_falls_and_only_the_method_s_weights_change(tmp_path, corpus, method):
    job = make_job(tmp_path, corpus, method=method, steps=8, learning_rate=1e-2 if method == "lora" else 3e-3)
    before = {k: v.clone() for k, v in job.model.state_dict().items()}
    stage_finetune(job)
    curve = losses(job)
    drop = 0.5 if method == "full" else 0.1  # a random tiny model: q/k/v alone move the loss less
    assert len(curve) == 8 and curve[-1] < curve[0] - drop, curve
    assert job.finetuned and type(job.model).__name__ == "CCALlamaForCausalLM"  # LoRA merged away
    after = job.model.state_dict()
    assert set(after) == set(before)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    if method == "full":
        assert {k for k in before if "mlp" in k} <= changed
    else:
        assert changed and all(k.split(".")[-2] in ("q_proj", "k_proj", "v_proj") for k in changed), changed
    assert (job.staging / "adapter" / "adapter_config.json").exists() == (method == "lora")
    assert not job.model.training and job.model.config.use_cache is False  # factories' setting restored


def test_interrupted_run_resumes_bit_exactly(tmp_path, corpus):
    full = make_job(tmp_path / "a", corpus)
    stage_finetune(full)
    reference = losses(full)

    job = make_job(tmp_path / "b", corpus)

    def sigterm_after_3(step, record):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the real handler: finish the step, checkpoint, stop

    with pytest.raises(FinetuneInterrupted, match=r"after step 3/6.*--resume"):
        stage_finetune(job, on_step=sigterm_after_3)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored

    with pytest.raises(CCAError, match="re-run with --resume"):  # never silently reused nor overwritten
        stage_finetune(make_job(tmp_path / "b", corpus))
    with pytest.raises(CCAError, match=r"recipe changed.*finetune.learning_rate"):
        stage_finetune(make_job(tmp_path / "b", corpus, resume=True, learning_rate=1e-3))

    resumed = make_job(tmp_path / "b", corpus, resume=True)
    stage_finetune(resumed)
    assert losses(resumed) == reference  # bit-exact, steps 1-6
    for k, v in full.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k


def test_merged_lora_logits_equal_adapter_logits(tmp_path, corpus):
    from peft import PeftModel

    job = make_job(tmp_path, corpus, steps=3, learning_rate=2e-2)
    stage_finetune(job)
    base = cca_hf_model_from(tiny_base_model(), group_size=4, local_window=8)
    ids = torch.randint(0, 90, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = base(ids).logits
        wrapped = PeftModel.from_pretrained(base, job.staging / "adapter").eval()
        merged, adapter = job.model(ids).logits, wrapped(ids).logits
    assert (adapter - plain).abs().max() > 1e-3  # the adapter does something
    torch.testing.assert_close(merged, adapter, atol=1e-5, rtol=1e-5)


def test_streaming_and_jsonl_give_the_same_batches_shape(tmp_path, corpus):
    rows = [{"text": p} for p in (corpus / "train.txt").read_text().split("\n\n")]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = make_job(tmp_path, corpus, steps=2, data={"files": [str(jsonl)], "streaming": True, "shuffle_buffer": 4})
    stage_finetune(job)
    assert len(losses(job)) == 2


@pytest.mark.parametrize("data, message", [
    ({"files": ["nope/missing.txt"]}, r"finetune.data.files: file not found: nope/missing.txt"),
    ({"files": ["{tmp}/empty.txt"]}, r"is empty"),
    ({"files": ["{tmp}/docs.jsonl"], "text_field": "content"}, r"no column 'content' \(columns: text\)"),
    ({"files": ["{tmp}/numbers.jsonl"]}, r"holds int values, not text"),
    ({"files": ["{tmp}/short.txt"]}, r"fewer than one finetune.seq_len=64 block"),
    ({"files": ["{tmp}/data.csv"]}, r"cannot tell the format"),
])
def test_bad_data_fails_before_training(tmp_path, corpus, data, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "docs.jsonl").write_text('{"text": "a b c"}\n')
    (tmp_path / "numbers.jsonl").write_text('{"text": 3}\n')
    (tmp_path / "short.txt").write_text("the lord spake\n")
    (tmp_path / "data.csv").write_text("text\nabc\n")
    data["files"] = [f.format(tmp=tmp_path) for f in data["files"]]
    job = make_job(tmp_path, corpus, data=data)
    before = {k: v.clone() for k, v in job.model.state_dict().items()}
    with pytest.raises(CCAError, match=message):
        stage_finetune(job)
    assert all(torch.equal(v, job.model.state_dict()[k]) for k, v in before.items())
    assert not (job.work_dir / "finetune").exists()


def test_seq_len_beyond_the_context_fails_with_the_fix(tmp_path, corpus):
    job = make_job(tmp_path, corpus, seq_len=1024)  # tiny models have max_position_embeddings 512
    with pytest.raises(CCAError, match=r"seq_len=1024 exceeds .*max_position_embeddings=512.*"
                                       r"--set extend.factor=2 "):
        stage_finetune(job)


def test_recipe_keys_and_enabled_switch(tmp_path):
    demo = Path(__file__).parents[2] / "recipes" / "tiny-demo.yaml"
    recipe, _ = load_recipe(demo)
    job = Job(source="x", base_dir=tmp_path, output=tmp_path / "o", recipe=recipe)
    names = [s.name for s in STAGES if s.enabled(job)]
    assert names.index("load") < names.index("finetune") < names.index("export")
    recipe, _ = load_recipe(demo, ["finetune.enabled=false"])
    job = Job(source="x", base_dir=tmp_path, output=tmp_path / "o", recipe=recipe)
    assert "finetune" not in [s.name for s in STAGES if s.enabled(job)]
    with pytest.raises(CCAError, match=r"finetune.method"):
        load_recipe(demo, ["finetune.method=adapters"])
    bare = tmp_path / "bare.yaml"
    bare.write_text("cca: {group_size: 4}\n")
    with pytest.raises(CCAError, match=r"needs data"):
        load_recipe(bare, ["finetune.enabled=true"])


def test_pipeline_exports_the_finetuned_model(tmp_path, corpus):
    """CLI end to end on a tiny base (no round trip, to stay fast): weights change, metrics ship;
    the same command with --set finetune.enabled=false exports the base weights."""
    from safetensors.torch import load_file

    from cca_convert.cli import main

    base = tmp_path / "base"
    tiny_base_model().save_pretrained(base)
    for f in (corpus / "base").iterdir():
        (base / f.name).write_bytes(f.read_bytes())
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "cca: {group_size: 4, local_window: 8}\n"
        f"finetune: {{enabled: true, seq_len: 64, steps: 2, gradient_accumulation_steps: 1, warmup_steps: 0,\n"
        f"  data: {{files: ['{corpus / 'train.txt'}']}}}}\n"
        "export: {dtype: float32, roundtrip: false}\n")

    def weights(folder):
        out = {}
        for f in folder.glob("*.safetensors"):
            out.update(load_file(f))
        return out

    common = [str(base), "--recipe", str(recipe), "--set", "validate.enabled=false"]
    assert main(common + ["--output", str(tmp_path / "ft")]) == 0
    assert main(common + ["--output", str(tmp_path / "plain"), "--set", "finetune.enabled=false"]) == 0
    ft, plain = weights(tmp_path / "ft"), weights(tmp_path / "plain")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(ft[q], plain[q])
    assert torch.equal(ft["model.layers.0.mlp.up_proj.weight"], plain["model.layers.0.mlp.up_proj.weight"])
    assert (tmp_path / "ft" / "finetune" / "metrics.jsonl").exists()
    assert (tmp_path / "ft" / "adapter" / "adapter_model.safetensors").exists()
    assert "## Finetuning" in (tmp_path / "ft" / "README.md").read_text()
    assert not (tmp_path / "plain" / "finetune").exists()
    assert not (tmp_path / ".ft.work").exists()  # checkpoints removed after success


def test_non_finite_loss_stops_at_that_step_and_keeps_the_last_good_checkpoint(tmp_path, corpus):
    job = make_job(tmp_path, corpus, method="qkv", checkpoint_every=2, steps=6)
    layer = job.model.model.layers[0].mlp.down_proj

    def poison(step, record):  # from step 3 on, the model computes NaN (as a broken kernel would)
        if step == 2:
            with torch.no_grad():
                layer.weight.fill_(float("nan"))

    with pytest.raises(CCAError) as err:
        stage_finetune(job, on_step=poison)
    msg = str(err.value)
    assert "finetune stopped at step 3" in msg and "not finite" in msg and "attn_backend" in msg
    assert "step 2" in msg  # the checkpoint of step 2 is named and kept
    state = json.loads((job.work_dir / "finetune" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 2 and not state.get("finished")
    assert not (job.staging / "finetune").exists()


@pytest.mark.parametrize("schedule,at_end", [("cosine", 0.1), ("linear", 0.1), ("constant", 1.0)])
def test_lr_schedules_are_transformers_own_and_end_at_min_lr(schedule, at_end):
    from transformers import get_scheduler

    from cca_convert.finetune.config import FinetuneSection
    from cca_convert.finetune.trainer import SCHEDULES

    ft = FinetuneSection(lr_schedule=schedule, warmup_steps=4, steps=20, learning_rate=1e-3, min_lr_ratio=0.1)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=ft.lr)
    name, kwargs = SCHEDULES[schedule](ft)
    sched = get_scheduler(name, opt, num_warmup_steps=4, num_training_steps=20, scheduler_specific_kwargs=kwargs)
    lrs = []
    for _ in range(20):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert max(lrs) == pytest.approx(1e-3) and lrs.index(max(lrs)) in (3, 4)  # the peak ends the warmup
    assert lrs[:4] == sorted(lrs[:4]) and lrs[0] < 1e-3
    # the last step runs at the floor (cosine), or the schedule reaches it as it ends (linear, constant)
    assert min(lrs[-1], sched.get_last_lr()[0]) == pytest.approx(at_end * 1e-3, rel=1e-6)


def test_a_worker_rank_runs_only_up_to_the_finetune_and_writes_no_output(tmp_path, monkeypatch):
    """Under ``accelerate launch`` the non-main ranks join the stages up to the finetune and stop there: no lock,
    no staging folder, no export (rank 0 does those)."""
    from cca_convert import pipeline

    ran = []
    stages = [pipeline.Stage(n, lambda job, n=n: ran.append(n)) for n in
              ("convert", "preflight", "load", "baseline", "finetune", "validate", "export", "roundtrip")]
    monkeypatch.setattr(pipeline, "STAGES", stages)
    recipe = Recipe.model_validate({"finetune": {"enabled": True, "data": {"files": ["x.txt"]}}})
    job = Job(source="tiny", base_dir=tmp_path, output=tmp_path / "out", recipe=recipe, device="cpu")
    assert pipeline._run_worker(job) is None
    assert ran == ["convert", "load", "baseline", "finetune"]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_the_finetuned_model_in_memory_is_the_one_its_export_loads_as(tmp_path, corpus):
    """After a bf16 export's finetune the in-memory model (what the validation measures and the round trip's
    reference logits come from) has a clean load's dtypes: bf16 weights, RoPE's inv_freq kept in fp32 (``.to(bf16)``
    would round it, and the positions with it: at Llama-3.1-8B's shape the round trip then failed by 0.795)."""
    job = make_job(tmp_path, corpus, steps=2, checkpoint_every=100)
    job.config.dtype = torch.bfloat16  # the export's dtype (the tiny model itself loads in fp32)
    stage_finetune(job)
    model = job.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model.save_pretrained(tmp_path / "saved")
    clean = type(model).from_pretrained(tmp_path / "saved", dtype=torch.bfloat16).eval()
    assert {n: b.dtype for n, b in model.named_buffers()} == {n: b.dtype for n, b in clean.named_buffers()}
    assert any(b.dtype == torch.float32 for b in clean.buffers())  # (the check above is not vacuous)
    ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, clean(ids, use_cache=False).logits)
