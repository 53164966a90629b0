"""The validation report: ``validation/report.json`` (machine-readable), ``report.md`` and ``ppl.png``, and
what the model card shows of it (a Markdown section and ``model-index`` eval results)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

from .. import methods
from . import gates as gates_mod
from .perplexity import __doc__ as PPL_DOC

SCHEMA = 1
# Result keys: "base", then the converted model's as its method names it: "<method>_before" (before the finetune),
# "<method>" (as converted, no finetune) and "<method>_after" (after it).
STAGES = (("_before", " before finetune"), ("", ""), ("_after", " after finetune"))


def method_of(report: dict) -> str:
    return report["model"].get("method", methods.DEFAULT)


def label(report: dict, key: str) -> str:
    if key == "base":
        return "base"
    name = method_of(report)
    known = methods.METHODS.get(name)
    return next((known.label if known else name.upper()) + words for suffix, words in STAGES
                if key == name + suffix)


def result_keys(method: str) -> list[str]:
    """The result keys of a report on a ``method`` model, in table order."""
    return ["base"] + [method + suffix for suffix, _ in STAGES]


PACKAGES = ["cca-convert", "torch", "transformers", "huggingface_hub", "datasets", "tokenizers", "safetensors",
            "triton", "peft", "accelerate"]


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def hardware(device: str) -> dict:
    import torch

    info = {"device": str(device), "platform": platform.platform(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    try:
        info["ram_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    if str(device).startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda,
                    gpu_count=torch.cuda.device_count())
    return info


def build(section, results: dict, speed: dict, gates: list[dict], *, final: str, model: dict, data: dict,
          recipe_digest: str, forced: bool, device: str, timings: dict | None = None,
          base_note: str = "the base model") -> dict:
    """The report as a JSON-able dict (``results[name]`` as measured by the runner)."""
    bad = gates_mod.failed(gates)
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "passed": not bad,
        "forced": bool(forced and bad),
        "failed_gates": gates_mod.summary(gates) or None,
        "final_model": final,
        "models": [k for k in result_keys(model["method"]) if k in results],
        "model": model,
        "base_note": base_note,
        "data": data,
        "method": {
            "perplexity": " ".join(PPL_DOC.split("\n\n", 1)[1].split()).replace("``", "`"),
            "passkey": "prompt of exactly L tokens (filler with 'The pass key is N. Remember it.' at each depth, "
                       "then 'What is the pass key? The pass key is'); correct = greedy decoding reproduces all "
                       "answer tokens (teacher-forced argmax)",
            "tasks": (f"RULER-style {', '.join(section.tasks)}, {section.task_samples} prompts per task and length "
                      "(held-out text as haystack), scored by greedy decoding: the fraction of the reference answers in "
                      "the output (RULER's string_match_all)") if section.tasks else None,
            "speed": "one forward over L tokens (no KV cache, last-token logits), median of repeats after a "
                     "warm-up; peak memory above what was allocated before",
            "windows": section.windows, "stride": section.stride, "batch_size": section.batch_size,
        },
        "context_lengths": list(section.context_lengths),
        "results": results,
        "speed": speed,
        "gates": gates,
        "recipe_digest": recipe_digest,
        "validate_recipe": section.model_dump(mode="json"),
        "seeds": {"validate.seed": section.seed, "passkey": f"random.Random('{section.seed}-<length>')",
                  "windows": "deterministic (evenly spread, no randomness)"},
        "versions": versions(),
        "hardware": hardware(device),
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "timings_s": timings or {},
    }


# ----------------------------------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------------------------------
def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def _fmt(x, spec=".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def ppl_table(report: dict) -> str:
    models = report["models"]
    final = report["final_model"]
    head = "| context | " + " | ".join(f"{label(report, m)} ppl" for m in models) + f" | {label(report, final)} / base |"
    lines = [head, "|" + " --- |" * (len(models) + 2)]
    for length in report["context_lengths"]:
        k = str(length)
        cells = [report["results"][m]["perplexity"].get(k, {}).get("ppl") for m in models]
        base, fin = report["results"].get("base", {}).get("perplexity", {}).get(k), \
            report["results"][final]["perplexity"].get(k)
        ratio = fin["ppl"] / base["ppl"] if base and fin else None
        lines.append(f"| {length} | " + " | ".join(_fmt(c) for c in cells) + f" | {_fmt(ratio)} |")
    return "\n".join(lines)


def passkey_table(report: dict) -> str | None:
    models = report["models"]
    if not any(report["results"][m].get("passkey") for m in models):
        return None
    lines = ["| context | " + " | ".join(label(report, m) for m in models) + " |", "|" + " --- |" * (len(models) + 1)]
    for length in report["context_lengths"]:
        cells = []
        for m in models:
            pk = report["results"][m].get("passkey", {}).get(str(length))
            cells.append("n/a (prompt does not fit)" if not pk or pk["accuracy"] is None
                         else f"{pk['accuracy']:.0%} ({pk['correct']}/{pk['trials']}; answer tokens "
                         f"{pk.get('digit_accuracy') or 0:.0%})")
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _tasks(report: dict) -> list[str]:
    return list(report.get("validate_recipe", {}).get("tasks") or [])


def tasks_table(report: dict) -> str | None:
    """Task x length, base beside the final model (RULER's string_match_all, mean over the samples)."""
    tasks, final = _tasks(report), report["final_model"]
    models = [m for m in ("base", final) if report["results"].get(m, {}).get("tasks")]
    if not tasks or not models:
        return None
    lengths = report["context_lengths"]
    lines = ["| task | " + " | ".join(f"{n}: {' / '.join(label(report, m) for m in models)}" for n in lengths) + " |",
             "|" + " --- |" * (len(lengths) + 1)]
    for task in tasks:
        cells = []
        for n in lengths:
            scores = [(report["results"][m]["tasks"].get(task, {}).get(str(n)) or {}).get("accuracy") for m in models]
            cells.append(" / ".join("n/a" if a is None else f"{a:.2f}" for a in scores))
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def lm_eval_table(report: dict) -> str | None:
    """lm-eval-harness's metrics, base beside the final model."""
    final = report["final_model"]
    models = [m for m in ("base", final) if report["results"].get(m, {}).get("lm_eval")]
    if not models:
        return None
    lines = ["| task | metric | " + " | ".join(label(report, m) for m in models) + " |",
             "|" + " --- |" * (len(models) + 2)]
    first = report["results"][models[-1]]["lm_eval"]
    for task, metrics in first.items():
        for metric in metrics:
            cells = [report["results"][m]["lm_eval"].get(task, {}).get(metric) for m in models]
            lines.append(f"| {task} | {metric} | " + " | ".join(_fmt(c, ".4f") for c in cells) + " |")
    return "\n".join(lines)


def speed_table(report: dict) -> str | None:
    if not report["speed"]:
        return None
    name = label(report, method_of(report))
    lines = [f"| context | base prefill | {name} prefill | speed-up | base peak memory | {name} peak memory |",
             "| --- | --- | --- | --- | --- | --- |"]
    for length in report["context_lengths"]:
        s = report["speed"].get(str(length))
        if not s:
            continue
        b, c = s["base"], s[method_of(report)]
        lines.append(f"| {length} | {b['latency_s'] * 1e3:,.1f} ms | {c['latency_s'] * 1e3:,.1f} ms | "
                     f"{b['latency_s'] / c['latency_s']:.2f}x | {_mib(b['peak_mem_bytes'])} | "
                     f"{_mib(c['peak_mem_bytes'])} |")
    return "\n".join(lines)


def _cpu_note(report: dict) -> str:
    name = label(report, method_of(report))
    note = (f"Measured on the CPU, where {name} runs its PyTorch reference implementation (written for checking, "
            "not speed: it forms the full score matrix), while the base runs PyTorch's fused attention: these rows "
            f"do not show {name}'s cost")
    known = methods.METHODS.get(method_of(report))
    return note + ("; " + known.gpu_speed_note + "." if known and known.gpu_speed_note else ".")


def gates_table(report: dict) -> str:
    if not report["gates"]:
        return "No gates configured."
    lines = ["| gate | context | value | threshold | result |", "| --- | --- | --- | --- | --- |"]
    for g in report["gates"]:
        result = {True: "pass", False: f"**FAIL** ({g['detail']})", None: "not measured"}[g["passed"]]
        if g["passed"] is None and g["detail"].startswith("not applicable"):
            result = g["detail"]
        name = f"{g['gate']} ({g['task']})" if g.get("task") else g["gate"]
        lines.append(f"| {name} | {g['length']} | {_fmt(g['value'])} | {g['threshold']:g} | {result} |")
    return "\n".join(lines)


def _status(report: dict) -> str:
    if not report["gates"]:
        return "**No gates configured.**"
    if report["passed"]:
        return "**All gates passed.**"
    return (f"**Gates FAILED**{' (exported anyway with --force)' if report['forced'] else ''}: "
            f"{report['failed_gates']}")


def _sections(report: dict, plot: str) -> list[str]:
    out = [f"### Perplexity on held-out text\n\n{ppl_table(report)}\n\n![perplexity vs context length]({plot})"]
    if (pk := passkey_table(report)) is not None:
        out.append(f"### Passkey retrieval (accuracy)\n\n{pk}")
    if (tt := tasks_table(report)) is not None:
        heat = plot.replace("ppl.png", "tasks.png")
        out.append(f"### Long-context tasks (RULER-style; score = fraction of the answers generated, greedy)\n\n{tt}"
                   + (f"\n\n![needle depth x context length]({heat})" if _needle_tasks(report) else ""))
    if (le := lm_eval_table(report)) is not None:
        out.append(f"### lm-eval-harness (same weights and tokenizer, lm-eval's HFLM)\n\n{le}")
    if (sp := speed_table(report)) is not None:
        out.append(f"### Prefill on {report['hardware'].get('gpu') or report['hardware']['device']}\n\n{sp}"
                   + ("" if report["hardware"].get("gpu") else f"\n\n{_cpu_note(report)}"))
    out.append(f"### Gates\n\n{gates_table(report)}" + (f"\n\n{_status(report)}" if report["gates"] else ""))
    return out


def _settings(m: dict) -> str:
    known = methods.METHODS.get(m.get("method", methods.DEFAULT))
    return known.settings_text(m) if known else str(m.get("method"))


def markdown(report: dict) -> str:
    m, d, hw = report["model"], report["data"], report["hardware"]
    v = report["versions"]
    parts = [
        f"# Validation report: {m.get('name')}\n",
        f"- model: {m.get('name')} ({_settings(m)}; "
        f"base: {m.get('base_model')}{', finetuned' if m.get('finetuned') else ''})",
        f"- base = {report['base_note']}",
        f"- held-out data: {d['source']} ({d['tokens']:,} tokens{'; ' + d['overlap'] if d.get('overlap') else ''})",
        f"- perplexity: {report['method']['perplexity']}",
        f"- passkey: {report['method']['passkey']}",
        *([f"- tasks: {report['method']['tasks']}"] if report["method"].get("tasks") else []),
        f"- speed: {report['method']['speed']}",
        f"- hardware: {hw.get('gpu') or hw['device']} ({hw['cpu_count']} CPUs, {hw['platform']})",
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"- recipe digest {report['recipe_digest']}, seed {report['validate_recipe']['seed']}, "
        f"created {report['created']}",
        "",
        _status(report),
        "",
    ]
    return "\n".join(parts) + "\n" + "\n\n".join(s.replace("###", "##", 1) for s in _sections(report, "ppl.png")) + "\n"


def card_markdown(report: dict) -> str:
    """The model card's validation section (the plot and report linked relative to the repo root)."""
    intro = (f"Measured by cca-convert before upload on {report['data']['source']} (held out from any finetune "
             f"data), {report['hardware'].get('gpu') or report['hardware']['device']}. Base = {report['base_note']}. "
             "Full report: "
             "[validation/report.md](validation/report.md), [JSON](validation/report.json).")
    return "## Validation\n\n" + intro + "\n\n" + "\n\n".join(_sections(report, "validation/ppl.png")) + "\n"


def eval_results(report: dict):
    """``model-index`` entries (huggingface_hub EvalResult) for the final converted model."""
    from huggingface_hub import EvalResult

    d, final = report["data"], report["final_model"]
    common = dict(task_type="text-generation", task_name="Text Generation", dataset_type=d.get("hub_id") or "text",
                  dataset_name=d["source"], dataset_split=d.get("split"), dataset_config=d.get("config"))
    out = []
    for length in report["context_lengths"]:
        ppl = report["results"][final]["perplexity"].get(str(length))
        if ppl:
            out.append(EvalResult(**common, metric_type="perplexity", metric_name=f"Perplexity @ {length} tokens",
                                  metric_value=round(ppl["ppl"], 4), metric_config=str(length)))
        for task, by_length in (report["results"][final].get("tasks") or {}).items():
            r = by_length.get(str(length)) or {}
            if r.get("accuracy") is not None:
                out.append(EvalResult(**common, metric_type="accuracy", metric_name=f"{task} @ {length} tokens",
                                      metric_value=round(r["accuracy"], 4), metric_config=f"{task}-{length}"))
        pk = report["results"][final].get("passkey", {}).get(str(length))
        if pk and pk["accuracy"] is not None:
            out.append(EvalResult(**common, metric_type="accuracy", metric_name=f"Passkey retrieval @ {length} tokens",
                                  metric_value=round(pk["accuracy"], 4), metric_config=str(length)))
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Plot and files
# ----------------------------------------------------------------------------------------------------------------------
def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    lengths = report["context_lengths"]
    has_pk = passkey_table(report) is not None
    fig, axes = plt.subplots(1, 2 if has_pk else 1, figsize=(10 if has_pk else 5.5, 3.8), squeeze=False)
    styles = dict(zip(result_keys(method_of(report)), [("k", "o", "-"), ("tab:orange", "s", "--"),
                                                        ("tab:blue", "s", "-"), ("tab:blue", "D", "-")]))
    ax = axes[0, 0]
    for m in report["models"]:
        xs = [n for n in lengths if str(n) in report["results"][m]["perplexity"]]
        ys = [report["results"][m]["perplexity"][str(n)]["ppl"] for n in xs]
        color, marker, ls = styles[m]
        ax.plot(xs, ys, color=color, marker=marker, linestyle=ls, label=label(report, m))
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title("held-out perplexity")
    ax.grid(alpha=0.3)
    ax.legend()
    if has_pk:
        ax = axes[0, 1]
        for m in report["models"]:
            pts = [(n, report["results"][m].get("passkey", {}).get(str(n), {}).get("accuracy")) for n in lengths]
            pts = [(n, a) for n, a in pts if a is not None]
            color, marker, ls = styles[m]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, linestyle=ls, label=label(report, m))
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("accuracy")
        ax.set_title("passkey retrieval")
        ax.grid(alpha=0.3)
    fig.suptitle(report["model"].get("name") or "", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _needle_tasks(report: dict) -> list[str]:
    from .tasks import NEEDLE_TASKS

    return [t for t in _tasks(report) if t in NEEDLE_TASKS]


def plot_tasks(report: dict, path: Path) -> None:
    """Depth x length heatmaps of the needle tasks, base beside the final model (one row per task)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    tasks, lengths = _needle_tasks(report), report["context_lengths"]
    models = [m for m in ("base", report["final_model"]) if report["results"].get(m, {}).get("tasks")]
    fig, axes = plt.subplots(len(tasks), len(models), figsize=(2.2 + 1.1 * len(lengths) * len(models),
                                                               0.8 + 2.4 * len(tasks)), squeeze=False)
    for i, task in enumerate(tasks):
        depths = sorted({float(d) for m in models for n in lengths
                         for d in (report["results"][m]["tasks"].get(task, {}).get(str(n)) or {}).get("by_depth", {})})
        for j, m in enumerate(models):
            ax = axes[i, j]
            grid = [[(report["results"][m]["tasks"].get(task, {}).get(str(n)) or {}).get("by_depth", {})
                     .get(f"{d:g}", float("nan")) for n in lengths] for d in depths]
            ax.imshow(grid or [[float("nan")] * len(lengths)], vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for r, row in enumerate(grid):
                for col, v in enumerate(row):
                    if v == v:
                        ax.text(col, r, f"{v:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=8)
            ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=8)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("needle depth")
            ax.set_title(f"{task}: {label(report, m)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: dict, folder: Path, subdir: str = "validation") -> Path:
    """Write ``folder/<subdir>/{report.json, report.md, ppl.png}``; return that folder."""
    out = Path(folder) / subdir
    out.mkdir(parents=True, exist_ok=True)
    from ..paths import portable_text

    # published with the repo: local files by their path below the run's directory, or their name
    (out / "report.json").write_text(portable_text(json.dumps(report, indent=2, sort_keys=False)) + "\n")
    (out / "report.md").write_text(portable_text(markdown(report)))
    plot(report, out / "ppl.png")
    if tasks_table(report) is not None and _needle_tasks(report):
        plot_tasks(report, out / "tasks.png")
    return out


def read(folder: Path) -> dict | None:
    path = Path(folder) / "validation" / "report.json"
    return json.loads(path.read_text()) if path.is_file() else None
