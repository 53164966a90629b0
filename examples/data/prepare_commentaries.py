#!/usr/bin/env python3
r"""Build commentaries.txt.xz: more public-domain English prose for pretraining the DCA bar's base.

The KJV training split (~0.95M tokens) is memorised before a 26M-parameter base trained on it alone shows the
long-context breakdown DCA exists to fix (benchmarks/results/fidelity-dca-passkey-h200.md). This adds two
19th-/18th-century commentaries, both public domain, from Debian's SWORD module packages:

* ``sword-comm-tdavid`` 2.1-1: C. H. Spurgeon, *The Treasury of David* (1869-1885), on the Psalms.
* ``sword-comm-mhcc`` 2.0-1: Matthew Henry's *Concise Commentary on the Whole Bible* (1706-1721), only the
  books of ``train.txt``: its notes on the held-out (Colossians .. Revelation) and finetune (Hosea .. Malachi)
  books are dropped, so neither split leaks into pretraining through it.

    apt-get download sword-comm-tdavid sword-comm-mhcc
    dpkg -x sword-comm-tdavid_2.1-1_all.deb pkg && dpkg -x sword-comm-mhcc_2.0-1_all.deb pkg
    python examples/data/prepare_commentaries.py pkg examples/data/commentaries.txt.xz

A SWORD zCom module is a list of zlib blocks (``*.bzs``/``*.czs``: offset, size, unpacked size as little-endian
uint32) inside ``*.bzz``/``*.czz``; each block is OSIS XML. The markup is dropped, paragraphs become lines, and
the text is cut into documents (one per psalm, one per book of the Bible) separated by "\n\n\n", the format
``train_tiny_llama.py --extra-train`` reads. Quotations of other books (the held-out ones included) stay inside
the commentary prose where the authors put them.
"""

from __future__ import annotations

import html
import lzma
import re
import struct
import sys
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from prepare_kjv import BOOKS, FINETUNE, HELDOUT  # noqa: E402

# OSIS book ids in canonical order, aligned with prepare_kjv.BOOKS
OSIS = ("Gen Exod Lev Num Deut Josh Judg Ruth 1Sam 2Sam 1Kgs 2Kgs 1Chr 2Chr Ezra Neh Esth Job Ps Prov Eccl Song "
        "Isa Jer Lam Ezek Dan Hos Joel Amos Obad Jonah Mic Nah Hab Zeph Hag Zech Mal Matt Mark Luke John Acts Rom "
        "1Cor 2Cor Gal Eph Phil Col 1Thess 2Thess 1Tim 2Tim Titus Phlm Heb Jas 1Pet 2Pet 1John 2John 3John Jude "
        "Rev").split()
TRAIN_BOOKS = {osis for osis, name in zip(OSIS, BOOKS) if name not in HELDOUT | FINETUNE}
MODULES = {"tdavid": "chapter", "mhcc": "book"}  # module -> one document per ...


def blocks(module_dir: Path) -> str:
    """The module's OSIS text: every zlib block of its testaments, in order."""
    out = []
    for index in sorted(module_dir.glob("*.[bc]zs")):
        data = index.with_suffix(index.suffix[:-1] + "z").read_bytes()
        raw = index.read_bytes()
        for i in range(0, len(raw), 12):
            offset, size, unpacked = struct.unpack("<III", raw[i:i + 12])
            if size:
                text = zlib.decompress(data[offset:offset + size])
                if len(text) != unpacked:
                    raise SystemExit(f"{index}: block {i // 12} unpacks to {len(text)} bytes, not {unpacked}")
                out.append(text.decode("utf-8"))
    if not out:
        raise SystemExit(f"no zCom blocks under {module_dir}")
    return "".join(out)


def plain(osis: str) -> str:
    """OSIS -> text: a paragraph, title, list item or poem line per line; every other tag dropped."""
    osis = re.sub(r'<(?:div|l|item|title|row)\b[^>]*eID="[^"]*"[^>]*/>|</(?:title|item|row)>', "\n", osis)
    text = html.unescape(re.sub(r"<[^>]*>", " ", osis))
    lines = (" ".join(line.split()) for line in text.split("\n"))
    return "\n".join(line for line in lines if line) + "\n"


def documents(module: str, osis: str) -> list[str]:
    if MODULES[module] == "chapter":  # Treasury of David: one document per psalm (the preface is the first)
        texts = (plain(p) for p in re.split(r'<chapter\b[^>]*sID="Ps\.\d+"[^>]*/>', osis))
        return [t for t in texts if t.strip()]
    docs = []
    # Matthew Henry: <div osisID="Gen" sID=... type="book"/> opens a book; notes on held-out/finetune books dropped
    for match in re.finditer(r'<div\b[^>]*osisID="(\w+)"[^>]*sID="[^"]*"[^>]*type="book"[^>]*/>(.*?)'
                             r'(?=<div\b[^>]*osisID="\w+"[^>]*sID="[^"]*"[^>]*type="book"|\Z)', osis, re.S):
        if match.group(1) in TRAIN_BOOKS:
            docs.append(plain(match.group(2)))
    return docs


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit("usage: prepare_commentaries.py <folder with usr/share/sword> <out.txt.xz>")
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    docs = []
    for module in MODULES:
        found = documents(module, blocks(root / "usr/share/sword/modules/comments/zcom" / module))
        print(f"{module}: {len(found)} documents, {sum(map(len, found)):,} chars")
        docs += found
    # plain() leaves no blank line inside a document, so "\n\n\n" separates documents and nothing else
    text = "\n\n".join(docs)
    out.write_bytes(lzma.compress(text.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))
    print(f"{out}: {len(docs)} documents, {len(text):,} chars, {out.stat().st_size:,} bytes compressed")


if __name__ == "__main__":
    main()
