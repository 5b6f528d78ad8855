"""scripts/bench_sft.py on the CPU: a packed train.py cell and the transformers cell on padded rows, tiny shapes."""

import json
import sys

import pytest

from scripts import bench_sft


def test_bench_sft_runs_a_packed_cell_and_the_transformers_cell_and_reports_trained_tokens(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(sys, "argv", ["bench_sft.py"])
    results = bench_sft.main(["--preset", "llama-tiny", "--device", "cpu", "--dtype", "fp32", "--no-compile",
                              "--batch-size", "2", "--seq-len", "256", "--steps", "2", "--warmup", "2",
                              "--log-interval", "1", "--examples", "120", "--cells", "sdpa-packed,transformers-padded",
                              "--out", str(tmp_path)])
    cells = {c["cell"]: c for c in results["cells"]}
    assert all(c["status"] == "ok" for c in cells.values()), cells
    assert 0 < cells["sdpa-packed"]["packing_fill"] <= 1 and cells["transformers-padded"]["trained_tokens_per_sec"] > 0
    assert cells["sdpa-packed"]["trained_tokens_per_sec"] > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [c["cell"] for c in saved["cells"]] == ["sdpa-packed", "transformers-padded"]
    assert "| sdpa-packed |" in (tmp_path / "results.md").read_text()
