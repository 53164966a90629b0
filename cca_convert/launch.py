"""``cca-convert SOURCE --gpus N``: the same command on N GPUs of this machine, under ``accelerate launch`` with the
package's own config (``finetune/accelerate_fsdp.yaml``, or ``accelerate_ddp.yaml`` with ``--parallel ddp``).

Why not only ``accelerate launch`` by hand: its launcher (torchrun's agent) answers a signal by sending the same signal
to every rank and then exits 1 with a traceback, whatever the ranks did; a Ctrl-C in a terminal reaches the ranks
twice (once from the terminal, once forwarded), which a rank reads as "abort without a checkpoint". Here the launcher
runs in a session of its own, a first SIGINT/SIGTERM goes once to each rank (they finish the optimizer step, write a
resumable checkpoint together and stop), and the command exits 130 like a one-GPU run; a second one kills the launch.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

CONFIGS = {"fsdp": "accelerate_fsdp.yaml", "ddp": "accelerate_ddp.yaml"}


def launcher_command(argv: list[str], gpus: int, parallel: str) -> list[str]:
    """The ``accelerate launch`` command that runs ``cca-convert argv`` on ``gpus`` processes."""
    config = Path(__file__).resolve().parent / "finetune" / CONFIGS[parallel]
    with socket.socket() as s:  # a free port for the ranks' rendezvous (two launches may share a machine)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
            str(gpus), "--main_process_port", str(port), "-m", "cca_convert.cli", *argv]


def children(pid: int) -> list[int]:
    """The direct child processes of ``pid`` (Linux /proc): the ranks, for the launcher."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def run(command: list[str]) -> int:
    """Run a launcher command; see the module docstring for the signals. Returns the exit status: 130 when a signal
    stopped it (the ranks' checkpoint is resumable with --resume), else the launcher's."""
    proc = subprocess.Popen(command, start_new_session=True)
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        if len(received) == 1:
            ranks = children(proc.pid)  # none readable (no /proc): the launcher forwards the signal itself
            print(f"\n{signal.Signals(signum).name}: each of the {len(ranks) or 'launched'} ranks stops after this "
                  "optimizer step and writes a checkpoint (send it again to kill the launch without one)",
                  file=sys.stderr, flush=True)
            for pid in ranks or [proc.pid]:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        else:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:
        print("interrupted: re-run the same command with --resume to continue the finetune from its checkpoint",
              file=sys.stderr)
        return 130
    return code
