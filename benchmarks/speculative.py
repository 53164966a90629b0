"""Speculative decoding in real ``generate()``: prompt-lookup decoding against plain greedy decoding, same model.

What users run: a prompt of L tokens, a real prefill, then ``model.generate()`` greedy, once plainly and once with
``prompt_lookup_num_tokens`` (transformers' prompt-lookup decoding: drafts copied from earlier n-grams of the text,
verified by one forward pass of the drafts, the rejected ones cropped off the cache). On CUDA both replay captured
steps: one-token steps, and verification passes of up to the cache's speculative slack (``cache_cca.py``).

The time per token is read inside the one ``generate()`` call: a streamer stamps the host clock after every step or
verification pass, when generate() hands it the tokens it accepted (copying them to the host waits for the device).
A pass that captured a new CUDA graph (the first pass of each length, with its compiled twins) is slower than all
others: "steady" ms/token leaves those passes and the first ``--skip`` out, "all" keeps every pass after the first.
The outputs of both calls are compared: prompt lookup must give exactly the greedy tokens; where they differ, the
first differing token's greedy logits are printed (a near tie that rounding decides, or a bug).

How much a draft helps depends on the text and the draft. The prompt is a random unit of ``--unit`` tokens repeated
up to L (the kind of text prompt lookup is for: code edits, quoting); with random weights, what the model generates
after it decides how many drafts it accepts, so the acceptance is printed beside the times (tokens per pass). A
model with random weights does not copy from its context, so prompt lookup's drafts are mostly rejected: that row is
the cost of drafts that fail. The "oracle" rows stand in for a good draft (a draft model or lookup on text that does
repeat): the same assisted-decoding loop of transformers, with drafts taken from the greedy run's own output, right
for the first ``k`` of ``--lookup-tokens`` drafts of every pass and wrong after (``--oracle-right``). They propose
nothing at the first pass, so the prefill is the greedy run's (one of L columns). Prompt lookup's first call holds
the prompt and its first drafts; the model runs it as the prompt's prefill and then a verification pass of the drafts
(``cca_hf.py``, ``_prompt_then_drafts``), so its prefill is greedy's too. Every row's tokens must equal greedy's
exactly (exit 1 otherwise); where they differ, the first difference is printed with both runs' logits.

Model: the Llama-3.1-8B shape with random bf16 weights, the CLI's CCA defaults (``benchmarks/decode.py``'s model);
``--smoke``: a tiny one that runs on a CPU. ``--model``: a trained CCA export (a folder or Hub id, loaded with
``trust_remote_code``), on real text with ``--text``: the prompt is the file's first L - ``--quote`` tokens and then
its first ``--quote`` tokens again, a quote that a model which learnt the text goes on quoting, so that prompt
lookup's drafts (the tokens after the quote's first occurrence) are right for as long as the model follows the text.

    python benchmarks/speculative.py --out benchmarks/results/speculative-h200      # 8K/32K/128K, batch 1
    python benchmarks/speculative.py --smoke --device cpu                           # the code path, tiny
    python benchmarks/speculative.py --model out/fidelity/g16-s256-lora --text examples/data/finetune.txt \
        --contexts 1024,1800 --new-tokens 200                                       # fidelity.py's KJV model
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import torch
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.streamers import BaseStreamer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.decode import build, describe  # noqa: E402
from benchmarks.results_out import save_results  # noqa: E402
from cca_convert.modeling.attention_hooks import CACHE_ARG  # noqa: E402


class PassClock(BaseStreamer):
    """Stamps (host time, tokens accepted, whether a graph was captured since the last stamp) at every step or
    verification pass; the first ``put`` is the prompt."""

    def __init__(self):
        self.stamps, self.captured = [], False

    def put(self, value):
        self.stamps.append((time.perf_counter(), value.shape[-1], self.captured))
        self.captured = False

    def end(self):
        pass


class OracleDrafts(CandidateGenerator):
    """Drafts from a known continuation (the greedy run's tokens): the first ``right`` of ``n`` drafts of each pass
    are those tokens, the next one is another token. None at the first pass (the prompt is prefilled alone)."""

    requires_model_outputs = False

    def __init__(self, reference, n, right, vocab):
        self.reference, self.n, self.right, self.vocab, self.first = reference, n, right, vocab, True

    def get_candidates(self, input_ids, **kwargs):
        if self.first:
            self.first = False
            return input_ids, None
        drafts = self.reference[:, input_ids.shape[1]:input_ids.shape[1] + self.n].clone()
        if self.right < drafts.shape[1]:
            drafts[:, self.right] = (drafts[:, self.right] + 1) % self.vocab
        return torch.cat([input_ids, drafts], 1), None

    def update_candidate_strategy(self, *args, **kwargs):
        pass

    @property
    def num_drafting_tokens(self):  # transformers >= 5.25 sizes the cache's past recording by it
        return self.n


def load_trained(args, dtype, device):
    """A CCA export and the token ids of ``--text`` (1, n), checked to hold the longest context's prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True, dtype=dtype).to(device).eval()
    if not hasattr(model.config, "cca_group_size"):
        raise SystemExit(f"--model {args.model} is not a CCA export (its config has no cca_group_size)")
    ids = tokenizer(args.text.read_text(encoding="utf-8"), return_tensors="pt").input_ids
    if ids.shape[1] < max(args.contexts) - args.quote:
        raise SystemExit(f"--text {args.text} has {ids.shape[1]} tokens: too few for a {max(args.contexts)}-token prompt")
    pad = model.generation_config.pad_token_id
    model.generation_config = GenerationConfig(pad_token_id=pad if pad is not None else tokenizer.eos_token_id)
    return model, ids


def timed(model, ids, args, **kwargs) -> dict:
    clock = PassClock()
    # the decode_graph module of the model's own package (an export loaded with trust_remote_code has its own copy)
    graphs_cls = importlib.import_module(type(model).__module__.rpartition(".")[0] + ".decode_graph").DecodeGraphs
    capture = graphs_cls.capture

    def counted(self, *a, **kw):  # (instrumentation: which passes captured a graph)
        clock.captured = True
        return capture(self, *a, **kw)

    oracle = kwargs.pop("oracle", None)
    if oracle is not None:  # (transformers' assisted-decoding loop, with these drafts)
        model._get_candidate_generator = lambda *a, **kw: oracle
        kwargs["prompt_lookup_num_tokens"] = oracle.n
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    graphs_cls.capture = counted
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                 do_sample=False, streamer=clock, return_dict_in_generate=True, output_logits=True,
                                 **kwargs)
    finally:
        graphs_cls.capture = capture
        model.__dict__.pop("_get_candidate_generator", None)
    total = time.perf_counter() - start
    passes = [(b[0] - a[0], b[1], b[2]) for a, b in zip(clock.stamps[1:], clock.stamps[2:])]  # after the first
    steady = [p for p in passes[args.skip:] if not p[2]]
    if not steady:
        raise RuntimeError(f"no steady passes among {len(passes)}: raise --new-tokens above --skip")
    graphs = getattr(getattr(out, CACHE_ARG), "decode_graphs", None)
    ms, tokens = sum(p[0] for p in steady) * 1e3, sum(p[1] for p in steady)
    return {"sequences": out.sequences, "logits": out.logits, "ms_per_token": ms / tokens,
            "ms_per_token_all": sum(p[0] for p in passes) * 1e3 / sum(p[1] for p in passes),
            "passes": len(steady), "capture_passes": sum(p[2] for p in passes), "tokens_per_pass": tokens / len(steady),
            "ms_per_pass": ms / len(steady), "total_s": total, "graph_replays": graphs.replays if graphs else 0,
            "captured": sorted(str(tuple(k)) for k in graphs.captured) if graphs else []}


def divergence(greedy, lookup, prompt_len) -> str:
    """Where two greedy token sequences first differ, with the greedy call's top logits there."""
    a, b = greedy["sequences"][0, prompt_len:], lookup["sequences"][0, prompt_len:]
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    if not len(diff):
        return "equal" if len(a) == len(b) else f"lengths {len(a)} / {len(b)}"
    i = int(diff[0])
    top = greedy["logits"][i][0].float().topk(2)
    other = float(lookup["logits"][i][0].float()[a[i]]), float(lookup["logits"][i][0].float()[b[i]])
    return (f"first differing token {i}: greedy {int(a[i])} (logit {float(top.values[0]):.4f}), runner-up "
            f"{int(top.indices[1])} ({float(top.values[1]):.4f}); lookup chose {int(b[i])}, its logits for the two: "
            f"{other[0]:.4f} / {other[1]:.4f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--contexts", type=ints, default=[8192, 32768, 131072])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens (drafts per pass)")
    ap.add_argument("--unit", type=int, default=1024, help="the prompt is a random unit of this many tokens, repeated")
    ap.add_argument("--skip", type=int, default=4, help="first steps left out (compilation, graph capture)")
    ap.add_argument("--oracle-right", type=ints, default=[10, 3], help="oracle rows: right drafts per pass")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--local-window", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="a tiny model (any device): the code path, not the numbers")
    ap.add_argument("--model", default=None, help="a CCA export (folder or Hub id) instead of the random 8B shape")
    ap.add_argument("--text", type=Path, default=None, help="with --model: the prompt's text file (UTF-8)")
    ap.add_argument("--quote", type=int, default=64, help="with --text: tokens of the text's start repeated at the end")
    ap.add_argument("--out", type=Path, default=None, help="folder for speculative.md / speculative.json")
    args = ap.parse_args()
    if (min(args.contexts) < 2 or args.unit < 1 or args.lookup_tokens < 1 or args.new_tokens < 2
            or any(not 0 <= k <= args.lookup_tokens for k in args.oracle_right)):
        ap.error("--contexts, --unit, --lookup-tokens and --new-tokens must be positive (contexts and new tokens >= 2), "
                 "--oracle-right between 0 and --lookup-tokens")
    if (args.text is None) != (args.model is None) or (args.model and args.smoke):
        ap.error("--model and --text go together (a trained model on real text), and not with --smoke")
    if args.text is not None and not (1 <= args.quote < min(args.contexts)):
        ap.error(f"--quote must be at least 1 and shorter than the shortest context ({min(args.contexts)})")
    if args.text is not None and not args.text.is_file():
        ap.error(f"--text {args.text}: no such file")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    t0 = time.time()
    if args.model is None:
        model, _ = build(argparse.Namespace(**vars(args), prefill_rows=0), dtype)  # (decode.py's model; full unused)
        prompt = f"a random unit of {args.unit} tokens repeated"
        text = None
    else:
        model, text = load_trained(args, dtype, device)
        prompt = f"{args.text.name}'s first L - {args.quote} tokens, then its first {args.quote} again"
    head = (f"{describe(name, model, dtype, t0)}; batch 1, {args.new_tokens} new tokens, prompt: {prompt}, "
            f"prompt_lookup_num_tokens={args.lookup_tokens}")
    print(head, flush=True)
    rows = []
    for context in args.contexts:
        if text is None:
            gen = torch.Generator().manual_seed(context)
            unit = torch.randint(3, model.config.vocab_size, (1, args.unit), generator=gen)
            ids = unit.repeat(1, -(-context // args.unit))[:, :context].to(device)
        else:
            ids = torch.cat([text[:, :context - args.quote], text[:, :args.quote]], 1).to(device)
        greedy = timed(model, ids, args)
        reference = greedy["sequences"]
        drafts = {"prompt lookup": dict(prompt_lookup_num_tokens=args.lookup_tokens)}
        for k in args.oracle_right:
            drafts[f"oracle, {k} of {args.lookup_tokens} right"] = dict(
                oracle=OracleDrafts(reference, args.lookup_tokens, k, model.config.vocab_size))
        for name, kwargs in drafts.items():
            cell = timed(model, ids, args, **kwargs)
            where = divergence(greedy, cell, context)
            del cell["sequences"], cell["logits"]
            rows.append({"context": context, "drafts": name, "greedy": greedy, "spec": cell,
                         "equal": where == "equal", "divergence": where})
            print(f"  L={context} {name}: greedy {greedy['ms_per_token']:.2f} ms/token, speculative "
                  f"{cell['ms_per_token']:.2f} ms/token ({cell['tokens_per_pass']:.2f} tokens per pass, "
                  f"{cell['ms_per_pass']:.2f} ms per pass; {cell['capture_passes']} passes captured graphs "
                  f"{cell['captured']}); {where}", flush=True)
        del greedy["sequences"], greedy["logits"]
    lines = ["| L | drafts | greedy ms/token | speculative ms/token (steady) | speed-up | speculative ms/token (all) | "
             "tokens per pass | ms per pass | greedy ms per step | tokens == greedy |", "|" + " --- |" * 10]
    for r in rows:
        g, p = r["greedy"], r["spec"]
        lines.append(f"| {r['context']} | {r['drafts']} | {g['ms_per_token']:.2f} | {p['ms_per_token']:.2f} | "
                     f"{g['ms_per_token'] / p['ms_per_token']:.2f}x | {p['ms_per_token_all']:.2f} | "
                     f"{p['tokens_per_pass']:.2f} | {p['ms_per_pass']:.2f} | {g['ms_per_pass']:.2f} | "
                     f"{'yes' if r['equal'] else 'NO'} |")
    differ = [f"- L={r['context']} {r['drafts']}: {r['divergence']}" for r in rows if not r["equal"]]
    lines += ["", "First differences from the greedy tokens:"] + differ if differ else []
    text = head + "\n\n" + "\n".join(lines)
    print("\n" + text)
    if args.out:
        save_results(args.out, "speculative", text, {"device": name, "rows": rows})
    if not all(r["equal"] for r in rows):
        print("speculative decoding did not give the greedy tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
