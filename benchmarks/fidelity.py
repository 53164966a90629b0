#!/usr/bin/env python3
"""Quality on real text, through the CLI a user runs: base vs CCA before vs CCA after the finetune.

The base is a 26M-parameter Llama (GQA 8:2, head_dim 64, context 2048) pretrained by
``examples/train_tiny_llama.py`` on public-domain KJV books; it is trained here when its folder is missing
(about two minutes on one H100/H200). Every row is one ``cca-convert`` run with the recipe
``benchmarks/fidelity.yaml`` and the CLI's defaults (``attn_backend: auto``, i.e. the Triton kernels on CUDA;
``micro_batch_size: 4``), one (g, s) setting and one finetune method; the numbers are read from the run's own
``validation/report.json`` (held-out New Testament books, never trained on). ``--force`` is passed so that a
row that misses the recipe's 1.05x gate still shows its numbers; the PASS column applies the bar of the
issue: after <= before and after <= 1.05 x base at every length.

    python benchmarks/fidelity.py                 # 2 settings x {lora, qkv, full}; writes benchmarks/results/
    python benchmarks/fidelity.py --quick         # one row (g=16, s=256, LoRA, 40 steps): part of make test-gpu
    python benchmarks/fidelity.py --dca           # the same base with DCA (training-free) from c to 8c
    python benchmarks/fidelity.py --extend 4      # CCA extended x4 vs full attention extended the same way

The ``--dca`` row bar (issue #13): DCA's ppl stays within 1.2x of its ppl at c = 2048 up to 8c, while the base's
(plain RoPE, same weights) grows by more than 3x. The KJV books alone are memorised before the base breaks down past c
that much; ``--commentaries`` pretrains the base on KJV plus ``examples/data/commentaries.txt.xz`` (4.6M tokens), and
``--rope-theta``, ``--base-steps`` and ``--seed`` vary it (each variant in its own out/fidelity-llama-... folder):

    python benchmarks/fidelity.py --dca --commentaries --rope-theta 1000 --base-steps 1200 --seed 0   # PASS, 3 seeds
    python benchmarks/fidelity.py --dca --commentaries --passkey-base --passkey-trials 8

KJV has no digits, and no base pretrained on text alone has retrieved a pass key here; ``--passkey-base`` pretrains
one with 30% of its windows in the validator's passkey format (``--passkey-frac`` of the training script; random keys
and depths, never the validator's seeds) and adds the passkey bar: the base retrieves >= 80% of the keys at c, and DCA
stays within 0.2 of that at every length past c. On an H100 with ``--commentaries`` (benchmarks/results/
fidelity-dca-commentaries-h100.md) the base retrieves 90-100% at c and DCA 70-90% at 2c-8c: the bar is missed at 4c-8c.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "benchmarks" / "fidelity.yaml"
FIDELITY_BASE_ARGS = [
    "--hidden", "512", "--layers", "8", "--heads", "8", "--kv-heads", "2", "--intermediate", "1408",
    "--vocab-size", "8192", "--max-position-embeddings", "2048", "--seq-len", "2048", "--short-len", "512",
    "--long-frac", "0.5", "--batch-tokens", "32768", "--steps", "400", "--lr", "1.5e-3", "--warmup", "30",
    "--log-every", "50",
]
# --dca --passkey-base: 30% of the windows in the validator's passkey format, 5x the steps (retrieval is learnt late)
PASSKEY_BASE = ("--passkey-frac", "0.3", "--steps", "2000")
PASSKEY_TRIALS = 4  # per depth and length (x 5 depths)
LEARNING_RATES = {"lora": 1e-3, "qkv": 2e-4, "full": 1e-4}
MAX_RATIO = 1.05


def ensure_base(base: Path, device: str, extra: tuple[str, ...] = ()) -> float:
    if (base / "config.json").is_file():
        return 0.0
    start = time.perf_counter()
    cmd = [sys.executable, str(REPO / "examples" / "train_tiny_llama.py"), "--output", str(base), "--device", device,
           *FIDELITY_BASE_ARGS, *extra]
    print("pretraining the base:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)
    return time.perf_counter() - start


def run_cli(base: Path, out: Path, sets: list[str], steps: int | None) -> tuple[str, str, int, float]:
    """One ``cca-convert`` run of the fidelity recipe with ``--set`` pairs: (the command shown, its log, exit, s)."""
    cmd = [sys.executable, "-m", "cca_convert.cli", str(base), "--recipe", str(RECIPE), "--output", str(out),
           "--overwrite", "--force"]
    for pair in sets + ([f"finetune.steps={steps}"] if steps else []):
        cmd += ["--set", pair]
    shown = "cca-convert " + " ".join(cmd[3:])
    print(f"\n$ {shown}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True)
    seconds = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    (out.parent / f"{out.name}.log").write_text(log)
    return shown, log, proc.returncode, seconds


def convert(base: Path, out: Path, g: int, s: int, method: str, steps: int | None) -> dict:
    shown, log, code, seconds = run_cli(base, out, [f"cca.group_size={g}", f"cca.local_window={s}",
                                                    f"finetune.method={method}",
                                                    f"finetune.learning_rate={LEARNING_RATES[method]}"], steps)
    if code != 0:
        tail = "\n".join(log.strip().splitlines()[-5:])
        return {"g": g, "s": s, "method": method, "command": shown, "error": tail, "seconds": seconds}
    report = json.loads((out / "validation" / "report.json").read_text())
    metrics = [json.loads(x) for x in (out / "finetune" / "metrics.jsonl").read_text().splitlines()]
    results = report["results"]
    row = {"g": g, "s": s, "method": method, "command": shown, "seconds": round(seconds, 1),
           "loss_first": metrics[0]["loss"], "loss_last": metrics[-1]["loss"], "ppl": {}}
    for length in report["context_lengths"]:
        key = str(length)
        row["ppl"][key] = {m: results[m]["perplexity"][key]["ppl"] for m in ("base", "cca_before", "cca_after")}
    row["pass"] = all(p["cca_after"] <= p["cca_before"] * (1 + 1e-9) and p["cca_after"] <= MAX_RATIO * p["base"]
                      for p in row["ppl"].values())
    return row


def dca_row(base: Path, out: Path, passkey: bool, speed: bool = True,
            trials: int = PASSKEY_TRIALS) -> tuple[str, bool, dict]:
    cmd = [sys.executable, "-m", "cca_convert.cli", str(base), "--recipe", str(REPO / "benchmarks" / "dca_fidelity.yaml"),
           "--output", str(out), "--overwrite", "--force"]
    if not speed:
        cmd += ["--set", "validate.speed=false"]
    if passkey:
        cmd += ["--set", f"validate.passkey_trials={trials}"]
    print("\n$ cca-convert " + " ".join(cmd[3:]), flush=True)
    proc = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True)
    (out.parent / f"{out.name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return "DCA run FAILED: " + (proc.stdout + proc.stderr).strip().splitlines()[-1], False, {}
    return dca_summary(json.loads((out / "validation" / "report.json").read_text()), passkey)


def dca_summary(report: dict, passkey: bool) -> tuple[str, bool, dict]:
    """The DCA row's table and bars from its run's report (results under "base" and "dca", the method's name)."""
    c = report["model"]["trained_context"]
    ppl = {m: {int(n): v["ppl"] for n, v in report["results"][m]["perplexity"].items()} for m in ("base", "dca")}
    pk = {m: {int(n): v for n, v in report["results"][m].get("passkey", {}).items()} for m in ("base", "dca")}

    def keys(m, n):
        v = pk[m].get(n) or {}
        return f"{v['correct']}/{v['trials']}" if v.get("trials") else "-"

    lines = ["| length | base ppl | DCA ppl | base / base@c | DCA / DCA@c | base passkey | DCA passkey |",
             "|---|---|---|---|---|---|---|"]
    for n in report["context_lengths"]:
        lines.append(f"| {n} | {ppl['base'][n]:.3f} | {ppl['dca'][n]:.3f} | {ppl['base'][n] / ppl['base'][c]:.3f} | "
                     f"{ppl['dca'][n] / ppl['dca'][c]:.3f} | {keys('base', n)} | {keys('dca', n)} |")
    longest = max(report["context_lengths"])
    ppl_ok = (all(ppl["dca"][n] <= 1.2 * ppl["dca"][c] for n in ppl["dca"] if n >= c)
              and ppl["base"][longest] > 3 * ppl["base"][c])
    at_c = (pk["base"].get(c) or {}).get("accuracy")
    past = [(pk["dca"].get(n) or {}).get("accuracy") for n in report["context_lengths"] if n > c]
    pk_ok = (at_c is not None and at_c >= 0.8 and bool(past)
             and all(a is not None and a >= at_c - 0.2 for a in past))
    lines.append(f"\nperplexity bar (DCA <= 1.2x its ppl at c up to 8c, base > 3x at 8c): {'PASS' if ppl_ok else 'FAIL'}")
    if passkey:
        lines.append(f"passkey bar (base >= 0.8 at c, DCA within 0.2 of it at 2c..8c): {'PASS' if pk_ok else 'FAIL'}")
    ok = ppl_ok and (pk_ok or not passkey)
    speed = report.get("speed", {})
    if speed:
        lines.append("\nprefill (one forward, no cache): " + ", ".join(
            f"{n}: base {v['base']['latency_s'] * 1e3:.1f} ms, DCA {v['dca']['latency_s'] * 1e3:.1f} ms"
            for n, v in speed.items()))
    return "\n".join(lines), ok, {"ppl": ppl, "passkey": pk, "trained_context": c, "speed": speed}


EXTEND_TASKS = "[niah_single, variable_tracking, common_words]"
EXTEND_BAR = 1.02


def extend_rows(base: Path, work: Path, factor: int, method: str, steps: int | None) -> tuple[str, bool, dict]:
    """CCA extended x factor against the full-attention model extended the same way: the same recipe, RoPE
    stretch, finetune (steps, data, LR, seq_len = factor x c) and validation; only the attention differs."""
    lengths = [2048 * 2**i for i in range(factor.bit_length()) if 2**i <= factor]
    runs = {}
    for name, backend in (("full", "full"), ("cca", "auto")):
        out = work / f"extend{factor}-{name}-{method}"
        shown, log, code, seconds = run_cli(
            base, out, [f"extend.factor={factor}", f"cca.attn_backend={backend}", f"finetune.method={method}",
                        f"finetune.learning_rate={LEARNING_RATES[method]}", f"validate.context_lengths={lengths}",
                        "validate.windows=4", f"validate.tasks={EXTEND_TASKS}", "validate.task_samples=4"], steps)
        if code != 0:
            raise SystemExit(f"{shown} failed:\n" + "\n".join(log.strip().splitlines()[-8:]))
        report = json.loads((out / "validation" / "report.json").read_text())
        finetune_s = report.get("timings_s", {}).get("finetune") or 0.0
        runs[name] = {"command": shown, "seconds": round(seconds, 1), "finetune_s": finetune_s, "report": report}
        print(f"  -> done ({seconds:.0f}s, finetune {finetune_s:.0f}s)", flush=True)
    full, cca = runs["full"]["report"], runs["cca"]["report"]
    final = lambda r: r["results"][r["final_model"]]  # noqa: E731
    lines = ["| length | base, stretched RoPE, no finetune | full attention extended | CCA extended | CCA / full | "
             "tasks full / CCA |", "| --- | --- | --- | --- | --- | --- |"]
    ok, data = True, {"factor": factor, "method": method, "runs": {k: {**v, "report": None} for k, v in runs.items()},
                      "lengths": {}}
    for n in lengths:
        b = cca["results"]["base"]["perplexity"][str(n)]["ppl"]
        f, c = final(full)["perplexity"][str(n)]["ppl"], final(cca)["perplexity"][str(n)]["ppl"]
        tasks = {t: ((final(full).get("tasks") or {}).get(t, {}).get(str(n), {}).get("accuracy"),
                     final(cca)["tasks"][t].get(str(n), {}).get("accuracy")) for t in final(cca).get("tasks", {})}
        ok &= c <= EXTEND_BAR * f
        data["lengths"][str(n)] = {"base": b, "full": f, "cca": c, "tasks": tasks}
        cells = ", ".join(f"{t} {a if a is None else round(a, 2)} / {z if z is None else round(z, 2)}"
                          for t, (a, z) in tasks.items())
        lines.append(f"| {n} | {b:.3f} | {f:.3f} | {c:.3f} | {c / f:.4f} | {cells} |")
    lines.append("")
    lines.append(f"finetune wall time: full {runs['full']['finetune_s']:.0f}s, CCA {runs['cca']['finetune_s']:.0f}s "
                 f"(whole runs {runs['full']['seconds']:.0f}s / {runs['cca']['seconds']:.0f}s); bar: CCA extended "
                 f"<= {EXTEND_BAR} x full attention extended at every length")
    return "\n".join(lines), ok, data


def table(rows: list[dict]) -> str:
    lines = ["| g | s | method | length | base ppl | CCA before | CCA after | after/base | after<=before |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['g']} | {r['s']} | {r['method']} | FAILED: {r['error'].splitlines()[-1]} |||||||")
            continue
        for length, p in r["ppl"].items():
            lines.append(f"| {r['g']} | {r['s']} | {r['method']} | {length} | {p['base']:.3f} | {p['cca_before']:.3f} | "
                         f"{p['cca_after']:.3f} | {p['cca_after'] / p['base']:.4f} | "
                         f"{'yes' if p['cca_after'] <= p['cca_before'] * (1 + 1e-9) else 'NO'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=None,
                    help="default: out/fidelity-llama (out/fidelity-llama-passkey with --passkey-base)")
    ap.add_argument("--work", type=Path, default=REPO / "out" / "fidelity")
    ap.add_argument("--settings", default="16:256,8:128", help="g:s pairs")
    ap.add_argument("--methods", default="lora,qkv,full")
    ap.add_argument("--steps", type=int, default=None, help="finetune steps (default: the recipe's)")
    ap.add_argument("--quick", action="store_true", help="one row: 16:256, lora, 40 steps")
    ap.add_argument("--results", type=Path, default=None, help="write the table here (.md) and .json beside it")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dca", action="store_true", help="only the DCA row: base vs DCA from c to 8c")
    ap.add_argument("--extend", type=int, default=None, metavar="N",
                    help="only the extension rows: CCA extended xN (extend.factor) vs full attention extended the "
                         "same way, ppl at c..Nc and the task scores (method: the first of --methods)")
    ap.add_argument("--rope-theta", type=float, default=None,
                    help="with --dca: pretrain the base with this RoPE base (default 10000; Llama 3's is 500000) in "
                         "out/fidelity-llama-theta<THETA>")
    ap.add_argument("--commentaries", action="store_true",
                    help="with --dca: pretrain the base on KJV plus examples/data/commentaries.txt.xz (4x the text; "
                         "see prepare_commentaries.py) in out/fidelity-llama-comm...")
    ap.add_argument("--base-steps", type=int, default=None,
                    help="with --dca: the base's pretraining steps (default 400; 2000 with --passkey-base)")
    ap.add_argument("--seed", type=int, default=None, help="with --dca: the base's pretraining seed (default 0)")
    ap.add_argument("--passkey-trials", type=int, default=None,
                    help=f"with --passkey-base: trials per depth and length (x 5 depths; default {PASSKEY_TRIALS})")
    ap.add_argument("--no-speed", action="store_true",
                    help="with --dca: leave out the prefill timings (when several runs share one GPU)")
    ap.add_argument("--passkey-base", action="store_true",
                    help="with --dca: a base pretrained with passkey windows (out/fidelity-llama-passkey), and the "
                         "passkey bar")
    args = ap.parse_args()
    if args.quick:
        args.settings, args.methods, args.steps = "16:256", "lora", args.steps or 40

    import torch

    env = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__}
    import transformers
    import triton

    env.update(transformers=transformers.__version__, triton=triton.__version__)
    variants = {"--rope-theta": args.rope_theta, "--commentaries": args.commentaries or None,
                "--base-steps": args.base_steps, "--seed": args.seed, "--passkey-base": args.passkey_base or None,
                "--passkey-trials": args.passkey_trials, "--no-speed": args.no_speed or None}
    for flag, value in variants.items():
        if value is not None and not args.dca:
            ap.error(f"{flag} is for the DCA row (--dca)")
    if args.passkey_trials is not None and (not args.passkey_base or args.passkey_trials < 1):
        ap.error("--passkey-trials takes a count >= 1, with --passkey-base (the only base that retrieves keys)")
    theta = () if args.rope_theta is None else ("--rope-theta", f"{args.rope_theta:g}")
    extra = (PASSKEY_BASE if args.passkey_base else ()) + theta
    if args.commentaries:
        extra += ("--extra-train", str(REPO / "examples" / "data" / "commentaries.txt.xz"))
    if args.base_steps is not None:
        extra += ("--steps", str(args.base_steps))  # the last --steps wins over PASSKEY_BASE's
    if args.seed is not None:
        extra += ("--seed", str(args.seed))
    if args.base is None:
        name = "fidelity-llama" + ("-passkey" if args.passkey_base else "") + ("-comm" if args.commentaries else "")
        name += f"-theta{args.rope_theta:g}" if theta else ""
        name += f"-steps{args.base_steps}" if args.base_steps is not None else ""
        name += f"-seed{args.seed}" if args.seed is not None else ""
        args.base = REPO / "out" / name
    pretrain_s = ensure_base(args.base, args.device, extra)
    summary = json.loads((args.base / "training_summary.json").read_text()) if (
        args.base / "training_summary.json").is_file() else {}
    if args.extend:
        method = args.methods.split(",")[0] if args.methods != "lora,qkv,full" else "qkv"
        text, ok, data = extend_rows(args.base, args.work, args.extend, method, args.steps)
        head = (f"Context extension x{args.extend} on held-out KJV books ({env['device']}, torch {env['torch']}, "
                f"transformers {env['transformers']}, triton {env['triton']}); base trained at c = 2048, finetune "
                f"{method} at {2048 * args.extend} tokens")
        print(f"\n{head}\n\n{text}\n\n{'PASS' if ok else 'FAIL'}")
        if args.results:
            args.results.parent.mkdir(parents=True, exist_ok=True)
            args.results.write_text(f"{head}\n\nCommand: `python benchmarks/fidelity.py --extend {args.extend}"
                                    f"{f' --steps {args.steps}' if args.steps else ''}`\n\n{text}\n")
            args.results.with_suffix(".json").write_text(json.dumps({"env": env, "base": summary, **data}, indent=1))
        return 0 if ok else 1
    if args.dca:
        text, ok, data = dca_row(args.base, args.work / "dca", args.passkey_base, speed=not args.no_speed,
                                 trials=args.passkey_trials or PASSKEY_TRIALS)  # None: the default
        print(f"\nDCA on held-out KJV books ({env['device']}, torch {env['torch']}, transformers "
              f"{env['transformers']}, triton {env['triton']}), base trained at c = 2048"
              + (f" with {summary['passkey_frac']:g} of its windows passkey prompts" if summary.get("passkey_frac") else "")
              + (f", RoPE base {summary['rope_theta']:g}" if summary.get("rope_theta") else "")
              + (f", {summary['steps']} steps, seed {summary['seed']}" if "steps" in summary else "")
              + (f", plus {', '.join(summary['extra_train'])}" if summary.get("extra_train") else "")
              + f":\n\n{text}\n\n{'PASS' if ok else 'FAIL'}")
        if args.results:
            args.results.parent.mkdir(parents=True, exist_ok=True)
            flags = "".join(f" {flag}" if value is True else f" {flag} {value:g}" if isinstance(value, float)
                            else f" {flag} {value}" for flag, value in variants.items() if value is not None)
            args.results.write_text(f"Command: `python benchmarks/fidelity.py --dca{flags}` ({env['device']}, torch "
                                    f"{env['torch']}, transformers {env['transformers']}, triton {env['triton']}; "
                                    f"base: {summary})\n\n{text}\n")
            args.results.with_suffix(".json").write_text(json.dumps({"env": env, "base": summary, **data}, indent=1))
        return 0 if ok else 1
    rows = []
    for setting in args.settings.split(","):
        g, s = (int(x) for x in setting.split(":"))
        for method in args.methods.split(","):
            row = convert(args.base, args.work / f"g{g}-s{s}-{method}", g, s, method, args.steps)
            rows.append(row)
            status = "error" if "error" in row else ("PASS" if row["pass"] else "FAIL")
            print(f"  -> {status} ({row['seconds']:.0f}s)", flush=True)
    text = table(rows)
    head = (f"Fidelity on held-out KJV books ({env['device']}, torch {env['torch']}, transformers "
            f"{env['transformers']}, triton {env['triton']}); base: {summary.get('parameters', '?'):,} parameters, "
            f"held-out ppl @2048 {summary.get('heldout_ppl', '?')} in its own training script"
            + (f", pretrained here in {pretrain_s:.0f}s" if pretrain_s else ""))
    print("\n" + head + "\n\n" + text)
    ok = all(r.get("pass") for r in rows)
    print(f"\n{sum(bool(r.get('pass')) for r in rows)}/{len(rows)} rows meet after <= before and after <= "
          f"{MAX_RATIO} x base at every length")
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(f"{head}\n\nCommand: `python benchmarks/fidelity.py"
                                f"{' --quick' if args.quick else ''}`\n\n{text}\n")
        args.results.with_suffix(".json").write_text(json.dumps({"env": env, "base": summary, "rows": rows}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
