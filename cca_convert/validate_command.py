"""``cca-convert validate DIR_OR_REPO``: the validation (``validate/``) re-run on an exported folder or Hub repo."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from . import families, methods
from .errors import CCAError
from .validate import gates as gates_mod
from .validate import report as report_mod
from .validate.runner import CARD_END, CARD_START, Suite, _finetune_dump, card_section, load_tokenizer, model_info


def _stock_sliding_note(config, section) -> str:
    """What a --base speed comparison carries besides the method, on models whose sliding-window layers are kept:
    transformers runs them as one SDPA call under an L x L mask, the export (``cca_hf._sliding_attention``) by
    blocks of queries past 4 windows. Same outputs, less work: the prefill ratio there is not the method's alone."""
    window = families.kept_sliding_window(config)
    longer = [n for n in section.context_lengths if window and n > 4 * window]
    if not (section.speed and longer):
        return ""
    what = (f"sliding-window layers (window {window}) run as transformers runs them, one attention call under an "
            f"L x L mask, while the converted model runs them by blocks of queries past {4 * window} tokens (the same "
            f"outputs): the prefill speed-up at {', '.join(map(str, longer))} includes that, not only the method's")
    print(f"note: the base model's {what}")
    return f"; its {what}"


def validate_parser():
    import argparse

    from .argparsing import OneLineParser

    p = OneLineParser(
        prog="cca-convert validate",
        description="Re-run the validation (perplexity, passkey, tasks, lm-eval, prefill speed, gates) of an exported "
                    "folder "
                    "or Hub repo. On a folder, the report goes to validation-<date>-vs-<base>/ inside it, leaving the "
                    "conversion's validation/ and model card as they were (--update-card replaces them).",
        epilog="examples:\n  cca-convert validate out/tiny-cca\n"
               "  cca-convert validate user/llama-3.1-8b-cca --output val-8b --set validate.data.files=[book.txt]\n"
               "  cca-convert validate out/tiny-cca --lm-eval heldout_rolling --set "
               "validate.lm_eval.include_path=examples/lm_eval\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", metavar="DIR_OR_REPO", help="exported folder, or Hub repo id of an exported model")
    p.add_argument("--revision", help="Hub revision of DIR_OR_REPO")
    p.add_argument("--recipe", type=Path, help="recipe whose validate: section to use (default: the folder's "
                                               "cca_recipe.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set validate.context_lengths=[512,1024]")
    p.add_argument("--base", metavar="PATH_OR_ID",
                   help="base model to compare with (default: the same weights with attn_backend=full)")
    p.add_argument("--output", type=Path, help="where validation/ goes (default: the folder itself; for a Hub "
                                               "repo ./<name>-validation)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--lm-eval", metavar="TASKS", help="also run lm-eval-harness tasks (comma-separated names) on the "
                                                      "base and the model (pip install \"cca-convert[eval]\"); local "
                                                      "task YAMLs: --set validate.lm_eval.include_path=DIR")
    p.add_argument("--update-card", action="store_true",
                   help="replace the folder's validation/ report and the model card's table with this run's (by "
                        "default a re-run writes validation-<date>-vs-<base>/ beside them and changes nothing else)")
    return p


def _recipe_for(folder: Path, args, repo_id: str | None):
    import tempfile

    from .recipe import load_recipe

    path = args.recipe
    if path is None and (folder / "cca_recipe.yaml").is_file():
        path = folder / "cca_recipe.yaml"
    if path is None and repo_id is not None:
        try:
            import huggingface_hub

            path = Path(huggingface_hub.hf_hub_download(repo_id, "cca_recipe.yaml", revision=args.revision))
        except Exception:
            path = None
    if path is None:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write("{}\n")
        try:
            return load_recipe(Path(f.name), args.overrides)[0]
        finally:
            Path(f.name).unlink()
    return load_recipe(path, args.overrides)[0]


def load_converted_model(folder: Path, device: str, config=None):
    """An exported folder's model: its family's class with its method's mixin, on ``device`` (``config``: the folder's
    config, when already read)."""
    from transformers import AutoConfig

    from . import published
    from .families import FAMILIES

    config = config if config is not None else AutoConfig.from_pretrained(folder)
    method = methods.of_config(config)
    if method is None or config.model_type not in FAMILIES:
        raise CCAError(f"{folder}: not a model converted by cca-convert (model_type {config.model_type!r}, settings of "
                       f"none of its methods)")
    model_cls = published.family_class(FAMILIES[config.model_type], method)
    return model_cls.from_pretrained(folder, config=config, dtype=config.dtype).to(device).eval()


def update_card(readme: Path, report: dict) -> None:
    """Replace the validation section and the model-index of an exported README.md."""
    from huggingface_hub import ModelCard

    text = readme.read_text()
    section = card_section(report)
    if CARD_START in text and CARD_END in text:
        head, rest = text.split(CARD_START, 1)
        text = head + section.rstrip("\n") + rest.split(CARD_END, 1)[1]
    elif "\n## Recipe" in text:
        text = text.replace("\n## Recipe", "\n" + section + "\n## Recipe", 1)
    else:
        text += "\n" + section
    card = ModelCard(text)
    card.data.eval_results = report_mod.eval_results(report)
    card.data.model_name = report["model"]["name"]
    from .paths import portable_text

    readme.write_text(portable_text(str(card)))


def _device(text: str | None) -> str:
    """``--device`` checked before anything is loaded: cpu, cuda or cuda:N of this machine."""
    if text is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise CCAError(f"--device {text}: the validation runs on cpu, cuda or cuda:N")
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and not count:
        raise CCAError(f"--device {text}: this machine has no CUDA GPU that torch {torch.__version__} can use; "
                       "use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= count:
        raise CCAError(f"--device {text}: this machine has {count} CUDA GPU(s) (cuda:0 to cuda:{count - 1})")
    return text


def run_validate(argv: list[str]) -> int:
    from transformers import AutoConfig

    from .export import weight_shapes
    from .hub import resolve_source

    args = validate_parser().parse_args(argv)
    if args.lm_eval is not None:
        tasks = [t.strip() for t in args.lm_eval.split(",") if t.strip()]
        if not tasks:
            raise CCAError(f"--lm-eval {args.lm_eval!r} names no task: give lm-eval task names, comma-separated "
                           "(e.g. --lm-eval heldout_rolling), or drop --lm-eval")
        args.overrides.append(f"validate.lm_eval.tasks=[{', '.join(tasks)}]")
    device = _device(args.device)
    local = Path(args.target).expanduser()
    repo_id = None if local.is_dir() else args.target
    folder = resolve_source(args.target, args.revision)
    if not (folder / "config.json").is_file():
        raise CCAError(f"{args.target} has no config.json: pass a folder or repo exported by cca-convert")
    raw = json.loads((folder / "config.json").read_text())
    method = methods.of_config(raw)
    if method is None:
        raise CCAError(f"{args.target} is not a model converted by this version of cca-convert (its config.json has "
                       f"the settings of none of its methods: {', '.join(methods.METHODS)}): convert it first. An "
                       "export of the first releases (model_type cca) loads with the code it ships, "
                       "trust_remote_code=True; to validate it, convert its base again")
    weight_shapes(folder)  # a truncated or corrupt shard is named first, before any setting or text is read
    output = args.output or (local if repo_id is None else Path(f"{args.target.split('/')[-1]}-validation"))
    recipe = _recipe_for(folder, args, repo_id)
    config = AutoConfig.from_pretrained(folder)
    context = config.max_position_embeddings
    section = recipe.validate.resolved(method.trained_context(config) or context)

    beyond = [n for n in section.context_lengths if context and n > context]
    if beyond:
        raise CCAError(f"validate.context_lengths {beyond} exceed the model's context (max_position_embeddings="
                       f"{context}); drop them with --set validate.context_lengths=[...]")
    base_folder = resolve_source(args.base) if args.base else None
    base_ctx = json.loads((base_folder / "config.json").read_text()).get("max_position_embeddings") if base_folder else None
    if base_ctx and any(n > base_ctx for n in section.context_lengths):
        print(f"warning: validate.context_lengths go past the base model's own context ({base_ctx}): its perplexity "
              "there is out of its trained range")
    from .validate import harness

    missing = harness.problems(section.lm_eval)
    if missing:
        raise CCAError("; ".join(missing))
    tokenizer = load_tokenizer(folder)
    suite = Suite(section, tokenizer, _finetune_dump(recipe), print)
    print(f"held-out: {suite.data_info['source']}, {suite.data_info['tokens']:,} tokens; lengths "
          f"{', '.join(map(str, section.context_lengths))}; device {device}")
    model = load_converted_model(folder, device, config)
    readme = folder / "README.md"
    previous = report_mod.read(folder) or {}
    finetuned = bool(previous.get("model", {}).get("finetuned")) or (
        readme.is_file() and "adapted with a short finetune" in readme.read_text())
    base_name = args.base or method.base_note.strip("()")
    results = {}
    if args.base:
        from .multimodal import load_causal_lm

        base = load_causal_lm(base_folder, dtype=model.dtype).to(device).eval()
        results["base"] = suite.measure(base, None, "base")
        base_backend = None
        base_note = f"{args.base} (--base)" + _stock_sliding_note(base.config, section)
    else:
        base, base_backend = model, "full"
        results["base"] = suite.measure(model, "full", "base")
        base_note = ("this model's own weights with plain causal attention " + method.base_note + "; after a finetune "
                     "these are the finetuned weights, pass --base for the original")
    results[method.name] = suite.measure(model, None, method.label)
    speed = suite.speed(base, base_backend, model, None, method)
    gates = gates_mod.evaluate(section, results, method.name, method.label, method.trained_context(model.config))
    name = repo_id or local.resolve().name
    report = report_mod.build(
        section, results, speed, gates, final=method.name,
        model=model_info(model.config, name, base_name, finetuned), data=suite.data_info,
        recipe_digest=recipe.digest(), forced=False, device=device,
        base_note=base_note,
    )
    in_place = repo_id is None and output.resolve() == local.resolve()
    if in_place and not args.update_card:
        # the conversion's report (and the card's table, "measured before upload") stay as they were: a re-run
        # writes beside them, named by its date and its base
        from datetime import datetime, timezone

        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        against = Path(args.base.rstrip("/")).name if args.base else "full-attention"
        out = report_mod.write(report, output, f"validation-{stamp}-vs-{against}")
    else:
        out = report_mod.write(report, output)
        if in_place and readme.is_file():
            update_card(readme, report)
    print(f"report: {out / 'report.md'}")
    if gates_mod.failed(gates):
        print(f"validation gates FAILED: {gates_mod.summary(gates)}")
        return 1
    print("all gates passed")
    return 0
