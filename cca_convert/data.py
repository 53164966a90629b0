"""Text data for every stage: one recipe schema and one loader for the finetune data and the held-out text.

A source is local files (txt, jsonl/json, parquet, globs allowed) or a ``datasets`` id; both go through
``datasets.load_dataset`` (the ``text``/``json``/``parquet`` builders for files), so a ``.jsonl`` file and a
``.txt`` file holding the same documents give the same documents, and the same ``text_field`` rule and the
same errors apply to both stages. Each error names its recipe section (``finetune.data`` or ``validate.data``).
"""

from __future__ import annotations

import glob
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, model_validator

from .errors import CCAError, first_line
from .schema import Section

TEXT_EXT = {".txt", ".text", ".md"}
JSON_EXT = {".json", ".jsonl", ".ndjson"}
PARQUET_EXT = {".parquet"}


class TextSource(Section):
    """A ``datasets`` spec: a Hub dataset (or a builder name) and/or local files."""

    dataset: str | None = Field(None, description="Hub dataset id, local dataset folder, or builder (json, parquet, text)")
    config: str | None = Field(None, validation_alias=AliasChoices("config", "dataset_config"),
                               description="dataset configuration name (Hub datasets)")
    revision: str | None = None
    files: list[str] | None = Field(None, description="local text/jsonl/json/parquet files or globs (relative to the cwd)")
    format: Literal["auto", "text", "json", "parquet"] = Field("auto", description="local files: auto = by extension")
    split: str = "train"
    text_field: str = Field("text", validation_alias=AliasChoices("text_field", "text_column"),
                            description="the column holding the text (json/parquet/Hub datasets)")
    sample_by: Literal["document", "paragraph", "line"] = Field(
        "document", description="plain-text files: one document per file, per blank-line paragraph, or per line")
    split_on: str | None = Field(None, description="also cut every text into documents at this string, e.g. '\\n\\n\\n'")
    streaming: bool = Field(False, description="stream the dataset instead of reading it all up front")

    @model_validator(mode="after")
    def _files_not_empty(self):
        if self.files is not None and not self.files:
            raise ValueError("files: give at least one file (or leave it out and set dataset)")
        return self

    @property
    def given(self) -> bool:
        return bool(self.files) or self.dataset is not None

    def describe(self) -> str:
        if self.files:
            return ", ".join(self.files)
        if self.dataset is None:
            return "(none)"
        return self.dataset + (f" ({self.config})" if self.config else "") + f" [{self.split}]"


def resolve_files(spec: TextSource, section: str) -> list[str]:
    """Expand ``files`` (globs allowed); every entry must match an existing file."""
    out = []
    for pattern in spec.files or []:
        expanded = str(Path(pattern).expanduser())
        matches = sorted(glob.glob(expanded, recursive=True)) if glob.has_magic(expanded) else [expanded]
        matches = [m for m in matches if Path(m).is_file()]
        if not matches:
            what = "no file matches" if glob.has_magic(pattern) else "file not found:"
            raise CCAError(f"{section}.files: {what} {pattern} (relative paths are read from {Path.cwd()})")
        out.extend(str(Path(m).resolve()) for m in matches)
    return out


def file_format(spec: TextSource, files: list[str], section: str) -> str:
    if spec.format != "auto":
        return spec.format
    kinds = set()
    for f in files:
        ext = Path(f).suffix.lower()
        kind = ("text" if ext in TEXT_EXT else "json" if ext in JSON_EXT else "parquet" if ext in PARQUET_EXT
                else None)
        if kind is None:
            raise CCAError(f"{section}.files: cannot tell the format of {f} from its extension; "
                           f"set {section}.format (text, json or parquet)")
        kinds.add(kind)
    if len(kinds) > 1:
        raise CCAError(f"{section}.files mixes formats ({', '.join(sorted(kinds))}); use one format per run")
    return kinds.pop()


UTF8_PROBE = 64 * 2**20  # bytes of text/json checked up front, over all files (at least 1 MiB of each)


def check_utf8(path: Path, section: str, probe: int = UTF8_PROBE) -> None:
    """A text or JSON file must be UTF-8: a binary or Latin-1 file is named here, not deep inside ``datasets``. Only
    its first ``probe`` bytes are read (a corpus of many large shards is not read twice before training)."""
    import codecs

    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while offset < probe:
            chunk = f.read(2**20)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                at = offset + max(0, exc.start)
                raise CCAError(f"{section}.files: {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
                               f"offset {at}): give text, jsonl or parquet files (convert it with iconv, or check "
                               "the path)") from None
            if not chunk:
                return
            offset += len(chunk)


def load_documents(spec: TextSource, section: str):
    """The ``datasets`` Dataset (IterableDataset when streaming) of documents, its text column checked."""
    import datasets

    if not spec.given:
        raise CCAError(f"{section}: give data, e.g. {section}.files: [text.txt] or {section}.dataset: ORG/NAME")
    kwargs: dict = dict(split=spec.split, streaming=spec.streaming)
    if spec.files:
        files = resolve_files(spec, section)
        builder = spec.dataset or file_format(spec, files, section)
        if builder in ("text", "json"):
            for f in files:
                check_utf8(Path(f), section, max(2**20, UTF8_PROBE // len(files)))
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
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its parse errors log a traceback; ours is one line
    try:
        ds = datasets.load_dataset(*args, **kwargs)
    except (FileNotFoundError, ValueError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise CCAError(f"{section}: cannot load {spec.describe()}: {first_line(exc)}") from None
    except Exception as exc:  # network, parse errors of malformed json/parquet, ...
        raise CCAError(f"{section}: cannot load {spec.describe()}: {type(exc).__name__}: {first_line(exc)}") from None
    finally:
        datasets.enable_progress_bars()
        datasets.logging.set_verbosity(level)
    _check_text_field(ds, spec, section)
    return ds


def _check_text_field(ds, spec: TextSource, section: str) -> None:
    columns = ds.column_names
    if columns is None:  # streaming without known features: look at the first row
        first = next(iter(ds), None)
        if first is None:
            raise CCAError(f"{section}: {spec.describe()} is empty (no documents)")
        columns = list(first)
    elif not spec.streaming and len(ds) == 0:
        raise CCAError(f"{section}: {spec.describe()} is empty (no documents)")
    if spec.text_field not in columns:
        raise CCAError(f"{section}.text_field: {spec.describe()} has no column {spec.text_field!r} "
                       f"(columns: {', '.join(columns)})")


def documents(texts: list, spec: TextSource, section: str) -> list[str]:
    """The non-empty documents of a batch of ``text_field`` values, cut at ``split_on``."""
    for t in texts:
        if t is not None and not isinstance(t, str):
            raise CCAError(f"{section}.text_field: column {spec.text_field!r} holds {type(t).__name__} values, not text")
    if spec.split_on:
        texts = [part for t in texts if t for part in t.split(spec.split_on)]
    return [t for t in texts if t and t.strip()]


def iter_documents(ds, spec: TextSource, section: str, batch_size: int = 256) -> Iterator[str]:
    for batch in ds.iter(batch_size=batch_size):
        yield from documents(batch[spec.text_field], spec, section)
