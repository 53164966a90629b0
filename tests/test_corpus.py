"""The pretraining corpora of the example bases: the commentaries' decoder, the shipped file, --extra-train."""

import json
import lzma
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "data"
sys.path.insert(0, str(DATA))
sys.path.insert(0, str(REPO / "examples"))

import prepare_commentaries as pc  # noqa: E402
from prepare_kjv import FINETUNE, HELDOUT  # noqa: E402
from train_tiny_llama import read_books  # noqa: E402


def _zcom(folder: Path, blocks: list[str], suffix: str = "b") -> None:
    """A zCom module's testament as SWORD writes it: (offset, size, unpacked size) uint32 triples + zlib blocks."""
    folder.mkdir(parents=True)
    index, data = b"", b""
    for text in blocks:
        packed = zlib.compress(text.encode("utf-8"))
        index += struct.pack("<III", len(data), len(packed), len(text.encode("utf-8")))
        data += packed
    (folder / f"ot.{suffix}zs").write_bytes(index + struct.pack("<III", len(data), 0, 0))  # an empty slot too
    (folder / f"ot.{suffix}zz").write_bytes(data)


def test_zcom_blocks_are_read_in_order_and_checked(tmp_path):
    _zcom(tmp_path / "m", ["<div>first</div>", "second &amp; last"])
    assert pc.blocks(tmp_path / "m") == "<div>first</div>second &amp; last"
    index = tmp_path / "m" / "ot.bzs"
    raw = bytearray(index.read_bytes())
    raw[8:12] = struct.pack("<I", 999)  # the first block's unpacked size, wrong
    index.write_bytes(bytes(raw))
    with pytest.raises(SystemExit, match="block 0 unpacks to"):
        pc.blocks(tmp_path / "m")
    with pytest.raises(SystemExit, match="no zCom blocks"):
        pc.blocks(tmp_path / "missing")


def test_osis_becomes_lines_and_documents():
    osis = ('<title type="x-s">Psalm 1</title> <div sID="g1" type="x-p"/> Blessed <hi type="italic">is</hi> the man'
            ' <div eID="g1" type="x-p"/><div sID="g2" type="x-p"/>A &amp; B<div eID="g2" type="x-p"/>')
    assert pc.plain(osis) == "Psalm 1\nBlessed is the man\nA & B\n"
    psalms = ('<div sID="p" type="x-p"/>Preface<div eID="p" type="x-p"/>'
              '<chapter osisID="Ps.1" sID="Ps.1"/>One<chapter eID="Ps.1"/><chapter osisID="Ps.2" sID="Ps.2"/>Two')
    assert pc.documents("tdavid", psalms) == ["Preface\n", "One\n", "Two\n"]
    books = ''.join(f'<div canonical="true" osisID="{b}" sID="x{i}" type="book"/>Notes on {b}.'
                    for i, b in enumerate(["Gen", "Hos", "Col", "Rom"]))
    # Hosea (finetune) and Colossians (held out) are dropped
    assert pc.documents("mhcc", books) == ["Notes on Gen.\n", "Notes on Rom.\n"]


def test_the_shipped_commentaries_leave_out_the_held_out_and_finetune_books():
    docs = read_books(DATA / "commentaries.txt.xz")
    assert len(docs) == 189 and all(d.strip() and "\n\n" not in d.strip("\n") for d in docs)
    titles = {d.split("\n", 1)[0] for d in docs}
    assert {"Genesis", "Romans", "Psalm 3 OVERVIEW"} <= titles
    assert not titles & (HELDOUT | FINETUNE)


def test_extra_training_documents_reach_the_tokenizer_and_the_summary(tmp_path):
    extra = tmp_path / "extra.txt.xz"
    extra.write_bytes(lzma.compress("Zyzzyva quux 12345 zyzzyva.\n\n\nQuux again 67890.\n".encode()))
    out = tmp_path / "model"
    cmd = [sys.executable, str(REPO / "examples" / "train_tiny_llama.py"), "--output", str(out), "--extra-train",
           str(extra), "--steps", "1", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
           "--intermediate", "64", "--seq-len", "64", "--short-len", "32", "--batch-tokens", "64", "--vocab-size",
           "512", "--max-position-embeddings", "64"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(40 books)" in proc.stdout  # the 38 KJV books and the 2 documents of the extra file
    assert json.loads((out / "training_summary.json").read_text())["extra_train"] == ["extra.txt.xz"]
    fresh = tmp_path / "never"
    missing = subprocess.run(cmd[:2] + ["--output", str(fresh), "--extra-train", str(tmp_path / "nope.txt")],
                             capture_output=True, text=True, cwd=REPO, timeout=120)
    assert missing.returncode == 1 and "nope.txt: no such file" in missing.stderr
    assert not fresh.exists()  # nothing written before the data is read


@pytest.mark.parametrize("args, error", [
    (["--commentaries"], "--commentaries is for the DCA row (--dca)"),
    (["--dca", "--passkey-trials", "8"], "--passkey-trials takes a count >= 1, with --passkey-base"),
    (["--dca", "--passkey-base", "--passkey-trials", "0"], "--passkey-trials takes a count >= 1"),
])
def test_fidelity_base_variants_are_refused_where_they_do_nothing(args, error):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fidelity.py"), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and error in proc.stderr
