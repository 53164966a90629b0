"""Several GPUs through the CLI under ``accelerate launch`` (``make test-multigpu``; skipped below 2 GPUs).

Every run is the real command a user types: ``accelerate launch --config_file cca_convert/finetune/accelerate_*.yaml
--num_processes 2 -m cca_convert.cli BASE ...``, on tiny checkpoints of three families (Llama; Qwen3-MoE; Gemma 3
with mixed sliding and global layers)."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.child_env import checkout_env
from tests.support.factories import family_and_overrides, save_base

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.multigpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]
CONFIGS = {"fsdp": REPO / "cca_convert/finetune/accelerate_fsdp.yaml",
           "ddp": REPO / "cca_convert/finetune/accelerate_ddp.yaml"}
DATA = REPO / "examples/data/finetune.txt"


def recipe_args(method: str, steps: int = 4, ga: int = 1, checkpoint_every: int = 0, validate=False) -> list[str]:
    sets = {"finetune.method": method, "finetune.steps": steps, "finetune.gradient_accumulation_steps": ga,
            "finetune.seq_len": 256, "finetune.warmup_steps": 0, "finetune.checkpoint_every": checkpoint_every,
            "finetune.data": f"{{files: [{DATA}], split_on: null}}", "finetune.tensorboard": "false",
            "cca.local_window": 32, "validate.enabled": str(validate).lower(), "export.roundtrip": "false"}
    return ["--recipe", str(REPO / "recipes/tiny-demo.yaml")] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def launch(kind: str | None, base: Path, out: Path, args: list[str], processes: int = 2, **popen):
    if kind is None:  # one process, one GPU: the plain CLI
        cmd = [sys.executable, "-m", "cca_convert.cli"]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS[kind]),
               "--num_processes", str(processes), "--main_process_port", str(29500 + os.getpid() % 1000),
               "-m", "cca_convert.cli"]
    env = checkout_env(PYTHONUNBUFFERED="1")
    full = cmd + [str(base), "--output", str(out), *args]
    if popen:
        return subprocess.Popen(full, cwd=out.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, **popen)
    return subprocess.run(full, cwd=out.parent, env=env, capture_output=True, text=True, timeout=600)


def losses(out: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (out / "finetune" / "metrics.jsonl").read_text().splitlines()]


def weights(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    out = {}
    for family in ("llama", "qwen3_moe", "gemma3_text"):
        fam, overrides = family_and_overrides(family)
        out[family] = save_base(root / family, fam, **overrides)
    return out


CASES = [("fsdp", family, method) for family in ("llama", "qwen3_moe", "gemma3_text") for method in ("full", "qkv", "lora")]
CASES += [("ddp", "llama", "lora"), ("ddp", "llama", "qkv")]


@pytest.mark.parametrize("kind,family,method", CASES, ids=["-".join(c) for c in CASES])
def test_two_gpus_through_the_cli_and_only_rank_0_writes(kind, family, method, bases, tmp_path):
    out = tmp_path / "out"
    proc = launch(kind, bases[family], out, recipe_args(method))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 process(es)" in proc.stdout, proc.stdout[-2000:]
    assert len(losses(out)) == 4 and all(math.isfinite(x) for x in losses(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no second output, staging or work folder
    assert (out / "config.json").is_file() and weights(out)


def test_one_gpu_and_two_gpus_at_the_same_global_batch_give_the_same_losses(bases, tmp_path):
    """1 process x 2 accumulated micro-batches against 2 processes x 1: the same sequences in every step (the data
    order is a function of the global micro-batch index), the same mean loss; only the order of the sums differs
    (all-reduce vs local accumulation) under bf16 autocast, so the curves agree to bf16 rounding, not bits."""
    one = launch(None, bases["llama"], tmp_path / "one", recipe_args("full", steps=8, ga=2))
    two = launch("ddp", bases["llama"], tmp_path / "two", recipe_args("full", steps=8, ga=1))
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    print("\n| step | 1 GPU (ga 2) | 2 GPUs (ga 1) |\n|---|---|---|")
    for i, (x, y) in enumerate(zip(a, b), 1):
        print(f"| {i} | {x:.5f} | {y:.5f} |")
    print(f"max relative difference {worst:.2e}")
    assert len(a) == len(b) == 8
    assert worst < 5e-3  # bf16 has 8 mantissa bits (3.9e-3 relative); the loss itself is reduced in fp32


def test_kill_9_mid_finetune_then_resume_gives_the_uninterrupted_weights(bases, tmp_path):
    args = recipe_args("qkv", steps=300, checkpoint_every=50)
    (tmp_path / "a").mkdir()
    straight = launch("ddp", bases["llama"], tmp_path / "a" / "out", args)
    assert straight.returncode == 0, straight.stderr[-3000:]
    (tmp_path / "b").mkdir()
    out = tmp_path / "b" / "out"
    proc = launch("ddp", bases["llama"], out, args, start_new_session=True)
    state = tmp_path / "b" / ".out.work" / "finetune" / "checkpoint" / "state.json"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if state.is_file() and json.loads(state.read_text())["step"] >= 50:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed: " + proc.stdout.read()[-2000:]
    # kill -9 of the whole job: the launcher's group, and its workers, which torch's elastic agent starts in sessions
    # of their own (killing the launcher alone leaves them training on, orphaned, and they would finish the export)
    os.killpg(proc.pid, signal.SIGKILL)
    subprocess.run(["pkill", "-KILL", "-f", str(out)], check=False)
    proc.wait()
    time.sleep(1)
    killed_at = json.loads(state.read_text())["step"]
    assert not out.exists() and 50 <= killed_at < 300
    resumed = launch("ddp", bases["llama"], out, args + ["--resume"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    same = weights(out) == weights(tmp_path / "a" / "out")
    print(f"\nkilled after checkpoint step {killed_at}; resumed weights bit-identical to the uninterrupted run: {same}")
    assert same


def test_sigterm_on_two_gpus_exits_130_then_resume_gives_the_uninterrupted_weights(bases, tmp_path):
    """``cca-convert --gpus 2``: one SIGTERM to the command reaches each rank once; they finish the step, write the
    checkpoint together, and the command exits 130; ``--resume`` then ends with the weights of a straight run."""
    args = recipe_args("qkv", steps=200, checkpoint_every=0) + ["--gpus", "2", "--parallel", "ddp"]
    (tmp_path / "a").mkdir()
    straight = launch(None, bases["llama"], tmp_path / "a" / "out", args)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    (tmp_path / "b").mkdir()
    out = tmp_path / "b" / "out"
    proc = launch(None, bases["llama"], out, args, start_new_session=True)
    metrics = tmp_path / "b" / ".out.work" / "finetune" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before the signal: " + proc.stdout.read()[-2000:]
    proc.send_signal(signal.SIGTERM)
    printed = proc.communicate(timeout=300)[0]
    state = json.loads((tmp_path / "b" / ".out.work" / "finetune" / "checkpoint" / "state.json").read_text())
    print(f"\nSIGTERM: exit {proc.returncode}, checkpoint at step {state['step']}")
    assert proc.returncode == 130, printed[-3000:]
    assert 3 <= state["step"] < 200 and not out.exists()
    resumed = launch(None, bases["llama"], out, args + ["--resume"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert weights(out) == weights(tmp_path / "a" / "out")
