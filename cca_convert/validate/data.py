"""Held-out text for validation: reading it, tokenizing it into one stream, and refusing overlap with the
finetune data."""

from __future__ import annotations

import glob
import hashlib
from pathlib import Path
from typing import Any

import torch

from ..data import iter_documents, load_documents, resolve_files
from ..errors import CCAError
from .config import HeldoutData


SECTION = "validate.data"
HUB_DOCUMENTS = 64  # documents read from a Hub dataset when max_documents is unset


def load_texts(data: HeldoutData, max_chars: int | None = None) -> list[str]:
    """The held-out documents, through the same loader and ``text_field`` rule as the finetune data; at most
    ``max_documents`` of them and about ``max_chars`` characters."""
    if not data.given:
        raise CCAError("validate.data: give held-out text, e.g. validate.data.files: [heldout.txt] or "
                       "validate.data.dataset: emozilla/pg19-test (or --set validate.enabled=false)")
    limit = data.max_documents or (None if data.files else HUB_DOCUMENTS)
    texts, total = [], 0
    for doc in iter_documents(load_documents(data, SECTION), data, SECTION, batch_size=16):
        if (limit and len(texts) >= limit) or (max_chars and total >= max_chars):
            break
        texts.append(doc)
        total += len(doc)
    if not texts:
        raise CCAError(f"{SECTION}: {data.describe()} holds no text in column {data.text_field!r}")
    return texts


def token_stream(tokenizer, texts: list[str], max_tokens: int | None = None) -> torch.Tensor:
    """All documents as one 1-D stream of token ids: ``[bos] doc [eos] [bos] doc [eos] ...`` (bos/eos when the
    tokenizer has them). Windows are then contiguous slices of this stream."""
    ids: list[int] = []
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    for text in texts:
        # long documents are encoded piecewise (cut at line ends) so that max_tokens can stop early
        for piece in _pieces(text, 200_000):
            body = tokenizer(piece.text, add_special_tokens=False, verbose=False)["input_ids"]
            ids.extend(([bos] if bos is not None and piece.first else []) + body
                       + ([eos] if eos is not None and piece.last else []))
            if max_tokens and len(ids) >= max_tokens:
                return torch.tensor(ids[:max_tokens], dtype=torch.long)
    return torch.tensor(ids, dtype=torch.long)


class _Piece:
    def __init__(self, text, first, last):
        self.text, self.first, self.last = text, first, last


def _pieces(text: str, size: int):
    start = 0
    while True:
        end = len(text) if len(text) - start <= size else text.rfind("\n", start, start + size) + 1 or start + size
        yield _Piece(text[start:end], start == 0, end >= len(text))
        if end >= len(text):
            return
        start = end


# ----------------------------------------------------------------------------------------------------------------------
# No overlap with the finetune data
# ----------------------------------------------------------------------------------------------------------------------
def _strings(node: Any, key: str = "") -> list[tuple[str, str]]:
    """(key, value) of every string inside a dumped recipe section."""
    if isinstance(node, str):
        return [(key, node)]
    if isinstance(node, dict):
        return [kv for k, v in node.items() for kv in _strings(v, str(k))]
    if isinstance(node, (list, tuple)):
        return [kv for v in node for kv in _strings(v, key)]
    return []


def _files_under(value: str) -> list[Path]:
    if any(c in value for c in "*?["):
        return [Path(p) for p in sorted(glob.glob(value, recursive=True)) if Path(p).is_file()][:1000]
    path = Path(value).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return [p for p in sorted(path.rglob("*")) if p.is_file()][:1000]
    return []


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _lines(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines() if len(line.strip()) >= 40}


def check_no_overlap(data: HeldoutData, finetune: dict | None, max_shared_lines: float = 0.02) -> list[str]:
    """Raise CCAError if the held-out data is (or contains) the finetune data; return notes on what was checked.

    ``finetune`` is the dumped ``finetune:`` recipe section (its schema belongs to the finetune stage: every
    string in it that names an existing file or folder, or equals the held-out dataset id, is compared)."""
    if not finetune or finetune.get("enabled") is False:
        return ["no finetune data to compare with"]
    strings = _strings(finetune)
    notes = []
    if data.files:
        ft_files = [p for _, v in strings for p in _files_under(v)]
        if not ft_files:
            return ["the finetune section names no local file"]
        ft_by_path = {p.resolve(): p for p in ft_files}
        ft_sha = {_sha(p): p for p in ft_files if p.stat().st_size < 2**30}
        ft_lines: set[str] | None = None
        for name in resolve_files(data, SECTION):
            path = Path(name)
            if path.resolve() in ft_by_path:
                raise CCAError(f"validate.data.files: {name} is also finetune data: held-out text must not overlap it")
            if path.is_file() and _sha(path) in ft_sha:
                raise CCAError(f"validate.data.files: {name} has the same content as finetune file "
                               f"{ft_sha[_sha(path)]}: held-out text must not overlap the finetune data")
            if path.is_file():
                if ft_lines is None:
                    ft_lines = set().union(*(_lines(p.read_text(errors="replace")) for p in ft_files
                                             if p.stat().st_size < 2**28))
                held = _lines(path.read_text(errors="replace"))
                shared = len(held & ft_lines) / max(1, len(held))
                if shared > max_shared_lines:
                    raise CCAError(f"validate.data.files: {shared:.0%} of the lines of {name} also occur in the "
                                   f"finetune "
                                   f"data (limit {max_shared_lines:.0%}): use disjoint held-out text")
                notes.append(f"{name}: {shared:.2%} of its lines (>= 40 chars) occur in the finetune files")
        return notes
    if data.dataset:
        same = [k for k, v in strings if v == data.dataset]
        if same:
            splits = [v for k, v in strings if "split" in k.lower()]
            configs = [v for k, v in strings if "config" in k.lower() or k.lower() in ("name", "subset")]
            same_config = not configs or data.config is None or data.config in configs
            if (not splits or data.split in splits) and same_config:
                raise CCAError(f"validate.data: {data.describe()} is also the finetune dataset (same split"
                               f"{' or split unknown' if not splits else ''}): held-out text must not overlap it")
            notes.append(f"finetune uses {data.dataset} split(s) {', '.join(splits)}; held out: {data.split}")
        return notes or ["the finetune section does not name the held-out dataset"]
    return notes
