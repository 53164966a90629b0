"""Gates: recipe thresholds the final CCA model must meet at every context length before export/upload."""

from __future__ import annotations

from .config import ValidateSection


def _gate(name, length, value, threshold, passed, margin, detail):
    return {"gate": name, "length": length, "value": value, "threshold": threshold, "passed": passed,
            "margin": margin, "detail": detail}


def evaluate(section: ValidateSection, results: dict, final: str) -> list[dict]:
    """One entry per gate and length: ``passed`` True/False (None: not measured at that length, e.g. a
    passkey prompt that does not fit), ``margin`` >= 0 when passed, < 0 = by how much it failed."""
    out = []
    base, cca = results.get("base", {}), results.get(final, {})
    for length in section.context_lengths:
        key = str(length)
        b_ppl, c_ppl = base.get("perplexity", {}).get(key), cca.get("perplexity", {}).get(key)
        if section.max_ppl_ratio is not None:
            if b_ppl and c_ppl:
                ratio = c_ppl["ppl"] / b_ppl["ppl"]
                ok = ratio <= section.max_ppl_ratio
                out.append(_gate("max_ppl_ratio", length, ratio, section.max_ppl_ratio, ok,
                                 section.max_ppl_ratio - ratio,
                                 f"CCA ppl {c_ppl['ppl']:.3f} / base ppl {b_ppl['ppl']:.3f} = {ratio:.3f} "
                                 f"{'<=' if ok else '>'} {section.max_ppl_ratio:g}"
                                 + ("" if ok else f" (over by {ratio - section.max_ppl_ratio:.3f})")))
            else:
                out.append(_gate("max_ppl_ratio", length, None, section.max_ppl_ratio, None, None, "not measured"))
        b_pk = (base.get("passkey", {}).get(key) or {}).get("accuracy")
        c_pk = (cca.get("passkey", {}).get(key) or {}).get("accuracy")
        if section.min_passkey_accuracy is not None:
            t = section.min_passkey_accuracy
            if c_pk is None:
                out.append(_gate("min_passkey_accuracy", length, None, t, None, None, "not measured"))
            else:
                ok = c_pk >= t
                out.append(_gate("min_passkey_accuracy", length, c_pk, t, ok, c_pk - t,
                                 f"CCA passkey accuracy {c_pk:.2f} {'>=' if ok else '<'} {t:g}"
                                 + ("" if ok else f" (short by {t - c_pk:.2f})")))
        if section.max_passkey_drop is not None:
            t = section.max_passkey_drop
            if c_pk is None or b_pk is None:
                out.append(_gate("max_passkey_drop", length, None, t, None, None, "not measured"))
            else:
                drop = b_pk - c_pk
                ok = drop <= t + 1e-9
                out.append(_gate("max_passkey_drop", length, drop, t, ok, t - drop,
                                 f"passkey accuracy base {b_pk:.2f} - CCA {c_pk:.2f} = {drop:.2f} "
                                 f"{'<=' if ok else '>'} {t:g}" + ("" if ok else f" (over by {drop - t:.2f})")))
    return out


def failed(gates: list[dict]) -> list[dict]:
    return [g for g in gates if g["passed"] is False]


def summary(gates: list[dict]) -> str:
    """One line naming every failed gate and by how much (for the CCAError message)."""
    bad = failed(gates)
    return "; ".join(f"{g['gate']} @ {g['length']}: {g['detail']}" for g in bad)
