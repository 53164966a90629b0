#!/usr/bin/env python3
r"""Rebuild train.txt / finetune.txt / heldout.txt from Debian's KJV packages.

The King James Version text (1611) is in the public domain.  It is taken from
Debian's ``bible-kjv-text`` 4.38 package (compressed text) and decoded with the
``bible`` program from the ``bible-kjv`` 4.38 package:

    apt-get update
    apt-get download bible-kjv-text bible-kjv
    dpkg -x bible-kjv-text_4.38_all.deb pkg && dpkg -x bible-kjv_4.38_amd64.deb pkg
    pkg/usr/bin/bible -f -p "$PWD/pkg/usr/lib" Gen1:1-Rev22:21 > kjv_raw.txt
    python examples/data/prepare_kjv.py kjv_raw.txt examples/data

``kjv_raw.txt`` has one verse per line, e.g. ``Ge1:1 In the beginning ...``
(31,102 verses, 66 books).  The output format is one book after another; each
book starts with its name on a line of its own, each chapter with a
"<Book> <n>" header line, then one verse per line (verse numbers dropped), and
a blank line closes every chapter; books are separated by one more blank line
(i.e. by "\n\n\n").

Split (whole books, canonical order, deterministic):
  heldout.txt   Colossians .. Revelation (the last 16 books, ~5% of the text)
  finetune.txt  Hosea .. Malachi (the 12 minor prophets, ~4%)
  train.txt     all the other 38 books (~91%)
The three files are pairwise disjoint.
"""
import re
import sys
from pathlib import Path

BOOKS = [
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua",
    "Judges", "Ruth", "1 Samuel", "2 Samuel", "1 Kings", "2 Kings",
    "1 Chronicles", "2 Chronicles", "Ezra", "Nehemiah", "Esther", "Job",
    "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon", "Isaiah",
    "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos",
    "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai",
    "Zechariah", "Malachi", "Matthew", "Mark", "Luke", "John", "Acts",
    "Romans", "1 Corinthians", "2 Corinthians", "Galatians", "Ephesians",
    "Philippians", "Colossians", "1 Thessalonians", "2 Thessalonians",
    "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews", "James",
    "1 Peter", "2 Peter", "1 John", "2 John", "3 John", "Jude", "Revelation",
]
FINETUNE = set(BOOKS[BOOKS.index("Hosea"):BOOKS.index("Malachi") + 1])
HELDOUT = set(BOOKS[BOOKS.index("Colossians"):])

VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


def parse(raw_path):
    """Return [(book_name, [(chapter, [verse_text, ...]), ...]), ...]."""
    books, abbrevs = [], []
    for line in open(raw_path, encoding="ascii"):
        m = VERSE.match(line.rstrip("\n"))
        if m is None:
            raise ValueError(f"unexpected line: {line!r}")
        abbr, chap, text = m.group(1), int(m.group(2)), " ".join(m.group(4).split())
        if not abbrevs or abbrevs[-1] != abbr:
            abbrevs.append(abbr)
            books.append((BOOKS[len(books)], []))
        chapters = books[-1][1]
        if not chapters or chapters[-1][0] != chap:
            chapters.append((chap, []))
        chapters[-1][1].append(text)
    assert len(books) == 66, len(books)
    return books


def render(name, chapters):
    out = [name, ""]
    for chap, verses in chapters:
        out.append(f"{name} {chap}")
        out.extend(verses)
        out.append("")
    return "\n".join(out) + "\n"


def main():
    raw, outdir = sys.argv[1], Path(sys.argv[2])
    splits = {"train": [], "finetune": [], "heldout": []}
    for name, chapters in parse(raw):
        split = "heldout" if name in HELDOUT else "finetune" if name in FINETUNE else "train"
        splits[split].append(render(name, chapters))
    for split, docs in splits.items():
        # books are separated by one extra blank line
        text = "\n".join(docs)
        (outdir / f"{split}.txt").write_text(text, encoding="ascii")
        print(f"{split}.txt: {len(docs)} books, {len(text):,} chars")


if __name__ == "__main__":
    main()
