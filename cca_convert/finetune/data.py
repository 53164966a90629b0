"""Finetune data: a ``datasets`` source, tokenized, packed into ``seq_len`` blocks, in a resumable order.

The order of training sequences is a pure function of ``(seed, position)``: micro-batch ``m`` of rank
``r`` (of ``W``) holds the sequences at stream positions ``(m * W + r) * B ... + B - 1``. A resumed
run therefore sees exactly the sequences the interrupted one would have seen next.

* in memory (default): every document is tokenized up front; the sequences of epoch ``e`` come in a
  random permutation drawn from ``seed`` and ``e``, so seeking is O(1).
* ``streaming``: documents are read lazily (``datasets`` streaming, shuffled with a buffer), packed on
  the fly; resuming re-reads and skips the consumed sequences (tokenizing them again).
"""

from __future__ import annotations

import abc
import glob
import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..errors import CCAError
from .config import DataSection, FinetuneSection

TEXT_EXT = {".txt", ".text", ".md"}
JSON_EXT = {".json", ".jsonl", ".ndjson"}
PARQUET_EXT = {".parquet"}
IGNORE_INDEX = -100


def resolve_files(spec: DataSection) -> list[str]:
    """Expand ``finetune.data.files`` (globs allowed); every entry must match an existing file."""
    out = []
    for pattern in spec.files or []:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if Path(m).is_file()]
        if not matches:
            what = "no file matches" if glob.has_magic(pattern) else "file not found:"
            raise CCAError(f"finetune.data.files: {what} {pattern} (relative paths are read from {Path.cwd()})")
        out.extend(str(Path(m).resolve()) for m in matches)
    return out


def file_format(spec: DataSection, files: list[str]) -> str:
    if spec.format != "auto":
        return spec.format
    kinds = set()
    for f in files:
        ext = Path(f).suffix.lower()
        kind = ("text" if ext in TEXT_EXT else "json" if ext in JSON_EXT else "parquet" if ext in PARQUET_EXT
                else None)
        if kind is None:
            raise CCAError(f"finetune.data.files: cannot tell the format of {f} from its extension; "
                           "set finetune.data.format (text, json or parquet)")
        kinds.add(kind)
    if len(kinds) > 1:
        raise CCAError(f"finetune.data.files mixes formats ({', '.join(sorted(kinds))}); use one format per run")
    return kinds.pop()


def describe(spec: DataSection) -> str:
    if spec.files:
        return ", ".join(spec.files)
    return spec.dataset + (f" ({spec.config})" if spec.config else "") + f" [{spec.split}]"


def load_documents(spec: DataSection):
    """The ``datasets`` Dataset (or IterableDataset when streaming) of documents. Raises CCAError."""
    import datasets

    kwargs: dict = dict(split=spec.split, streaming=spec.streaming)
    if spec.files:
        files = resolve_files(spec)
        builder = spec.dataset or file_format(spec, files)
        kwargs["data_files"] = {spec.split.split("[")[0]: files}
        if builder == "text":
            kwargs["sample_by"] = spec.sample_by
            kwargs["keep_linebreaks"] = True
        args = (builder,)
    else:
        args = (spec.dataset,) + ((spec.config,) if spec.config else ())
        if spec.revision:
            kwargs["revision"] = spec.revision
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(*args, **kwargs)
    except (FileNotFoundError, ValueError, datasets.exceptions.DatasetNotFoundError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CCAError(f"finetune.data: cannot load {describe(spec)}: {first}") from None
    except Exception as exc:  # network, parse errors of malformed json/parquet, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CCAError(f"finetune.data: cannot load {describe(spec)}: {type(exc).__name__}: {first}") from None
    finally:
        datasets.enable_progress_bars()
    _check_text_field(ds, spec)
    return ds


def _check_text_field(ds, spec: DataSection) -> None:
    columns = ds.column_names
    if columns is None:  # streaming without known features: look at the first row
        first = next(iter(ds), None)
        if first is None:
            raise CCAError(f"finetune.data: {describe(spec)} is empty (no documents)")
        columns = list(first)
    elif not spec.streaming and len(ds) == 0:
        raise CCAError(f"finetune.data: {describe(spec)} is empty (no documents)")
    if spec.text_field not in columns:
        raise CCAError(f"finetune.data.text_field: {describe(spec)} has no column {spec.text_field!r} "
                       f"(columns: {', '.join(columns)})")


class Tokenize:
    """Documents -> token ids: ``<bos> text <eos>`` (no BOS for tokenizers without one, e.g. Qwen2)."""

    def __init__(self, tokenizer, text_field: str, eos_id: int, split_on: str | None = None):
        self.tok = tokenizer
        self.field = text_field
        self.eos = eos_id
        bos = getattr(tokenizer, "bos_token_id", None)
        self.bos = bos if bos is not None and bos != eos_id else None
        self.split_on = split_on

    def __call__(self, texts: list) -> list[list[int]]:
        for t in texts:
            if t is not None and not isinstance(t, str):
                raise CCAError(f"finetune.data.text_field: column {self.field!r} holds {type(t).__name__} values, "
                               "not text")
        if self.split_on:
            texts = [part for t in texts if t for part in t.split(self.split_on)]
        texts = [t for t in texts if t and t.strip()]
        if not texts:
            return []
        ids = self.tok(texts, add_special_tokens=True, verbose=False)["input_ids"]
        if self.bos is not None:
            ids = [x if x and x[0] == self.bos else [self.bos] + x for x in ids]
        return [x + [self.eos] if not x or x[-1] != self.eos else x for x in ids]


class SequenceSource(abc.ABC):
    """Common part: turning a stream of sequences into per-rank micro-batches."""

    def __init__(self, ft: FinetuneSection, pad_id: int, rank: int = 0, world: int = 1):
        self.seq_len, self.packing, self.bsz = ft.seq_len, ft.packing, ft.micro_batch_size
        self.seed, self.pad_id, self.rank, self.world = ft.seed, pad_id, rank, world

    def collate(self, seqs: list[np.ndarray]) -> dict[str, torch.Tensor]:
        if self.packing:  # every block is exactly seq_len tokens: no padding, no mask
            ids = torch.from_numpy(np.stack(seqs).astype(np.int64))
            return {"input_ids": ids, "labels": ids.clone()}
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.from_numpy(s.astype(np.int64))
            mask[i, : len(s)] = 1
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    @abc.abstractmethod
    def batches(self, start_micro: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Micro-batches in training order, from micro-batch ``start_micro`` on (for --resume)."""


class InMemorySequences(SequenceSource):
    def __init__(self, ds, tokenize: Tokenize, ft: FinetuneSection, pad_id: int, rank=0, world=1, log=print):
        super().__init__(ft, pad_id, rank, world)
        self.shuffle = ft.data.shuffle
        docs: list[np.ndarray] = []
        for batch in ds.iter(batch_size=256):
            docs.extend(np.asarray(x, dtype=np.int32) for x in tokenize(batch[ft.data.text_field]))
        n_tokens = sum(len(d) for d in docs)
        where = describe(ft.data)
        if n_tokens == 0:
            raise CCAError(f"finetune.data: {where} is empty (no text in column {ft.data.text_field!r})")
        if self.packing:
            stream = np.concatenate(docs)
            n = len(stream) // self.seq_len
            if n == 0:
                raise CCAError(f"finetune.data: {where} has {n_tokens} tokens, fewer than one "
                               f"finetune.seq_len={self.seq_len} block; add data or lower finetune.seq_len")
            self.seqs = stream[: n * self.seq_len].reshape(n, self.seq_len)
        else:
            self.seqs = [d[: self.seq_len] for d in docs if len(d) >= 2]
        self.n_tokens = n_tokens
        log(f"  data: {len(docs)} documents, {n_tokens:,} tokens -> {len(self.seqs)} sequences of "
            f"{'exactly' if self.packing else 'at most'} {self.seq_len} tokens")

    def order(self, epoch: int) -> np.ndarray:
        n = len(self.seqs)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def batches(self, start_micro: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        n = len(self.seqs)
        cache: dict[int, np.ndarray] = {}
        for m in itertools.count(start_micro):
            first = (m * self.world + self.rank) * self.bsz
            seqs = []
            for pos in range(first, first + self.bsz):
                epoch = pos // n
                if epoch not in cache:
                    cache.clear()
                    cache[epoch] = self.order(epoch)
                seqs.append(self.seqs[cache[epoch][pos % n]])
            yield self.collate(seqs)


class StreamingSequences(SequenceSource):
    def __init__(self, ds, tokenize: Tokenize, ft: FinetuneSection, pad_id: int, rank=0, world=1, log=print):
        super().__init__(ft, pad_id, rank, world)
        self.ds, self.tokenize, self.spec = ds, tokenize, ft.data
        self.n_tokens = None
        log(f"  data: streaming {describe(ft.data)}")

    def _epoch_sequences(self, epoch: int) -> Iterator[np.ndarray]:
        ds = self.ds
        if self.spec.shuffle:
            ds = ds.shuffle(seed=self.seed, buffer_size=self.spec.shuffle_buffer)
            ds.set_epoch(epoch)
        buf = np.zeros(0, dtype=np.int32)
        for batch in ds.iter(batch_size=64):
            for ids in self.tokenize(batch[self.spec.text_field]):
                ids = np.asarray(ids, dtype=np.int32)
                if not self.packing:
                    if len(ids) >= 2:
                        yield ids[: self.seq_len]
                    continue
                buf = np.concatenate([buf, ids])
                while len(buf) >= self.seq_len:
                    yield buf[: self.seq_len]
                    buf = buf[self.seq_len :]

    def _sequences(self) -> Iterator[np.ndarray]:
        for epoch in itertools.count():
            produced = False
            for seq in self._epoch_sequences(epoch):
                produced = True
                yield seq
            if not produced:
                raise CCAError(f"finetune.data: {describe(self.spec)} yields no sequence of "
                               f"finetune.seq_len={self.seq_len} tokens (empty, or too little text)")

    def batches(self, start_micro: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        stream = self._sequences()
        per_micro = self.world * self.bsz
        stream = itertools.islice(stream, start_micro * per_micro, None)  # skip what was consumed
        while True:
            chunk = list(itertools.islice(stream, per_micro))
            yield self.collate(chunk[self.rank * self.bsz : (self.rank + 1) * self.bsz])


def build_sequences(ft: FinetuneSection, tokenizer, eos_id: int, pad_id: int, rank=0, world=1, log=print):
    ds = load_documents(ft.data)
    tokenize = Tokenize(tokenizer, ft.data.text_field, eos_id, ft.data.split_on)
    if ft.data.streaming:
        src = StreamingSequences(ds, tokenize, ft, pad_id, rank, world, log)
    else:
        src = InMemorySequences(ds, tokenize, ft, pad_id, rank, world, log)
    return src
