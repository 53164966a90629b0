"""Gates: recipe thresholds the final converted model must meet at every context length before export/upload."""

from __future__ import annotations

from .config import ValidateSection


def _gate(name, length, value, threshold, passed, margin, detail):
    return {"gate": name, "length": length, "value": value, "threshold": threshold, "passed": passed,
            "margin": margin, "detail": detail}


def evaluate(section: ValidateSection, results: dict, final: str, method: str,
             trained_context: int | None = None) -> list[dict]:
    """One entry per gate and length: ``passed`` True/False (None: not measured at that length, e.g. a
    passkey prompt that does not fit), ``margin`` >= 0 when passed, < 0 = by how much it failed.
    ``max_ppl_growth`` compares each length with the longest validated length <= ``trained_context``;
    ``min_passkey_accuracy`` is capped at the base's accuracy at that length: a conversion is judged on keeping what
    its base retrieves, not on retrieval the base never had (0 there: the gate does not apply)."""
    out = []
    base, cca = results.get("base", {}), results.get(final, {})
    ref_len = max((n for n in section.context_lengths if trained_context and n <= trained_context), default=None)
    ref_ppl = cca.get("perplexity", {}).get(str(ref_len)) if ref_len else None
    ref_pk = (base.get("passkey", {}).get(str(ref_len)) or {}).get("accuracy") if ref_len else None
    for length in section.context_lengths:
        key = str(length)
        b_ppl, c_ppl = base.get("perplexity", {}).get(key), cca.get("perplexity", {}).get(key)
        if section.max_ppl_ratio is not None:
            if b_ppl and c_ppl:
                ratio = c_ppl["ppl"] / b_ppl["ppl"]
                ok = ratio <= section.max_ppl_ratio
                out.append(_gate("max_ppl_ratio", length, ratio, section.max_ppl_ratio, ok,
                                 section.max_ppl_ratio - ratio,
                                 f"{method} ppl {c_ppl['ppl']:.3f} / base ppl {b_ppl['ppl']:.3f} = {ratio:.3f} "
                                 f"{'<=' if ok else '>'} {section.max_ppl_ratio:g}"
                                 + ("" if ok else f" (over by {ratio - section.max_ppl_ratio:.3f})")))
            else:
                out.append(_gate("max_ppl_ratio", length, None, section.max_ppl_ratio, None, None, "not measured"))
        if section.max_ppl_growth is not None and (trained_context is None or length > trained_context):
            t = section.max_ppl_growth
            if not (ref_ppl and c_ppl):
                why = "not measured" if ref_len else (f"no validated length <= the trained context {trained_context} "
                                                      "to compare with" if trained_context else
                                                      "the model states no trained context")
                out.append(_gate("max_ppl_growth", length, None, t, None, None, why))
            else:
                growth = c_ppl["ppl"] / ref_ppl["ppl"]
                ok = growth <= t
                out.append(_gate("max_ppl_growth", length, growth, t, ok, t - growth,
                                 f"{method} ppl {c_ppl['ppl']:.3f} @ {length} / {ref_ppl['ppl']:.3f} @ {ref_len} = "
                                 f"{growth:.3f} {'<=' if ok else '>'} {t:g}"
                                 + ("" if ok else f" (over by {growth - t:.3f})")))
        b_pk = (base.get("passkey", {}).get(key) or {}).get("accuracy")
        c_pk = (cca.get("passkey", {}).get(key) or {}).get("accuracy")
        if section.min_passkey_accuracy is not None:
            t = section.min_passkey_accuracy
            if ref_pk is not None and ref_pk < t:  # the bar is the base's own within its trained context
                t = ref_pk
            if c_pk is None:
                out.append(_gate("min_passkey_accuracy", length, None, t, None, None, "not measured"))
            elif t <= 0:
                out.append(_gate("min_passkey_accuracy", length, c_pk, t, None, None,
                                 f"not applicable: the base retrieves no passkey at {ref_len} (within its trained "
                                 f"context), so no method on it is held to one"))
            else:
                ok = c_pk >= t
                out.append(_gate("min_passkey_accuracy", length, c_pk, t, ok, c_pk - t,
                                 f"{method} passkey accuracy {c_pk:.2f} {'>=' if ok else '<'} {t:g}"
                                 + ("" if ok else f" (short by {t - c_pk:.2f})")))
        if section.max_passkey_drop is not None:
            t = section.max_passkey_drop
            if c_pk is None or b_pk is None:
                out.append(_gate("max_passkey_drop", length, None, t, None, None, "not measured"))
            else:
                drop = b_pk - c_pk
                ok = drop <= t + 1e-9
                out.append(_gate("max_passkey_drop", length, drop, t, ok, t - drop,
                                 f"passkey accuracy base {b_pk:.2f} - {method} {c_pk:.2f} = {drop:.2f} "
                                 f"{'<=' if ok else '>'} {t:g}" + ("" if ok else f" (over by {drop - t:.2f})")))
    if section.max_task_drop is not None:
        t = section.max_task_drop
        for task in section.tasks:
            for length in section.context_lengths:
                b = ((base.get("tasks") or {}).get(task, {}).get(str(length)) or {}).get("accuracy")
                c = ((cca.get("tasks") or {}).get(task, {}).get(str(length)) or {}).get("accuracy")
                if b is None or c is None:
                    out.append({**_gate("max_task_drop", length, None, t, None, None, f"{task}: not measured"),
                                "task": task})
                    continue
                drop = b - c
                ok = drop <= t + 1e-9
                out.append({**_gate("max_task_drop", length, drop, t, ok, t - drop,
                                    f"{task}: base {b:.2f} - {method} {c:.2f} = {drop:.2f} {'<=' if ok else '>'} {t:g}"
                                    + ("" if ok else f" (over by {drop - t:.2f})")), "task": task})
    return out


def failed(gates: list[dict]) -> list[dict]:
    return [g for g in gates if g["passed"] is False]


def summary(gates: list[dict]) -> str:
    """One line naming every failed gate and by how much (for the CCAError message)."""
    bad = failed(gates)
    return "; ".join(f"{g['gate']} @ {g['length']}: {g['detail']}" for g in bad)
