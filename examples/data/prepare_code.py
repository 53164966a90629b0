#!/usr/bin/env python3
r"""Build code/train.txt.xz and code/heldout.txt.xz: Python source, a corpus of another kind than the KJV prose, for
the second base of the DCA defaults sweep (``benchmarks/dca_defaults.py``).

The source is the Python 3.11 standard library as Debian ships it (``libpython3.11-stdlib`` and
``libpython3.11-minimal``, /usr/lib/python3.11; PSF License, see ``LICENSE.md``). Every pure-Python module outside
the test suites, IDLE, the demo scripts and the installed third-party packages is one document; a module goes to
the held-out split when the SHA-1 of its relative path ends in a byte below 13 (about 5%, whole modules: the two splits
share no file). Runs of blank lines inside a module are cut to one blank line, so that two blank lines separate
documents only (the format ``train_tiny_llama.py`` reads).

    apt-get download libpython3.11-stdlib libpython3.11-minimal        # or an installed /usr/lib/python3.11
    dpkg -x libpython3.11-stdlib_*.deb pkg && dpkg -x libpython3.11-minimal_*.deb pkg
    python examples/data/prepare_code.py pkg/usr/lib/python3.11 examples/data/code
"""

from __future__ import annotations

import hashlib
import lzma
import re
import sys
from pathlib import Path

SKIP = ("test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo", "__pycache__",
        "ensurepip", "pydoc_data")
HELDOUT_BELOW = 13  # of 256: the held-out share of modules


def modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py")
                  if not set(p.relative_to(root).parts[:-1]) & set(SKIP) and not p.name.startswith("test_")
                  and not p.relative_to(root).parts[0].startswith("config-"))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    root, out = Path(argv[0]), Path(argv[1])
    splits: dict[str, list[str]] = {"train": [], "heldout": []}
    for path in modules(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n").strip("\n")
        text = re.sub(r"\n[ \t]*\n(?:[ \t]*\n)+", "\n\n", text)  # one blank line at most inside a document
        if not text:
            continue
        split = "heldout" if hashlib.sha1(rel.encode()).digest()[-1] < HELDOUT_BELOW else "train"
        splits[split].append(f"# {rel}\n{text}\n")
    out.mkdir(parents=True, exist_ok=True)
    for name, docs in splits.items():
        data = "\n\n".join(docs).encode()
        (out / f"{name}.txt.xz").write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
        print(f"{name}: {len(docs)} modules, {len(data):,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
