"""RULER-style long-context tasks (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language
Models?", 2024), generated offline at each validation length and scored by greedy decoding.

The tasks and their templates follow RULER's (``scripts/data/synthetic/constants.py``): the needle-in-a-haystack
variants with word keys and 7-digit values, variable tracking (one chain of 4 hops), common words extraction and
frequent (coded) words extraction. A sample's score is RULER's ``string_match_all``: the fraction of its reference
strings found in the generated text (case-insensitive); a task's score at a length is the mean over its samples.

Where this deviates from RULER, and why:

- The haystack of the needle tasks is the held-out text (RULER: Paul Graham's essays), so no download is needed and
  the text is the model's own domain; keys and the common-words vocabulary are words of that text (RULER: an English
  word list), falling back to made-up syllable words when the text has too few.
- A prompt holds ``L - tokens_to_generate`` tokens so that prompt and answer fit in L; the answer budget is the
  reference answer's length plus 16 tokens (RULER: 128 / 30 / 120 / 50 per task), since the score only looks for
  the references.
- Needles go at the sentence end nearest their depth; sample i of N puts the (first) needle at depth i/(N-1)
  (RULER: random depths), so the needle tasks give a depth x length table.
- Common words: 10 words 30 times each among words seen 3 times, fewer repeats (down to 2 and 1) where L is too short
  to hold that; no few-shot example (RULER adds one). Frequent words: a Zipf(2) draw over 3-letter coded words.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

import torch

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking", "common_words",
         "frequent_words")
NEEDLE_TASKS = ("niah_single", "niah_multikey")  # one queried needle: its depth is the sample's (the heatmap's rows)
ANSWER_SLACK = 16

NIAH = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz you "
        "about the {kind} afterwards.\n{context}\nWhat are all the special magic {kind} for {query} mentioned in the "
        "provided text? The special magic {kind} for {query} mentioned in the provided text are")
NEEDLE = " One of the special magic numbers for {key} is: {value}."
VT = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: "
      "Find all variables that are assigned the value {query} in the text above. Answer: According to the chain(s) "
      "of variable assignment in the text above, {n} variables are assigned the value {query}, they are:")
NOISE = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
CWE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
       "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list? Answer: "
       "The top 10 words that appear most often in the list are:")
FWE = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
       "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
       "What are the three most frequently appeared words in the above coded text? Answer: According to the coded "
       "text above, the three most frequently appeared words are:")


@dataclass
class Sample:
    task: str
    input_ids: torch.Tensor  # the prompt, (n,) with n + max_new_tokens <= L
    answers: list[str]
    max_new_tokens: int
    depth: float | None = None


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # (no "longer than the max" warning)


def _words(tokenizer, stream: torch.Tensor, rng: random.Random, n: int) -> list[str]:
    """``n`` distinct words: lowercase words of the held-out text, then made-up syllable words."""
    text = tokenizer.decode(stream[:200_000].tolist())
    seen = sorted({w for w in re.findall(r"\b[a-z]{4,10}\b", text.lower())})
    rng.shuffle(seen)
    out, taken = seen[:n], set(seen[:n])
    while len(out) < n:
        w = "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(2, 4)))
        if w not in taken:
            out.append(w)
            taken.add(w)
    return out


def _sentence_ends(tokenizer, ids: list[int]) -> list[int]:
    """Positions right after a token ending a sentence (where a needle can go without splitting a word)."""
    pieces = tokenizer.convert_ids_to_tokens(ids)
    return [i + 1 for i, p in enumerate(pieces) if isinstance(p, str) and p.rstrip().endswith((".", "!", "?"))]


def _insert(tokenizer, hay: list[int], needles: list[tuple[float, list[int]]]) -> list[int]:
    """``hay`` with each needle's tokens inserted at the sentence end nearest its depth (0..1)."""
    ends = _sentence_ends(tokenizer, hay) or list(range(len(hay) + 1))
    cuts = []
    for depth, ids in needles:
        want = depth * len(hay)
        cuts.append((min(ends, key=lambda e: abs(e - want)), ids))
    out, last = [], 0
    for at, ids in sorted(cuts, key=lambda c: c[0]):
        out += hay[last:at] + ids
        last = at
    return out + hay[last:]


def _fill(budget: int, build) -> list[int] | None:
    """The longest prompt ``build(n)`` (n: filler amount) that fits ``budget`` tokens, by bisection on n."""
    lo, hi, best = 0, budget, None
    while lo <= hi:
        mid = (lo + hi) // 2
        ids = build(mid)
        if len(ids) <= budget:
            best, lo = ids, mid + 1
        else:
            hi = mid - 1
    return best


def _depths(n: int) -> list[float]:
    return [i / (n - 1) for i in range(n)] if n > 1 else [0.5]


def _niah(task, tokenizer, stream, rng, depth, words, bos):
    keys = rng.sample(words, 4)
    value = lambda: str(rng.randrange(1_000_000, 10_000_000))  # noqa: E731
    if task == "niah_single":
        needles, queried = [(keys[0], value())], [keys[0]]
    elif task == "niah_multikey":
        needles, queried = [(k, value()) for k in keys], [keys[0]]
    elif task == "niah_multivalue":
        needles, queried = [(keys[0], value()) for _ in range(4)], [keys[0]]
    else:  # niah_multiquery
        needles, queried = [(k, value()) for k in keys], keys
    answers = [v for k, v in needles if k in queried]
    places = [depth] + [rng.random() for _ in needles[1:]]
    query = ", ".join(queried[:-1]) + (" and " if len(queried) > 1 else "") + queried[-1]
    head, tail = NIAH.split("{context}")
    head_ids = bos + _encode(tokenizer, head.format(kind="numbers"))
    tail_ids = _encode(tokenizer, tail.format(kind="numbers", query=query))
    needle_ids = [(d, _encode(tokenizer, NEEDLE.format(key=k, value=v))) for d, (k, v) in zip(places, needles)]
    start = rng.randrange(0, stream.numel())

    def build(n):
        hay = stream.roll(-start)[:n].tolist()
        hay = (hay * (n // max(1, len(hay)) + 1))[:n]  # a held-out text shorter than L is read again
        return head_ids + _insert(tokenizer, hay, needle_ids) + tail_ids

    return build, answers


def _variable_tracking(tokenizer, rng, bos):
    value = str(rng.randrange(10_000, 100_000))
    names = []
    while len(names) < 5:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    chain = [f" VAR {names[0]} = {value}."] + [f" VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    head, tail = VT.split("{context}")
    head_ids, tail_ids = bos + _encode(tokenizer, head), _encode(tokenizer, tail.format(query=value, n=len(names)))
    noise, links = _encode(tokenizer, NOISE), [_encode(tokenizer, c) for c in chain]

    def build(n):
        hay = (noise * (n // len(noise) + 1))[:n]
        places = [(i + 1) / (len(links) + 1) for i in range(len(links))]  # in order, evenly spread
        return head_ids + _insert(tokenizer, hay, list(zip(places, links))) + tail_ids

    return build, names


def _common_words(tokenizer, rng, words, budget, bos):
    common, rare_pool = words[:10], words[10:]
    head, tail = CWE.split("{context}")
    head_ids, tail_ids = bos + _encode(tokenizer, head), _encode(tokenizer, tail)
    for freq_common, freq_rare in ((30, 3), (10, 2), (2, 1)):
        def build(n, fc=freq_common, fr=freq_rare):
            listed = common * fc + rare_pool[:n] * fr
            random.Random(n).shuffle(listed)  # the same order for the same n
            text = "".join(f"\n{i + 1}. {w}" for i, w in enumerate(listed))
            return head_ids + _encode(tokenizer, text) + tail_ids

        if len(build(0)) <= budget:
            return build, common
    return None, common


def _frequent_words(tokenizer, rng, bos):
    vocab = []
    while len(vocab) < 40:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
        if w not in vocab:
            vocab.append(w)
    head, tail = FWE.split("{context}")
    head_ids, tail_ids = bos + _encode(tokenizer, head), _encode(tokenizer, tail)
    weights = [1 / (r + 1) ** 2 for r in range(len(vocab))]  # Zipf, alpha 2: rank r's count ~ 1 / r^2

    def build(n):
        counts = [max(1, round(n * w / sum(weights))) for w in weights]
        counts[1], counts[2] = min(counts[1], counts[0] - 1), min(counts[2], counts[1] - 1)  # a strict top 3
        listed = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(n).shuffle(listed)
        return head_ids + _encode(tokenizer, " " + " .... ".join(listed)) + tail_ids

    return build, vocab[:3]


def make_samples(task: str, tokenizer, length: int, stream: torch.Tensor, samples: int, seed: int) -> list[Sample]:
    """``samples`` prompts of ``task`` fitting ``length`` tokens with their answer (empty: the task does not fit)."""
    rng = random.Random(f"{seed}-{task}-{length}")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    # keys (4 per prompt) and the common words' list: up to one word per ~9 tokens of the prompt
    words = _words(tokenizer, stream, random.Random(seed), max(400, length // 9 if task == "common_words" else 0))
    out = []
    for depth in _depths(samples):
        if task.startswith("niah"):
            build, answers = _niah(task, tokenizer, stream, rng, depth, words, bos)
        elif task == "variable_tracking":
            build, answers = _variable_tracking(tokenizer, rng, bos)
        elif task == "common_words":
            build, answers = _common_words(tokenizer, rng, rng.sample(words, len(words)), length, bos)
        elif task == "frequent_words":
            build, answers = _frequent_words(tokenizer, rng, bos)
        else:
            raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
        new_tokens = len(_encode(tokenizer, " " + ", ".join(answers))) + ANSWER_SLACK
        found = _fill(length - new_tokens, build) if build else None
        if found is None:
            return []
        out.append(Sample(task, torch.tensor(found, dtype=torch.long), answers, new_tokens,
                          depth if task in NEEDLE_TASKS else None))
    return out


def string_match_all(prediction: str, answers: list[str]) -> float:
    text = prediction.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def score(model, tokenizer, samples: list[Sample]) -> dict:
    """Greedy decoding of each prompt; RULER's string_match_all per sample, the mean, and the mean per depth."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    scores, by_depth = [], {}
    for s in samples:
        config = GenerationConfig(max_new_tokens=s.max_new_tokens, do_sample=False, eos_token_id=eos,
                                  pad_token_id=eos if eos is not None else 0)
        ids = s.input_ids[None].to(device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        text = tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
        scores.append(string_match_all(text, s.answers))
        if s.depth is not None:
            by_depth.setdefault(f"{s.depth:g}", []).append(scores[-1])
    return {"accuracy": sum(scores) / len(scores) if scores else None, "samples": len(scores),
            "by_depth": {d: sum(v) / len(v) for d, v in by_depth.items()}}


__all__ = ["TASKS", "NEEDLE_TASKS", "Sample", "make_samples", "score", "string_match_all"]
