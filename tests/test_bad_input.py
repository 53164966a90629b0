"""Bad input, one row per class a user meets: the exit status, the `error:` line, and nothing left in or beside
the output. (Random recipes and `--set` values: tests/test_recipe.py.)"""

import json
import re
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from cca_convert.cli import main
from tests.support.factories import save_base, write_text

GOOD = {
    "cca": {"group_size": 4, "local_window": 16},
    "export": {"dtype": "float32", "roundtrip": False},
    "finetune": {"enabled": False},
    "validate": {"enabled": False},
}
FINETUNE = {"enabled": True, "seq_len": 64, "steps": 1, "gradient_accumulation_steps": 1, "warmup_steps": 0}
VALIDATE = {"enabled": True, "context_lengths": [64], "windows": 1, "passkey_trials": 0, "speed": False}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny base with a tokenizer, and data files: built once, copied by the rows that damage them."""
    root = tmp_path_factory.mktemp("bad-input")
    save_base(root / "base", max_position_embeddings=512)
    write_text(root / "train.txt", seed=0)
    write_text(root / "held.txt", seed=1)
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 40}) + "\n" for i in range(4)))
    (root / "broken.jsonl").write_text('{"text": "fine"}\n{"text": unquoted}\n')
    (root / "empty.txt").write_text("")
    (root / "short.txt").write_text("the lord spake unto moses saying\n")
    (root / "one.txt").write_text("a")
    (root / "numbers.jsonl").write_text('{"text": 5}\n{"text": 7}\n')
    (root / "data.csv").write_text("text\nhello\n")
    return root


def recipe_file(tmp_path: Path, data=None, text: str | None = None) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text if text is not None else yaml.safe_dump(data))
    return path


def with_sections(**sections) -> dict:
    data = json.loads(json.dumps(GOOD))
    for name, value in sections.items():
        data[name] = value
    return data


def copy_base(world: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "base"
    shutil.copytree(world / "base", dst)
    return dst


def edit_config(base: Path, **changes) -> None:
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(changes)
    (base / "config.json").write_text(json.dumps(cfg))


def damage_weights(base: Path, how: str) -> None:
    from safetensors.torch import load_file, save_file

    shard = next(base.glob("*.safetensors"))
    if how == "truncate":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif how == "garbage":
        shard.write_bytes(b"\xff" * 64)
    elif how == "pickle":  # the same weights as a .bin checkpoint
        import torch

        torch.save(load_file(shard), base / "pytorch_model.bin")
        shard.unlink()
    else:
        tensors = load_file(shard)
        if how == "nan":
            tensors["model.layers.0.mlp.up_proj.weight"][0, 0] = float("inf")
        elif how == "missing":
            del tensors["model.layers.1.self_attn.v_proj.weight"]
        save_file(tensors, shard, metadata={"format": "pt"})


# Each row: (setup(world, tmp_path) -> argv after SOURCE... as a full argv list, exit code, regex of the error line).
def _argv(base, recipe, out, *extra):
    return [str(base), "--recipe", str(recipe), "--output", str(out), *extra]


def row_recipe_text(text):
    return lambda w, t: _argv(w / "base", recipe_file(t, text=textwrap.dedent(text)), t / "out")


def row_recipe(data, *extra):
    return lambda w, t: _argv(w / "base", recipe_file(t, data), t / "out", *extra)


def row_set(*pairs):
    return lambda w, t: _argv(w / "base", recipe_file(t, GOOD), t / "out", *[x for p in pairs for x in ("--set", p)])


def row_base(mutate, *extra, data=None):
    def make(w, t):
        base = copy_base(w, t)
        mutate(base)
        return _argv(base, recipe_file(t, data or GOOD), t / "out", *extra)
    return make


def row_files(section: str, spec: dict, validate: bool = False):
    """A data row; ``validate``: the held-out text is good too, so a late refusal would come after a baseline (and
    leave a work folder): the refusal must come from the preflight."""
    def make(w, t):
        data = {k: [f.format(w=w) for f in v] if k == "files" else v for k, v in spec.items()}
        body = {**(FINETUNE if section == "finetune" else VALIDATE), "data": data}
        sections = {section: body}
        if validate:
            sections["validate"] = {**VALIDATE, "data": {"files": [str(w / "held.txt")]}}
        return _argv(w / "base", recipe_file(t, with_sections(**sections)), t / "out")
    return make


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def row_output(prepare):
    def make(w, t):
        out = prepare(t)
        return _argv(w / "base", recipe_file(t, GOOD), out)
    return make


def _locked(t):
    from cca_convert.export import OutputLock

    lock = OutputLock(t / "out").__enter__()
    _locked.held.append(lock)
    return t / "out"


_locked.held = []


def _nonempty(t):
    (t / "out").mkdir()
    (t / "out" / "keep.txt").write_text("x")
    return t / "out"


def _file_out(t):
    (t / "out").write_text("x")
    return t / "out"


def _file_parent(t):
    (t / "parent").write_text("x")
    return t / "parent" / "out"


ROWS = {
    # recipe
    "yaml-syntax": (row_recipe_text("cca:\n  group_size: [4\n"), 2, r"malformed YAML"),
    "unknown-key": (row_recipe_text("cca:\n  gruop_size: 4\n"), 2, r"r.yaml:2: cca.gruop_size: unknown key"),
    "wrong-type": (row_recipe_text("cca:\n  local_window: lots\n"), 2, r"cca.local_window"),
    "recipe-is-a-list": (row_recipe_text("- 1\n- 2\n"), 2, r"recipe"),
    "recipe-missing": (lambda w, t: _argv(w / "base", t / "nope.yaml", t / "out"), 2, r"recipe file not found"),
    "g-zero": (row_set("cca.group_size=0"), 2, r"cca.group_size"),
    "g-negative": (row_set("cca.group_size=-3"), 2, r"cca.group_size"),
    "g-fractional": (row_set("cca.group_size=2.5"), 2, r"cca.group_size"),
    "g-overflow": (row_set("cca.group_size=99999999999999999999"), 2, r"cca.group_size=\d+ exceeds the model's context"),
    "g-beyond-context": (row_set("cca.group_size=4096"), 2, r"exceeds the model's context \(max_position_embeddings=512\)"),
    "pooling-unknown": (row_set("cca.pooling=mean"), 2, r"cca.pooling"),
    "set-no-equals": (row_set("cca.group_size"), 2, r"--set expects KEY=VALUE"),
    "set-empty-value": (row_set("cca.group_size="), 2, r"--set cca.group_size= has no value"),
    "set-bad-key": (row_set("1cca=3"), 2, r"--set expects KEY=VALUE"),
    "set-unknown-key": (row_set("cca.gruop=3"), 2, r"cca.gruop: unknown key"),
    "set-unknown-section": (row_set("nonsense.key=1"), 2,
                            r"^error: --set nonsense.key=1: nonsense: unknown key; known keys here: method, cca"),
    "set-unknown-nested-section": (row_set("validate.data.nonsense.x=1"), 2,
                                   r"^error: --set validate.data.nonsense.x=1: validate.data.nonsense: unknown key"),
    "set-list-item-non-finite": (row_set("finetune.adam_betas=[0.9,nan]"), 2,
                                 r"^error: --set finetune.adam_betas=\[0.9,nan\]: finetune.adam_betas.1: .*finite"),
    "list-item-non-finite": (row_recipe_text("finetune:\n  adam_betas: [0.9, .nan]\n"), 2,
                             r"r.yaml:2: finetune.adam_betas.1: .*finite"),
    "triton-on-cpu": (row_set("cca.attn_backend=triton"), 2, r"attn_backend=triton needs a CUDA GPU"),
    "roundtrip-too-long": (row_set("export.roundtrip=true", "export.roundtrip_tokens=4000"), 2,
                           r"export.roundtrip_tokens=4000 exceeds the context"),
    "shard-size-syntax": (row_set("export.max_shard_size=lots"), 2, r"export.max_shard_size"),
    # source
    "source-missing": (lambda w, t: _argv(t / "nope", recipe_file(t, GOOD), t / "out"), 2, r"no such folder"),
    "source-not-a-model": (lambda w, t: (t / "empty").mkdir() or _argv(t / "empty", recipe_file(t, GOOD), t / "out"),
                           2, r"has no config.json"),
    "source-is-a-file": (lambda w, t: _argv(w / "train.txt", recipe_file(t, GOOD), t / "out"), 2, r"is a file"),
    "unsupported-arch": (row_base(lambda b: edit_config(b, model_type="gpt2")), 2, r"unsupported architecture"),
    "config-not-json": (row_base(lambda b: (b / "config.json").write_text("{nope")), 2, r"is not valid JSON"),
    "softcapped-logits": (row_base(lambda b: edit_config(b, attn_logit_softcapping=50.0)), 2,
                          r"attn_logit_softcapping=50.0: the CCA kernels do not cap logits"),
    "multimodal-without-text-config": (row_base(lambda b: edit_config(b, model_type="gemma3", text_config=None)), 2,
                                       r"a multimodal gemma3 config without a text_config object"),
    "refused-family": (row_base(lambda b: edit_config(b, model_type="gemma2")), 2,
                       r"model_type='gemma2' is not supported: it caps attention logits"),
    "weights-truncated": (row_base(lambda b: damage_weights(b, "truncate")), 2, r"not a readable safetensors file"),
    "weights-garbage": (row_base(lambda b: damage_weights(b, "garbage")), 2, r"not a readable safetensors file"),
    "weights-bin-only": (row_base(lambda b: damage_weights(b, "pickle")), 2,
                         r"has no \*\.safetensors weights .*save_pretrained\(DST\).*pass DST"),
    "weights-non-finite": (row_base(lambda b: damage_weights(b, "nan")), 2, r"up_proj.weight holds 1 non-finite"),
    "weights-missing-tensor": (row_base(lambda b: damage_weights(b, "missing")), 2, r"v_proj"),
    "weights-wrong-shape": (row_base(lambda b: edit_config(b, num_key_value_heads=4)), 2, r"k_proj.weight has shape"),
    "no-safetensors": (row_base(lambda b: [p.unlink() for p in b.glob("*.safetensors")]), 2, r"no \*.safetensors"),
    "no-tokenizer": (row_base(lambda b: [p.unlink() for p in b.glob("tok*")]), 2, r"no tokenizer files.*require_tokenizer"),
    "no-tokenizer-validate": (row_base(lambda b: [p.unlink() for p in b.glob("tok*")],
                                       data=with_sections(validate={**VALIDATE, "data": {"files": ["x.txt"]}})),
                              2, r"no tokenizer files, which validation needs: add them"),
    "revision-on-folder": (lambda w, t: _argv(w / "base", recipe_file(t, GOOD), t / "out", "--revision", "v1"),
                           2, r"--revision applies to Hub model ids"),
    # output
    "output-not-empty": (row_output(_nonempty), 2, r"exists and is not empty; pass --overwrite"),
    "output-is-a-file": (row_output(_file_out), 2, r"exists and is not a folder"),
    "output-parent-is-a-file": (row_output(_file_parent), 2, r"(a file is in the way|is a file, not a folder)"),
    "output-locked": (row_output(_locked), 2, r"another cca-convert run is writing"),
    # finetune data
    "ft-file-missing": (row_files("finetune", {"files": ["{w}/nope.txt"]}), 2, r"finetune.data.files: file not found"),
    "ft-glob-empty": (row_files("finetune", {"files": ["{w}/*.none"]}), 2, r"finetune.data.files: no file matches"),
    "ft-jsonl-broken": (row_files("finetune", {"files": ["{w}/broken.jsonl"]}), 2, r"finetune.data: cannot load .*"),
    "ft-text-field": (row_files("finetune", {"files": ["{w}/docs.jsonl"], "text_field": "body"}), 2,
                      r"finetune.data.text_field: .* no column 'body'"),
    "ft-extension": (row_files("finetune", {"files": ["{w}/data.csv"]}), 2, r"cannot tell the format"),
    "ft-no-data": (row_recipe(with_sections(finetune={"enabled": True})), 2, r"finetune.enabled needs data"),
    "ft-seq-len": (lambda w, t: _argv(w / "base", recipe_file(t, with_sections(finetune={
        **FINETUNE, "seq_len": 4096, "data": {"files": [str(w / "train.txt")]}})), t / "out"), 2,
                   r"finetune.seq_len=4096 exceeds the model's max_position_embeddings=512"),
    # held-out data
    "val-file-missing": (row_files("validate", {"files": ["{w}/nope.txt"]}), 2, r"validate.data.files: file not found"),
    "val-empty": (row_files("validate", {"files": ["{w}/empty.txt"]}), 2, r"validate.data"),
    "val-too-short": (lambda w, t: _argv(w / "base", recipe_file(t, with_sections(validate={
        **VALIDATE, "context_lengths": [512], "data": {"files": [str(w / "short.txt")]}})), t / "out"),
        2, r"(fewer|shorter|not enough|window)"),
    "val-no-data": (row_recipe(with_sections(validate={**VALIDATE})), 2, r"validate.data: give held-out text"),
    "val-beyond-context": (row_recipe(with_sections(validate={**VALIDATE, "context_lengths": [1024],
                                                              "data": {"files": ["x.txt"]}})), 2,
                           r"validate.context_lengths \[1024\] exceed the model's context"),
    "recipe-binary": (lambda w, t: (_write(t / "r.yaml", b"\x89PNG\r\n\x1a\n\x00\x00"),
                                    _argv(w / "base", t / "r.yaml", t / "out"))[1],
                      2, r"r.yaml: not a UTF-8 text file \(byte 0x89"),
    "g-bool": (row_set("cca.group_size=true"), 2, r"cca.group_size: expects a number, not true"),
    "theta-inf": (row_set("cca.rope_theta=.inf"), 2, r"cca.rope_theta: Input should be a finite number"),
    "theta-nan": (row_set("cca.rope_theta=.nan"), 2, r"cca.rope_theta: Input should be a finite number"),
    "steps-1e20": (row_set("finetune.steps=1e20"), 2, r"finetune.steps"),
    "steps-beyond-bound": (row_set("finetune.steps=100000000000"), 2,
                           r"finetune.steps: Input should be less than or equal to 10000000"),
    "ppl-gate-inf": (row_set("validate.max_ppl_ratio=.inf"), 2, r"validate.max_ppl_ratio: Input should be a finite"),
    "val-binary": (lambda w, t: (_write(t / "held.bin.txt", bytes(range(256)) * 8), _argv(
        w / "base", recipe_file(t, with_sections(validate={**VALIDATE, "data": {"files": [str(t / "held.bin.txt")]}})),
        t / "out"))[1], 2, r"validate.data.files: .*held.bin.txt is not UTF-8 text \(byte 0x80 at offset 128\)"),
    "ft-empty-file": (row_files("finetune", {"files": ["{w}/empty.txt"]}, validate=True), 2,
                      r"finetune.data: .*empty.txt is empty"),
    "ft-one-token": (row_files("finetune", {"files": ["{w}/one.txt"]}, validate=True), 2,
                     r"finetune.data: .*one.txt has \d+ tokens, fewer than one finetune.seq_len=64 block"),
    "ft-shorter-than-seq-len": (row_files("finetune", {"files": ["{w}/short.txt"]}, validate=True), 2,
                                r"fewer than one finetune.seq_len=64 block"),
    "ft-jsonl-numbers": (row_files("finetune", {"files": ["{w}/numbers.jsonl"]}, validate=True), 2,
                         r"finetune.data.text_field: column 'text' holds int values, not text"),
    # command line
    "no-source": (lambda w, t: [], 2, r"(SOURCE|required)"),
    "mistyped-command": (lambda w, t: ["valdate", str(t / "x")], 2, r"unknown command 'valdate'; did you mean"),
    "parallel-without-gpus": (lambda w, t: _argv(w / "base", recipe_file(t, GOOD), t / "out", "--parallel", "ddp"), 2,
                              r"--parallel ddp sets how several GPUs share the run: add --gpus N"),
    "hub-flags-without-push": (lambda w, t: _argv(w / "base", recipe_file(t, GOOD), t / "out", "--private",
                                                  "--create-pr"), 2,
                               r"--private and --create-pr only apply to an upload: add --push-to-hub REPO"),
    "unknown-flag": (lambda w, t: _argv(w / "base", recipe_file(t, GOOD), t / "out", "--frobnicate"), 2,
                     r"unrecognized arguments"),
}


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if any(m in p.name for m in (".partial-", ".old-", ".lock", ".work")))


@pytest.mark.parametrize("case", list(ROWS))
def test_bad_input_is_one_error_line_and_leaves_nothing(case, world, tmp_path, capsys, monkeypatch):
    if case == "triton-on-cpu":  # a user's CPU, not the test interpreter; only this row (triton 3.9's Gluon import
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # asserts when the interpreter flag flips mid-process)
    monkeypatch.chdir(tmp_path)
    setup, code, pattern = ROWS[case]
    argv = setup(world, tmp_path)
    out_existed = (tmp_path / "out").exists()
    before = sorted(p.name for p in (tmp_path / "out").iterdir()) if (tmp_path / "out").is_dir() else None
    try:
        assert main(argv) == code
    except SystemExit as exc:  # argparse's own exits (our parser prints one line and exits 2)
        assert exc.code == code
    finally:
        for lock in _locked.held:
            lock.__exit__(None, None, None)
        _locked.held.clear()
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, err[-2000:]
    assert re.search(pattern, errors[0]), errors[0]
    assert "Traceback" not in err
    if not out_existed:
        assert not (tmp_path / "out").exists()
    elif before is not None:
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before
    assert leftovers(tmp_path) == []


def test_several_problems_are_reported_at_once(world, tmp_path, capsys):
    base = copy_base(world, tmp_path)
    [p.unlink() for p in base.glob("tok*")]
    data = with_sections(cca={"group_size": 4096, "local_window": 16},
                         finetune={**FINETUNE, "data": {"files": [str(world / "nope.txt")]}})
    assert main(_argv(base, recipe_file(tmp_path, data), tmp_path / "out")) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    text = "\n".join(errors)
    assert len(errors) >= 3 and "group_size=4096" in text and "no tokenizer" in text and "nope.txt" in text


def test_debug_shows_the_traceback(world, tmp_path, capsys, monkeypatch):
    base = copy_base(world, tmp_path)
    argv = _argv(base, recipe_file(tmp_path, GOOD), tmp_path / "out")
    from cca_convert import pipeline

    def boom(job):
        raise RuntimeError("simulated bug")

    stages = [pipeline.Stage(s.name, boom if s.name == "load" else s.run, s.enabled, s.after_commit)
              for s in pipeline.STAGES]
    monkeypatch.setattr(pipeline, "STAGES", stages)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "error: RuntimeError: simulated bug (re-run with --debug" in err and "Traceback" not in err
    with pytest.raises(RuntimeError, match="simulated bug"):
        main(argv + ["--debug"])
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("error", ["oom", "launch"])
def test_out_of_gpu_memory_is_one_line_naming_the_fix(world, tmp_path, capsys, monkeypatch, error):
    """Running out of GPU memory is the machine's limit, not a bug to report: exit 2, the recipe keys that lower it,
    nothing written."""
    base = copy_base(world, tmp_path)
    argv = _argv(base, recipe_file(tmp_path, GOOD), tmp_path / "out")
    from cca_convert import pipeline

    def full(job):
        if error == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                         "of 79.19 GiB of which 1.06 GiB is free.")
        raise torch.AcceleratorError("CUDA error: out of memory\nCompile with `TORCH_USE_CUDA_DSA` to enable ...")

    stages = [pipeline.Stage(s.name, full if s.name == "load" else s.run, s.enabled, s.after_commit)
              for s in pipeline.STAGES]
    monkeypatch.setattr(pipeline, "STAGES", stages)
    assert main(argv) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: the GPU ran out of memory (")
    assert "out of memory" in errors[0].split("(", 1)[1] and "finetune.micro_batch_size" in errors[0]
    assert "report" not in errors[0] and "TORCH_USE_CUDA_DSA" not in errors[0]
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_disk_full_while_writing_is_one_line_exit_2(world, tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError

    from cca_convert import export

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                              "\"No space left on device\" })")

    monkeypatch.setattr(export, "save_file", full)
    argv = _argv(world / "base", recipe_file(tmp_path, GOOD), tmp_path / "out")
    assert main(argv) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and re.match(rf"error: the disk of {re.escape(str(tmp_path))} filled up while writing the "
                                         r"weights: [\d.]+ GiB free, the export needs about [\d.]+ GiB", errors[0])
    assert "--output" in errors[0]
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_unwritable_output_parent_is_one_line_exit_2(world, tmp_path, capsys, monkeypatch):
    """EACCES as a non-root user meets it (root may write anywhere, so the OS error is simulated where it is raised)."""
    from cca_convert import export

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self.path))

    monkeypatch.setattr(export.Staging, "__enter__", denied)
    assert main(_argv(world / "base", recipe_file(tmp_path, GOOD), tmp_path / "out")) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: permission denied: ") and ".out.partial-" in errors[0]
    assert not (tmp_path / "out").exists()
