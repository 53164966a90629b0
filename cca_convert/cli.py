"""``cca-convert``: convert a Hugging Face causal LM to CCA attention and export it as a Hub repo."""

from __future__ import annotations

import argparse
import difflib
import errno
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

from .argparsing import OneLineParser
from .errors import CCAError
from .families import FAMILIES

USAGE_EXAMPLES = """examples:
  cca-convert meta-llama/Llama-3.1-8B --output llama-3.1-8b-cca
  cca-convert examples/tiny-llama --recipe recipes/tiny-demo.yaml --output out/tiny-cca
  cca-convert ./my-model --set cca.group_size=8 --set cca.local_window=2048
  cca-convert meta-llama/Llama-2-7b-hf --set method=dca         # Dual Chunk Attention, training-free
  cca-convert meta-llama/Llama-2-7b-hf --set extend.factor=8     # 4K -> 32K context (RoPE stretched, finetuned)
  cca-convert meta-llama/Llama-3.1-8B --set finetune.method=full --gpus 4    # FSDP over 4 GPUs

other commands:
  cca-convert validate DIR_OR_REPO ...   re-run the validation of an exported model (see validate --help)
  cca-convert push DIR REPO ...          upload an exported folder to the Hub (see push --help)
  cca-convert serve DIR_OR_REPO ...      an OpenAI-compatible endpoint for an exported model (transformers serve)

supported families (config.json model_type: base models -> default recipe):
{families}

exit status: 0 done; 1 validation gates failed (validate) or an internal error; 2 bad input, or out of GPU
memory or disk (one `error:` line naming the fix, nothing written); 130 interrupted (Ctrl-C or SIGTERM; a
finetune resumes with --resume).
--debug (or CCA_DEBUG=1) shows the traceback of an error.
"""


def convert_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="cca-convert",
        description="Convert a Hugging Face causal LM to Core Context Aware attention (or, with --set method=dca, "
                    "Dual Chunk Attention) and export a complete Hub repo.",
        epilog=USAGE_EXAMPLES.format(families="\n".join(
            f"  {f.model_type:<12} {f.names} -> recipes/{f.recipe}" for f in FAMILIES.values())),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", metavar="SOURCE", help="Hub model id (org/name) or local model folder")
    p.add_argument("--version", action="version", version=f"cca-convert {_version()}")
    p.add_argument("--recipe", type=Path, help="YAML recipe (default: the shipped recipe of the model's family)")
    p.add_argument("--output", type=Path, help="output folder (default: ./<name>-cca, ./<name>-dca for method dca)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set cca.group_size=8 (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--revision", help="Hub revision (branch, tag or commit) of SOURCE")
    p.add_argument("--resume", action="store_true", help="continue an interrupted finetune from its last checkpoint")
    p.add_argument("--force", action="store_true", help="export (and push) even if a validation gate fails")
    p.add_argument("--gpus", type=int, metavar="N", help="run on N GPUs of this machine (accelerate launch with the "
                                                         "package's config; only rank 0 writes)")
    p.add_argument("--parallel", choices=("fsdp", "ddp"),
                   help="with --gpus: FSDP (sharded; any finetune method; the default) or DDP (replicated; LoRA / qkv)")
    from .publish import add_push_options

    add_push_options(p)
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cca-convert")
    except PackageNotFoundError:
        return "(source checkout)"


def default_output(source: str, method: str) -> Path:
    return Path(f"{Path(source.rstrip('/')).name}-{method}")


def run_convert(argv: list[str]) -> int:
    from .convert import read_base_config
    from .hub import resolve_source
    from .output_guard import check_output, data_files_of, protected_paths
    from .pipeline import Job, run_job
    from .recipe import load_recipe

    args = convert_parser().parse_args(argv)
    _check_flags(args)
    from .recipe import parse_overrides

    recipe = load_recipe(args.recipe, args.overrides)[0] if args.recipe else None
    from . import methods

    method = recipe.method if recipe else dict(parse_overrides(args.overrides)).get("method", methods.DEFAULT)
    output = args.output or default_output(args.source, method if method in methods.METHODS else methods.DEFAULT)
    local = Path(args.source).expanduser()
    # before any download; the pipeline checks again against the resolved source (a Hub id's cache folder)
    check_output(output, args.overwrite, protected_paths(local if local.exists() else None, args.recipe,
                                                         data_files_of(recipe) if recipe else ()))
    if args.push_to_hub:
        from .publish import preflight

        preflight(args.push_to_hub, revision=args.hub_revision, create_pr=args.create_pr)
    base_dir = resolve_source(args.source, args.revision)  # a Hub download happens once, here, before any launch
    if args.gpus and args.gpus > 1 and "LOCAL_RANK" not in os.environ:
        return _launch(argv, args.gpus, args.parallel or "fsdp")
    family = read_base_config(base_dir)["model_type"]
    if recipe is None:
        recipe, path = load_recipe(None, args.overrides, family)
        print(f"recipe: {path.name} (default for {family})")
    job = Job(source=args.source, base_dir=base_dir, output=output, recipe=recipe, overwrite=args.overwrite,
              resume=args.resume, force=args.force, push_to_hub=args.push_to_hub, private=args.private,
              hub_revision=args.hub_revision, create_pr=args.create_pr,
              command=shlex.join(["cca-convert", *(a for a in argv if a != "--debug")]))
    run_job(job)
    return 0


def _check_flags(args) -> None:
    """Flags that do nothing without another are refused, not ignored: the user meant something by them."""
    if args.gpus is not None and args.gpus < 1:
        raise CCAError(f"--gpus {args.gpus}: give the number of GPUs to use (1 or more)")
    if args.parallel and args.gpus is None:
        raise CCAError(f"--parallel {args.parallel} sets how several GPUs share the run: add --gpus N, or drop it")
    loose = [flag for flag, value in (("--private", args.private), ("--hub-revision", args.hub_revision),
                                      ("--create-pr", args.create_pr)) if value]
    if loose and not args.push_to_hub:
        raise CCAError(f"{' and '.join(loose)} only apply to an upload: add --push-to-hub REPO, or drop "
                       f"{'them' if len(loose) > 1 else 'it'} (`cca-convert push DIR REPO` uploads an existing export)")


def _launch(argv: list[str], gpus: int, parallel: str) -> int:
    import torch

    from . import launch

    available = torch.cuda.device_count()
    if available < gpus:
        raise CCAError(f"--gpus {gpus}: this machine has {available} CUDA GPU(s); use at most {available}")
    ranks_argv, skip = [], False
    for a in argv:  # the ranks get the same command without the launch options
        if skip:
            skip = False
        elif a in ("--gpus", "--parallel"):
            skip = True
        elif not a.startswith(("--gpus=", "--parallel=")):
            ranks_argv.append(a)
    return launch.run(launch.launcher_command(ranks_argv, gpus, parallel))


COMMANDS = {}  # subcommand name -> handler(argv) -> exit code; the default command is convert


def _validate(argv: list[str]) -> int:
    from .validate_command import run_validate

    return run_validate(argv)


def _push(argv: list[str]) -> int:
    from .publish import run_push

    return run_push(argv)


def _serve(argv: list[str]) -> int:
    from .serve import run_serve

    return run_serve(argv)


COMMANDS["validate"] = _validate
COMMANDS["push"] = _push
COMMANDS["serve"] = _serve


def _os_error_line(exc: OSError) -> str:
    """One line naming the path and the fix for the OS errors users meet (disk full, permissions, a file in the way)."""
    path = exc.filename or ""
    what = {
        errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
        errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
        errno.EEXIST: "a file is in the way", errno.ENOTDIR: "a file is in the way (not a folder)",
        errno.EROFS: "read-only file system", errno.ENOENT: "no such file or folder",
    }.get(exc.errno, exc.strerror or type(exc).__name__)
    fix = ("free space, or choose another --output" if exc.errno in (errno.ENOSPC, errno.EDQUOT)
           else "choose another --output or fix the path" if path else "check the paths of the run")
    return f"{what}{f': {path}' if path else ''}; {fix}. Nothing was written to the output folder"


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt  # same path as Ctrl-C: staging removed, message printed, checkpoint kept


def main(argv: list[str] | None = None) -> int:
    from .allocator import configure_allocator

    configure_allocator()  # before anything touches CUDA
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get("CCA_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    handler = COMMANDS.get(argv[0]) if argv else None
    if argv and handler is None and not argv[0].startswith("-") and not Path(argv[0]).expanduser().exists():
        near = difflib.get_close_matches(argv[0], list(COMMANDS), n=1, cutoff=0.75)
        if near and "/" not in argv[0]:
            print(f"error: unknown command {argv[0]!r}; did you mean `cca-convert {near[0]}`? "
                  "(a model SOURCE is a folder or a Hub id like org/name)", file=sys.stderr)
            return 2
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main_thread else None
    if previous == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        return _run(handler, argv, debug)
    finally:
        if previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, previous)


def _close_progress_bars() -> None:
    """Close every open tqdm bar, so that the `error:` line printed next is the last line on stderr (an open bar
    redraws its last frame after it when it is garbage-collected)."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ()) or ()):
        bar.close()


def _out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError, or the AcceleratorError a kernel launch raises when CUDA cannot allocate."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or (
        type(exc).__module__.startswith("torch") and "CUDA error: out of memory" in str(exc))


def _dispatch(handler, argv: list[str]) -> int:
    try:
        return handler(argv[1:]) if handler else run_convert(argv)
    except BaseException:
        _close_progress_bars()
        raise


def _run(handler, argv: list[str], debug: bool) -> int:
    try:
        return _dispatch(handler, argv)
    except CCAError as exc:
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"error: {line}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written to the output folder (an interrupted finetune resumes "
              "with --resume)", file=sys.stderr)
        return 130
    except OSError as exc:
        if debug:
            raise
        print(f"\nerror: {_os_error_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # parse errors of user files (safetensors, JSON...) and bugs: never a bare traceback
        if debug:
            raise
        first = (str(exc).strip().splitlines() or [""])[0]
        if _out_of_memory(exc):  # a resource, not a bug: say what to free or lower
            print(f"\nerror: the GPU ran out of memory ({type(exc).__name__}: {first}); free it (nvidia-smi lists the "
                  "processes holding it) or lower what the failing stage holds: finetune.micro_batch_size or "
                  "finetune.seq_len (raise finetune.gradient_accumulation_steps to keep the batch), "
                  "validate.batch_size or validate.context_lengths", file=sys.stderr)
            return 2
        for text, code in (("No space left on device", errno.ENOSPC), ("Permission denied", errno.EACCES)):
            if text in str(exc):  # e.g. safetensors' own error type when the disk fills up while writing a shard
                print(f"\nerror: {_os_error_line(OSError(code, text))} ({type(exc).__name__}: {first})", file=sys.stderr)
                return 2
        print(f"\nerror: {type(exc).__name__}: {first} (re-run with --debug or CCA_DEBUG=1 for the traceback; "
              "if the input looks right, please report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
