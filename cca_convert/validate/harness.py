"""lm-eval-harness (EleutherAI) as an optional part of the validation: the base and the converted model run through
lm-eval's own Hugging Face model class (``HFLM``, given the loaded model, so the base is the same weights with the
method's way back to full attention) on the tasks of ``validate.lm_eval``. Needs ``pip install "cca-convert[eval]"``.

Tasks are lm-eval's names; ``include_path`` adds a folder of task YAMLs (local data: no download).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from ..errors import CCAError, first_line

INSTALL = 'pip install "cca-convert[eval]"'


def problems(section) -> list[str]:
    """What stops ``validate.lm_eval`` from running (before any weight is loaded)."""
    if not section.tasks:
        return []
    out = []
    if importlib.util.find_spec("lm_eval") is None:
        out.append(f"validate.lm_eval.tasks {section.tasks} need lm-eval-harness, which is not installed: {INSTALL}")
        return out
    if section.include_path and not Path(section.include_path).is_dir():
        out.append(f"validate.lm_eval.include_path {section.include_path}: no such folder (it holds task YAMLs)")
        return out
    from lm_eval.tasks import TaskManager

    known = set(TaskManager(include_path=section.include_path).all_tasks)
    unknown = [t for t in section.tasks if t not in known]
    if unknown:
        out.append(f"validate.lm_eval.tasks: lm-eval knows no task {', '.join(unknown)}"
                   + ("" if section.include_path else " (local task YAMLs: --set validate.lm_eval.include_path=DIR)"))
    return out


def evaluate(model, tokenizer, section, log=print) -> dict:
    """``{task: {metric: value}}`` of ``model`` (under the caller's attention backend) on the section's tasks."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    # lm-eval warns that a loaded model (not a name) ignores its other model arguments: that is the intent here
    quiet = [logging.getLogger(name) for name in ("lm_eval", "lm-eval")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=section.batch_size,
                  device=str(next(model.parameters()).device))
        out = simple_evaluate(model=lm, tasks=list(section.tasks), num_fewshot=section.num_fewshot,
                              limit=section.limit, task_manager=TaskManager(include_path=section.include_path),
                              log_samples=False, bootstrap_iters=0)
    except Exception as exc:  # lm-eval's own failures (a task's data, a metric): one line naming the tasks
        raise CCAError(f"lm-eval failed on {section.tasks}: {type(exc).__name__}: {first_line(exc)}") from None
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    results = {}
    for task, metrics in (out or {}).get("results", {}).items():
        results[task] = {key.split(",")[0]: value for key, value in metrics.items()
                         if "," in key and "_stderr" not in key and isinstance(value, (int, float))}
    return results
