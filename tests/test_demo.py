"""The README's main job, exactly as documented, on the embedded tiny Llama (about a minute on CPU)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_command_on_the_embedded_model(tmp_path):
    out = tmp_path / "tiny-cca"
    cli = Path(sys.executable).parent / "cca-convert"
    command = [str(cli)] if cli.exists() else [sys.executable, "-m", "cca_convert.cli"]
    proc = subprocess.run(
        [*command, "examples/tiny-llama", "--recipe", "recipes/tiny-demo.yaml", "--output", str(out)],
        cwd=REPO, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "max |logit diff| = 0.00e+00" in proc.stdout  # the round trip ran and matched

    report = json.loads((out / "validation" / "report.json").read_text())
    assert report["passed"] is True and not report["failed_gates"]
    assert {"base", "cca_before", "cca_after"} <= set(report["results"])
    assert (out / "validation" / "ppl.png").stat().st_size > 0
    front = yaml.safe_load((out / "README.md").read_text().split("---")[1])
    assert front["model-index"][0]["results"][0]["metrics"]
    assert (out / "finetune" / "metrics.jsonl").read_text().count("\n") >= 24
    shutil.rmtree(out)


@pytest.mark.slow
def test_dca_demo_reads_past_the_trained_context(tmp_path):
    """`make demo-dca`: the embedded model (trained at c = 2048) with DCA, no training; the report shows DCA's
    perplexity flat from c to 4c (the recipe's 1.2x growth gate) while the base's rises."""
    out = tmp_path / "tiny-dca"
    proc = subprocess.run([sys.executable, "-m", "cca_convert.cli", "examples/tiny-llama", "--recipe",
                           "recipes/dca-tiny-demo.yaml", "--output", str(out)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "max |logit diff| = 0.00e+00" in proc.stdout
    report = json.loads((out / "validation" / "report.json").read_text())
    assert report["passed"] is True and report["model"]["method"] == "dca"
    ppl = {m: {int(n): v["ppl"] for n, v in report["results"][m]["perplexity"].items()} for m in ("base", "dca")}
    assert abs(ppl["dca"][1024] / ppl["base"][1024] - 1) < 1e-5  # L <= C + 1 = 1537: the base model
    assert ppl["dca"][8192] <= 1.2 * ppl["dca"][2048]
    assert ppl["base"][8192] > ppl["base"][2048] and ppl["dca"][8192] < ppl["base"][8192]
    assert "Dual Chunk Attention" in (out / "README.md").read_text()
    shutil.rmtree(out)
