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
import itertools
from collections.abc import Iterator

import numpy as np
import torch

from .. import data
from ..errors import CCAError
from .config import DataSection, FinetuneSection

IGNORE_INDEX = -100
SECTION = "finetune.data"


def describe(spec: DataSection) -> str:
    return spec.describe()


def load_documents(spec: DataSection):
    """The ``datasets`` Dataset (or IterableDataset when streaming) of training documents. Raises CCAError."""
    return data.load_documents(spec, SECTION)


class Tokenize:
    """Documents -> token ids: ``<bos> text <eos>`` (no BOS for tokenizers without one, e.g. Qwen2)."""

    def __init__(self, tokenizer, spec: DataSection, eos_id: int):
        self.tok, self.spec, self.eos = tokenizer, spec, eos_id
        bos = getattr(tokenizer, "bos_token_id", None)
        self.bos = bos if bos is not None and bos != eos_id else None

    def __call__(self, texts: list) -> list[list[int]]:
        texts = data.documents(texts, self.spec, SECTION)
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


def check_first_sequence(ft: FinetuneSection, tokenizer, eos_id: int) -> None:
    """The data yield at least one training sequence: read and tokenize documents only until one is complete, and
    refuse with the trainer's own errors (empty, not text, too short) before any weight is loaded."""
    ds = load_documents(ft.data)
    tokenize = Tokenize(tokenizer, ft.data, eos_id)
    tokens, docs = 0, 0
    for batch in ds.iter(batch_size=64):
        for ids in tokenize(batch[ft.data.text_field]):
            docs += 1
            if (not ft.packing and len(ids) >= 2) or (ft.packing and tokens + len(ids) >= ft.seq_len):
                return
            tokens += len(ids)
    if docs == 0:
        raise CCAError(f"{SECTION}: {describe(ft.data)} is empty (no text in column {ft.data.text_field!r})")
    raise CCAError(f"{SECTION}: {describe(ft.data)} has {tokens} tokens, fewer than one finetune.seq_len="
                   f"{ft.seq_len} block; add data or lower finetune.seq_len" if ft.packing else
                   f"{SECTION}: {describe(ft.data)} has no document of 2 tokens or more")


def build_sequences(ft: FinetuneSection, tokenizer, eos_id: int, pad_id: int, rank=0, world=1, log=print):
    ds = load_documents(ft.data)
    tokenize = Tokenize(tokenizer, ft.data, eos_id)
    if ft.data.streaming:
        src = StreamingSequences(ds, tokenize, ft, pad_id, rank, world, log)
    else:
        src = InMemorySequences(ds, tokenize, ft, pad_id, rank, world, log)
    return src
