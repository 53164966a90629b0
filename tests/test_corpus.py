"""The pretraining corpora of the example bases: the commentaries' decoder, the code corpus's builder, the shipped
files, --extra-train."""

import hashlib
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

import prepare_code  # noqa: E402
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


def _module(root: Path, rel: str, text: str) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(text.encode())


def test_the_code_corpus_is_one_document_per_module_and_the_splits_share_none(tmp_path, capsys):
    root = tmp_path / "python3.11"
    held = lambda rel: hashlib.sha1(rel.encode()).digest()[-1] < prepare_code.HELDOUT_BELOW  # noqa: E731
    kept = [f"pkg/mod{i}.py" for i in range(200)] + ["json/__init__.py", "os.py"]
    assert 3 <= sum(map(held, kept)) <= 30  # both splits get modules (about 5% held out)
    for rel in kept:
        _module(root, rel, f"def f():\n    return {rel!r}\n")
    # blank-line runs, CRLF and a leading blank line: one blank line at most inside a document
    _module(root, "gaps.py", "\r\nx = 1\r\n\r\n\r\n\r\ny = 2\n  \n\t\n\nz = 3\n \nw = 4\n")
    for rel in ["test/test_os.py", "idlelib/run.py", "site-packages/six.py", "pkg/test_x.py", "lib2to3/main.py",
                "config-3.11-x86_64-linux-gnu/python-config.py", "pkg/__pycache__/mod0.py", "pkg/notes.txt"]:
        _module(root, rel, "left = 'out'\n")
    _module(root, "empty.py", "\n\n")
    assert prepare_code.main([str(root), str(tmp_path / "out")]) == 0
    splits = {name: read_books(tmp_path / "out" / f"{name}.txt.xz") for name in ("train", "heldout")}
    names = {name: [d.split("\n", 1)[0].removeprefix("# ") for d in docs] for name, docs in splits.items()}
    assert sorted(names["train"] + names["heldout"]) == sorted(kept + ["gaps.py"])  # each kept module once
    assert sorted(names["heldout"]) == sorted(filter(held, kept + ["gaps.py"]))  # by the path's hash alone
    gaps = next(d for docs in splits.values() for d in docs if d.startswith("# gaps.py"))
    assert gaps == "# gaps.py\nx = 1\n\ny = 2\n\nz = 3\n \nw = 4\n"
    out = capsys.readouterr().out
    assert f"heldout: {len(names['heldout'])} modules" in out and f"train: {len(names['train'])} modules" in out


# the Debian package the shipped code corpus was built from (examples/data/README.md)
_STDLIB = Path("/usr/lib/python3.11")
_STDLIB_VERSION = "3.11.2-6+deb12u6"


def _debian_stdlib_version() -> str | None:
    try:
        proc = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "libpython3.11-stdlib"], capture_output=True,
                              text=True, timeout=30)
    except OSError:
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


@pytest.mark.skipif(not _STDLIB.is_dir() or _debian_stdlib_version() != _STDLIB_VERSION,
                    reason=f"needs Debian's libpython3.11-stdlib {_STDLIB_VERSION} in {_STDLIB}")
def test_the_shipped_code_corpus_is_what_its_builder_makes_of_the_debian_package(tmp_path):
    proc = subprocess.run([sys.executable, str(DATA / "prepare_code.py"), str(_STDLIB), str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train: 520 modules" in proc.stdout and "heldout: 37 modules" in proc.stdout
    for name in ("train", "heldout"):
        built = lzma.decompress((tmp_path / f"{name}.txt.xz").read_bytes())
        assert built == lzma.decompress((DATA / "code" / f"{name}.txt.xz").read_bytes()), name


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
