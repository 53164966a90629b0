"""Fault classes that need more than one command line to show: a damaged export under `validate`, foreign remote
code in the source's tokenizer, the round trip's child process and temp folder, the progress bar and the last line."""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from cca_convert import roundtrip
from cca_convert.cli import main
from tests.support.child_env import checkout_env
from tests.support.factories import save_base

REPO = Path(__file__).resolve().parents[1]
RECIPE = {"cca": {"group_size": 4, "local_window": 16}, "export": {"dtype": "float32", "roundtrip": False},
          "finetune": {"enabled": False}, "validate": {"enabled": False}}


@pytest.fixture
def base(tmp_path):
    return save_base(tmp_path / "base", max_position_embeddings=512)


def recipe(tmp_path, data=RECIPE) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_validate_names_a_truncated_shard_of_the_export(base, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(base), "--recipe", recipe(tmp_path), "--output", str(out)]) == 0
    shard = next(out.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    capsys.readouterr()
    assert main(["validate", str(out), "--device", "cpu"]) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and str(shard) in errors[0] and "not a readable safetensors file" in errors[0], errors


def test_foreign_tokenizer_auto_map_is_not_carried_into_the_export(base, tmp_path, capsys):
    config = json.loads((base / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTok", None]}
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    (base / "evil.py").write_text("import os  # code nobody reviewed with the export\n")
    out = tmp_path / "out"
    assert main([str(base), "--recipe", recipe(tmp_path), "--output", str(out)]) == 0
    exported = json.loads((out / "tokenizer_config.json").read_text())
    assert "auto_map" not in exported and not (out / "evil.py").exists()
    assert "auto_map named code this export does not ship; dropped (AutoTokenizer: ['evil.EvilTok', None])" in \
        capsys.readouterr().out
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out)("abc")["input_ids"]  # loads without remote code


def test_shipped_auto_map_entries_are_kept(tmp_path):
    from cca_convert.export import drop_foreign_auto_map

    (tmp_path / "tokenization_mine.py").write_text("")
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_mine.MyTok", None],
                                             "AutoProcessor": "other/repo--proc.P"}}))
    assert drop_foreign_auto_map(path) == ["AutoProcessor: other/repo--proc.P"]
    assert json.loads(path.read_text())["auto_map"] == {"AutoTokenizer": ["tokenization_mine.MyTok", None]}


def test_round_trip_temp_folders_of_killed_runs_are_removed_and_live_ones_kept():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Path(tempfile.mkdtemp(prefix=f"{roundtrip.TEMP_PREFIX}{dead.pid}-"))
    live = Path(tempfile.mkdtemp(prefix=f"{roundtrip.TEMP_PREFIX}{os.getppid()}-"))
    try:
        roundtrip.remove_dead_temp_folders()
        assert not stale.exists() and live.exists()
    finally:
        for p in (stale, live):
            if p.exists():
                p.rmdir()


def test_round_trip_failure_names_the_exception_not_cudas_advice():
    """A round trip that ran out of GPU memory says so: the exception's line, not the advice CUDA prints after it
    (which was all the CLI's error said: "... trust_remote_code: Compile with `TORCH_USE_CUDA_DSA` to ...")."""
    code = ("import warnings; warnings.warn('x: y')\n"
            "try:\n    raise KeyError('a')\nexcept KeyError:\n"
            "    raise RuntimeError('CUDA error: out of memory\\nCUDA kernel errors might be asynchronously reported'"
            " '\\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\\n')")
    stderr = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stderr
    assert stderr.strip().splitlines()[-1].startswith("Compile with")  # what the last line holds
    assert roundtrip.exception_line(stderr) == "RuntimeError: CUDA error: out of memory"
    assert roundtrip.exception_line("killed\n") == "killed" and roundtrip.exception_line("") == "no output"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_round_trip_child_dies_with_the_converter(tmp_path):
    """kill -9 of the converter (the child's parent) ends the round trip's child too: the loader asks the kernel for
    SIGKILL when its parent dies. Here a stand-in parent starts the real loader (on a folder that is not a model, and
    with a sleep in front, so it is still running) and is killed."""
    loader = "import time; time.sleep(30)\n"  # what the loader runs after its prelude
    prelude = roundtrip._LOADER.split("sys.meta_path")[0]  # the part that arms the parent-death signal
    script = tmp_path / "child.py"
    script.write_text(prelude + loader)
    parent = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, {str(script)!r}, 'a', 'b', 'c', 'd', str(os.getpid())])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(1.0)  # the child has armed the signal
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the round trip's child outlived its parent")


def test_sigterm_during_the_finetune_ends_with_the_error_as_the_last_line(base, tmp_path):
    """The progress bar is closed before the `error:` line: stderr's last line is the error, not the bar's frame."""
    text = tmp_path / "train.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 3000)
    data = {**RECIPE, "finetune": {"enabled": True, "method": "qkv", "seq_len": 128, "steps": 100000,
                                   "gradient_accumulation_steps": 1, "warmup_steps": 0, "checkpoint_every": 0,
                                   "tensorboard": False, "data": {"files": [str(text)]}}}
    out = tmp_path / "out"
    env = checkout_env(PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "cca_convert.cli", str(base), "--recipe", recipe(tmp_path, data),
                             "--output", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    for line in proc.stdout:
        if "steps x" in line:  # the loop has started
            break
    time.sleep(2.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    last = re.split(r"[\r\n]", err.strip())[-1]
    assert last.startswith("error: finetune interrupted (SIGTERM) after step"), err[-2000:]
    assert "--resume" in last and not out.exists()


def test_a_refused_run_keeps_an_earlier_runs_checkpoint_and_says_so(base, tmp_path, capsys):
    """The work folder of an interrupted finetune stays when a later run is refused, and the error names it."""
    checkpoint = tmp_path / ".out.work" / "finetune" / "checkpoint"
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text('{"step": 3}')
    assert main([str(base), "--recipe", recipe(tmp_path), "--output", str(tmp_path / "out"),
                 "--set", "cca.group_size=4096"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the model's context" in err
    assert f"the finetune checkpoint of an earlier run stays in {checkpoint.parent}" in err
    assert (checkpoint / "state.json").is_file()


def test_a_refused_run_leaves_no_work_folder(base, tmp_path, capsys):
    held = tmp_path / "held.txt"
    held.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    data = {**RECIPE, "validate": {"enabled": True, "data": {"files": [str(held)]}, "context_lengths": [64],
                                   "passkey_trials": 0, "speed": False, "max_ppl_ratio": 0.01}}
    assert main([str(base), "--recipe", recipe(tmp_path, data), "--output", str(tmp_path / "out")]) == 2
    assert "validation gates failed" in capsys.readouterr().err
    assert (tmp_path / ".out.work" / "validation").is_dir()  # a failed gate keeps the report it points to
    data["validate"]["context_lengths"] = [4096]
    import shutil

    shutil.rmtree(tmp_path / ".out.work")
    assert main([str(base), "--recipe", recipe(tmp_path, data), "--output", str(tmp_path / "out")]) == 2
    assert not (tmp_path / ".out.work").exists() and not (tmp_path / "out").exists()
