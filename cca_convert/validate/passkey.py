"""Passkey retrieval (Mohtashami & Jaggi 2023, as in the CCA paper): a random number hidden at a given depth
of repetitive filler text, then asked for at the end.

Each prompt is exactly L tokens long including the answer: ``[bos] PREFIX filler(NEEDLE at depth) filler
QUESTION ANSWER``. The model reads it in one forward pass and a trial counts as correct when, at every
answer position, the most likely next token is the answer's token: this is exactly what greedy decoding of
the answer would produce, without running a decode loop.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .perplexity import eval_mode, hidden_states

PREFIX = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the important information there.\n")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER = " {key}"


@dataclass
class Trial:
    input_ids: torch.Tensor  # (L,)
    answer_start: int  # index of the first answer token
    key: str
    depth: float


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_trials(tokenizer, length: int, depths: list[float], trials: int, digits: int, seed: int) -> list[Trial]:
    """The prompts at one length (empty when ``length`` is too short to hold one)."""
    rng = random.Random(f"{seed}-{length}")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    prefix, filler, question = _encode(tokenizer, PREFIX), _encode(tokenizer, FILLER), _encode(tokenizer, QUESTION)
    out = []
    for depth in depths:
        for _ in range(trials):
            key = str(rng.randrange(10 ** (digits - 1), 10**digits))
            needle, answer = _encode(tokenizer, NEEDLE.format(key=key)), _encode(tokenizer, ANSWER.format(key=key))
            n_filler = length - len(bos) - len(prefix) - len(needle) - len(question) - len(answer)
            if n_filler < 0:
                return []
            fill = (filler * (n_filler // len(filler) + 1))[:n_filler]
            # the needle goes at a sentence boundary of the filler, as close to the depth as possible
            at = round(depth * n_filler / len(filler)) * len(filler)
            at = min(at, n_filler)
            ids = bos + prefix + fill[:at] + needle + fill[at:] + question + answer
            assert len(ids) == length
            out.append(Trial(torch.tensor(ids, dtype=torch.long), length - len(answer), key, depth))
    return out


def passkey_accuracy(model, trials: list[Trial], batch_size: int = 1) -> dict:
    """Fraction of trials whose answer greedy decoding reproduces exactly; also per depth."""
    correct: list[bool] = []
    token_hits: list[float] = []  # fraction of the answer's tokens (digits) predicted right, teacher-forced
    head = model.get_output_embeddings()
    with eval_mode(model):
        for i in range(0, len(trials), batch_size):
            chunk = trials[i:i + batch_size]
            ids = torch.stack([t.input_ids for t in chunk])
            hidden = hidden_states(model, ids)
            for b, t in enumerate(chunk):
                positions = torch.arange(t.answer_start - 1, ids.shape[1] - 1, device=hidden.device)
                predicted = head(hidden[b, positions]).argmax(-1).cpu()
                answer = t.input_ids[t.answer_start:]
                correct.append(bool(torch.equal(predicted, answer)))
                token_hits.append((predicted == answer).float().mean().item())
    by_depth: dict[str, list[bool]] = {}
    for t, ok in zip(trials, correct):
        by_depth.setdefault(f"{t.depth:g}", []).append(ok)
    return {
        "accuracy": sum(correct) / len(correct) if correct else None,
        "correct": sum(correct),
        "trials": len(correct),
        "digit_accuracy": sum(token_hits) / len(token_hits) if token_hits else None,
        "by_depth": {d: sum(v) / len(v) for d, v in by_depth.items()},
    }


__all__ = ["Trial", "make_trials", "passkey_accuracy"]
