"""The RULER-style tasks: prompts that fit L with their answer, needles where they are said to be, the answers in the
prompt, scoring by RULER's string_match_all, and a model that can answer scoring 1."""

import pytest
import torch
from transformers import AutoTokenizer

from cca_convert.validate.data import token_stream
from cca_convert.validate.tasks import NEEDLE_TASKS, TASKS, make_samples, score, string_match_all

TINY = "examples/tiny-llama"


@pytest.fixture(scope="module")
def tok_stream():
    tok = AutoTokenizer.from_pretrained(TINY)
    return tok, token_stream(tok, [open("examples/data/heldout.txt").read()], None)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [333, 1024, 3001])
def test_each_prompt_and_its_answer_fit_the_length_and_hold_what_is_asked(tok_stream, task, length):
    tok, stream = tok_stream
    samples = make_samples(task, tok, length, stream, 3, seed=0)
    if not samples:  # a task whose smallest prompt does not fit is left out at that length (and the report says so)
        assert length == 333 and task in ("variable_tracking", "frequent_words", "common_words")
        return
    assert len(samples) == 3
    for s in samples:
        n = s.input_ids.numel() + s.max_new_tokens
        assert length - 64 < n <= length  # filled to the length, answer budget included
        text = tok.decode(s.input_ids.tolist())
        if task.startswith("niah") or task == "variable_tracking":
            assert all(a in text for a in s.answers)  # the needles / the chain are in the haystack
        if task == "common_words":  # each common word listed more often than any other
            counts = {w: text.count(f". {w}\n") + text.endswith(f". {w}") for w in set(text.split())}
            assert min(text.count(f". {a}\n") for a in s.answers) > max(
                (c for w, c in counts.items() if w not in s.answers), default=0)
    if task in NEEDLE_TASKS:  # depths evenly spread; the queried needle's place follows its depth
        assert [s.depth for s in samples] == [0.0, 0.5, 1.0]
        places = []
        for s in samples:
            text = tok.decode(s.input_ids.tolist())
            lo, hi = text.index("afterwards.") + 11, text.rindex("What are all")  # the haystack's span
            places.append((text.index(s.answers[0]) - lo) / (hi - lo))
        if length >= 1024:  # (sentence ends are far apart in a short haystack)
            assert places[0] < 0.1 and 0.4 < places[1] < 0.6 and places[2] > 0.9, places
    # deterministic for a seed, different for another
    again = make_samples(task, tok, length, stream, 3, seed=0)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(samples, again))
    assert samples[0].answers != make_samples(task, tok, length, stream, 3, seed=1)[0].answers


def test_string_match_all_is_the_fraction_of_references_found():
    assert string_match_all("the numbers are 123 and 456", ["123", "456"]) == 1.0
    assert string_match_all("The Numbers: ABC", ["abc", "def"]) == 0.5
    assert string_match_all("", ["1"]) == 0.0


class _Answering(torch.nn.Module):
    """A stand-in whose generate() writes the given texts (the scorer must read what the model generates)."""

    def __init__(self, tok, texts):
        super().__init__()
        self.w, self.tok, self.texts = torch.nn.Parameter(torch.zeros(1)), tok, list(texts)

    def generate(self, ids, attention_mask, generation_config):
        new = self.tok(self.texts.pop(0), add_special_tokens=False, return_tensors="pt")["input_ids"]
        return torch.cat([ids, new[:, :generation_config.max_new_tokens]], dim=1)


def test_score_reads_what_greedy_decoding_generated(tok_stream):
    tok, stream = tok_stream
    samples = make_samples("niah_multikey", tok, 1024, stream, 2, seed=0)
    right, wrong = " " + samples[0].answers[0] + ".", " 1234567."
    result = score(_Answering(tok, [right, wrong]), tok, samples)
    assert result["accuracy"] == 0.5 and result["by_depth"] == {"0": 1.0, "1": 0.0} and result["samples"] == 2
    # the answer budget is the answer's tokens plus slack: a model that rambles first is cut off
    late = " ".join(["and"] * 60) + samples[1].answers[0]
    assert score(_Answering(tok, [right, late]), tok, samples)["by_depth"]["1"] == 0.0


def test_a_real_model_is_scored_by_generate(tok_stream):
    from transformers import AutoModelForCausalLM

    tok, stream = tok_stream
    model = AutoModelForCausalLM.from_pretrained(TINY)
    samples = make_samples("niah_single", tok, 512, stream, 1, seed=0)
    result = score(model, tok, samples)
    assert result["samples"] == 1 and result["accuracy"] in (0.0, 1.0)
