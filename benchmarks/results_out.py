"""Where a benchmark's printed tables and raw numbers go (``--out``): ``<name>.md`` (the command line that made them,
then the tables) and ``<name>.json``, as ``benchmarks/results`` keeps them."""

import json
import sys
from pathlib import Path


def save_results(out: Path, name: str, text: str, payload: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(f"$ python benchmarks/{name}.py {' '.join(sys.argv[1:])}\n\n{text}\n")
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1))
