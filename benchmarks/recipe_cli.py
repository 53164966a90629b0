#!/usr/bin/env python3
"""The CLI with a shipped recipe's defaults at a released model's real shape: does the whole run (convert, preflight,
load, validate, export, round trip) fit one GPU, which lengths does it validate, and how long does each take.

A random bf16 checkpoint of the released config (``recipes_at_scale.MODELS``) is written with the embedded model's
tokenizer (its ids lie inside every released vocabulary), then ``cca-convert FOLDER --set method=M`` runs as a user
types it, with only a local text file as held-out data (no download). Random weights prove memory and time, never
quality: the quality gates are expected to fail, so the run passes ``--force`` (export and round trip despite them);
what this checks is that no stage runs out of memory or refuses, and what the validation costs at each length.

    python benchmarks/recipe_cli.py --row llama-3.1-8b --method dca --json out.json
    python benchmarks/recipe_cli.py --tiny --row llama-3.1-8b --method dca    # CPU, tiny shape (tests run this)
    python benchmarks/recipe_cli.py --row llama-3.1-8b -- --set 'validate.context_lengths=[262144]'   # more CLI args
    python benchmarks/recipe_cli.py --row gemma3-12b --multimodal --method cca   # as google/gemma-3-12b-pt ships

``--multimodal`` writes the row's release as the Hub holds it: the language model, the released vision tower and
projector (``Gemma3ForConditionalGeneration``), under the Hub's tensor names (``language_model.model.*``,
``vision_tower.*``, ``multi_modal_projector.*``, no ``lm_head`` where tied): what ``cca-convert google/gemma-3-12b-pt``
reads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import huggingface_hub  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from recipes_at_scale import MODELS, TINY  # noqa: E402

TOKENIZER = REPO / "examples" / "tiny-llama"

# rows released as a multimodal checkpoint: its config class, the released vision tower and projector fields (the
# model's public config.json), and the tiny shape's; the image token ids lie past the text, as released
MULTIMODAL = {
    "gemma3-12b": ("Gemma3Config",
                   dict(vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
                                           num_hidden_layers=27, num_attention_heads=16, image_size=896,
                                           patch_size=14, vision_use_head=False),
                        mm_tokens_per_image=256, boi_token_index=255999, eoi_token_index=256000,
                        image_token_index=262144),
                   dict(vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
                                           vision_use_head=False),
                        mm_tokens_per_image=4, boi_token_index=4093, eoi_token_index=4094, image_token_index=4095)),
}
# transformers >= 4.52's names in memory -> the Hub's (the checkpoints were written by transformers 4.50)
HUB_NAMES = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
             ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."))


def hub_name(name: str) -> str:
    for old, new in HUB_NAMES:
        if name.startswith(old):
            return new + name[len(old):]
    raise ValueError(f"no Hub name for {name!r}")


def write_checkpoint(row: str, folder: Path, tiny: bool, device: str, multimodal: bool = False) -> None:
    family, fields = MODELS[row]
    if tiny:  # the tokenizer's 4096 ids; a trained context of 64 so that c..8c stays short on a CPU
        fields = {**fields, **TINY, "vocab_size": 4096, "max_position_embeddings": 64, "dtype": "float32"}
        fields.update(bos_token_id=0, eos_token_id=1, pad_token_id=None)
        if isinstance(fields.get("rope_parameters"), dict) and fields["rope_parameters"].get("rope_type") == "llama3":
            fields["rope_parameters"] = {**fields["rope_parameters"], "original_max_position_embeddings": 16}
        if "layer_types" in fields:  # a 5:1 local/global pattern at 2 layers: one of each
            fields.update(layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    config = transformers.AutoConfig.for_model(family, **fields)
    dtype = torch.float32 if tiny else torch.bfloat16
    torch.manual_seed(0)
    if multimodal:
        if row not in MULTIMODAL:
            raise SystemExit(f"error: --multimodal: {row} is released as a text model; multimodal rows: "
                             f"{', '.join(MULTIMODAL)}")
        config_cls, released, small = MULTIMODAL[row]
        text = config.to_dict()
        tied = text.pop("tie_word_embeddings", True)
        config = getattr(transformers, config_cls)(text_config=text, tie_word_embeddings=tied,
                                                   **(small if tiny else released))
        config.dtype = dtype
        with torch.device(device):
            model = transformers.AutoModelForImageTextToText.from_config(config, dtype=dtype)
        state = {hub_name(k): v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        folder.mkdir(parents=True, exist_ok=True)
        huggingface_hub.save_torch_state_dict(state, folder, max_shard_size="5GB")
        config.architectures = [type(model).__name__]  # as the released config.json names it
        config.save_pretrained(folder)
        del state
    else:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.save_pretrained(folder, max_shard_size="5GB")
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / name)


def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="cca-recipe-cli-", dir=args.workdir))
    base, out = work / "base", work / "out"
    t0 = time.perf_counter()
    write_checkpoint(args.row, base, args.tiny, "cpu" if args.tiny else args.device, args.multimodal)
    built = time.perf_counter() - t0
    size_gb = round(sum(f.stat().st_size for f in base.glob("*.safetensors")) / 1e9, 2)
    cmd = [sys.executable, "-m", "cca_convert.cli", str(base), "--set", f"method={args.method}",
           "--set", f"validate.data={{files: [{args.data}]}}", "--output", str(out), "--force", *args.extra]
    shape = ("tiny" if args.tiny else "released shape") + (", multimodal" if args.multimodal else "")
    print(f"{args.row} ({shape}): checkpoint ({size_gb} GB) written in {built:.1f}s; running\n  "
          + " ".join(cmd[2:]), flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    t0 = time.perf_counter()
    lines = []
    with open(work / "cli.stderr", "w+") as err:
        # the CLI's lines as they come (a run at 128K+ takes many minutes), kept for the record
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        for line in proc.stdout:
            print("  | " + line.rstrip(), flush=True)
            lines.append(line)
        proc.wait()
        err.seek(0)
        stderr = err.read()
    wall = time.perf_counter() - t0
    reports = list(work.glob("**/validation/report.json"))
    report = json.loads(reports[0].read_text()) if reports else None
    result = {"row": args.row, "method": args.method, "tiny": args.tiny, "multimodal": args.multimodal,
              "checkpoint_gb": size_gb, "command": " ".join(cmd[2:]),
              "exit_code": proc.returncode, "wall_s": round(wall, 1), "stdout": "".join(lines)[-20000:],
              "stderr": stderr[-6000:], "report": report}
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


def summary(result: dict) -> str:
    report = result["report"] or {}
    lines = [f"exit {result['exit_code']} after {result['wall_s']} s; validated lengths "
             f"{report.get('context_lengths')}; gates passed: {report.get('passed')}"]
    for line in result["stdout"].splitlines():
        if any(key in line for key in (" @ ", "left out", "memory per device", "done:", "error")):
            lines.append("  " + line.strip())
    for model, res in (report.get("results") or {}).items():
        if "seconds" in res:
            lines.append(f"  {model}: validation {res['seconds']:.1f} s")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row", default="llama-3.1-8b", choices=sorted(MODELS), help="a released model's shape")
    p.add_argument("--method", default="dca", help="--set method=... (the family's recipe for that method)")
    p.add_argument("--data", default=str(REPO / "examples" / "data" / "train.txt"),
                   help="the local held-out text file (long enough for the longest length)")
    p.add_argument("--device", default="cuda:0", help="where the random weights are built")
    p.add_argument("--workdir", default=None, help="folder for the checkpoint and the output (default: the temp dir)")
    p.add_argument("--tiny", action="store_true", help="a tiny shape of the same family on the CPU")
    p.add_argument("--multimodal", action="store_true",
                   help="write the row's multimodal release (language model + vision tower), as the Hub holds it")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and the output")
    p.add_argument("--json", type=Path)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # what follows goes to cca-convert as it is
    args = p.parse_args(argv[:cut])
    args.extra = argv[cut + 1:]
    result = run(args)
    result.update(torch=torch.__version__, transformers=transformers.__version__,
                  gpu=torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else None)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(summary(result), flush=True)
    if result["exit_code"] or result["report"] is None:  # a stage failed (with --force, failed gates do not count)
        print(result["stderr"][-3000:], file=sys.stderr)
        sys.exit(result["exit_code"] or 1)


if __name__ == "__main__":
    main()
