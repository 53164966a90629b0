"""``cca-convert --gpus N``: the launcher runs in a session of its own and a signal reaches each rank once; the command
exits 130. Here the launcher is a stand-in that behaves as torchrun's agent does (it forwards every signal it gets to
its ranks and exits 1 when a rank fails); the ranks stand in for the trainer (a SIGTERM: finish the step, write the
checkpoint, exit 130). The real launch on 2 GPUs is tests/finetune/test_multigpu.py."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cca_convert import launch
from cca_convert.cli import main
from tests.support.factories import save_base

RANK = textwrap.dedent("""
    import pathlib, signal, sys, time
    out, rank = pathlib.Path(sys.argv[1]), sys.argv[2]
    got = []
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    signal.signal(signal.SIGINT, lambda s, f: got.append(s))
    (out / f"ready{rank}").write_text("")
    deadline = time.time() + 60
    while not got and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(0.5)  # the optimizer step ends, then the checkpoint
    (out / f"checkpoint{rank}").write_text(",".join(signal.Signals(s).name for s in got))
    sys.exit(130 if got else 0)
""")
LAUNCHER = textwrap.dedent("""
    import signal, subprocess, sys
    ranks = [subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2], str(i)]) for i in range(2)]
    def forward(signum, frame):  # what torchrun's agent does with a signal: every rank gets it
        for r in ranks:
            r.send_signal(signum)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    sys.exit(1 if any(r.wait() for r in ranks) else 0)
""")


def _start(tmp_path):
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    command = [sys.executable, str(tmp_path / "launcher.py"), str(tmp_path / "rank.py"), str(tmp_path)]
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from cca_convert import launch; "
                             f"sys.exit(launch.run({command!r}))"], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)) and time.time() < deadline:
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_reaches_each_rank_once_and_the_command_exits_130(tmp_path, sig):
    proc = _start(tmp_path)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    # each rank got exactly one SIGTERM (not the launcher's forwarded copy too) and wrote its checkpoint
    assert [(tmp_path / f"checkpoint{i}").read_text() for i in range(2)] == ["SIGTERM", "SIGTERM"]
    assert "each of the 2 ranks stops after this optimizer step" in err and "--resume" in err


def test_a_second_signal_kills_the_launch(tmp_path):
    proc = _start(tmp_path)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert not any((tmp_path / f"checkpoint{i}").exists() for i in range(2))  # killed before their checkpoint


def test_without_a_signal_the_launchers_status_is_the_commands(tmp_path):
    (tmp_path / "fail.py").write_text("import sys; sys.exit(3)")
    assert launch.run([sys.executable, str(tmp_path / "fail.py")]) == 3


def test_the_launch_command_is_accelerate_with_the_packages_config():
    cmd = launch.launcher_command(["BASE", "--recipe", "r.yaml"], 4, "ddp")
    assert cmd[1:4] == ["-m", "accelerate.commands.launch", "--config_file"]
    assert Path(cmd[4]).name == "accelerate_ddp.yaml" and Path(cmd[4]).is_file()
    assert cmd[cmd.index("--num_processes") + 1] == "4"
    assert cmd[-5:] == ["-m", "cca_convert.cli", "BASE", "--recipe", "r.yaml"]


@pytest.mark.parametrize("gpus,expect", [("0", "give the number of GPUs"), ("2", "CUDA GPU(s); use at most")])
def test_gpus_beyond_the_machine_is_one_clear_error(tmp_path, capsys, gpus, expect):
    import torch

    if gpus == "2" and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 GPUs")
    base = save_base(tmp_path / "base", family="llama")
    assert main([str(base), "--output", str(tmp_path / "out"), "--gpus", gpus]) == 2
    assert expect in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
