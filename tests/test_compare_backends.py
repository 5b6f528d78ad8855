"""scripts/compare_backends.py on CPU with a tiny model: the table, JSON and plots are produced and well-formed."""

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import compare_backends  # noqa: E402


def test_sweep_writes_table_json_and_plots(tmp_path):
    backends = "naive,sdpa:math,sdpa:cudnn" + (",triton" if os.environ.get("TRITON_INTERPRET") == "1" else "")
    results = compare_backends.main([
        "--model", "tiny", "--vocab-size", "0", "--device", "cpu", "--dtype", "fp32", "--seq-lens", "16,32",
        "--tokens-per-step", "64", "--modes", "eager", "--steps", "2", "--warmup", "2", "--log-interval", "1",
        "--backends", backends, "--gpus", "0,1", "--out", str(tmp_path), "model.n_layer=1", "model.n_embd=32",
        "model.n_head=2", f"data.cache_dir={tmp_path / 'cache'}", "data.max_documents=10",
    ])
    cells = results["cells"]
    assert len(cells) == 2 * len(backends.split(","))
    assert {c["gpu"] for c in cells} <= {"0", "1"}  # --gpus: two cells at a time, each pinned to one "GPU"
    for c in cells:
        if c["backend"] == "sdpa:cudnn":  # cannot run on CPU: a result in the table, not a crash of the sweep
            assert c["status"].startswith("error:") and "sdpa_backend=cudnn cannot run" in c["status"]
            continue
        assert c["status"] == "ok" and c["tokens_per_sec"] > 0 and c["peak_rss_gib"] > 0, c
        assert c["agrees"], c  # same seed: the first-step losses of all backends match
        assert c["batch_size"] == 64 // c["seq_len"]
    assert {c["sdpa_kernel"] for c in cells if c["backend"] == "sdpa:math"} == {"math"}

    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["cells"] == cells and saved["meta"]["dtype"] == "fp32"
    table = (tmp_path / "results.md").read_text().splitlines()
    rows = [line for line in table if line.startswith("| eager")]
    assert len(rows) == len(cells) and all(line.count("|") == 14 for line in rows)
    for png in ("tokens_per_sec.png", "peak_reserved.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # --report: the table of saved results (here split in two files, as an interrupted sweep and its rest) again
    half = len(cells) // 2
    for name, part in (("a.json", cells[:half]), ("b.json", cells[half:])):
        (tmp_path / name).write_text(json.dumps({**saved, "cells": part}))
    again = compare_backends.main(["--report", f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}",
                                   "--out", str(tmp_path / "report")])
    assert again["cells"] == cells
    assert (tmp_path / "report" / "results.md").read_text() == "\n".join(table) + "\n"
    # a cell re-run in a later file replaces the earlier measurement of that cell
    rerun = {**cells[0], "tokens_per_sec": 123.0}
    (tmp_path / "c.json").write_text(json.dumps({**saved, "cells": [rerun]}))
    merged = compare_backends.main(["--report", f"{tmp_path / 'a.json'},{tmp_path / 'b.json'},{tmp_path / 'c.json'}",
                                    "--out", str(tmp_path / "merged")])
    assert sorted(map(str, merged["cells"])) == sorted(map(str, [rerun, *cells[1:]]))


@pytest.mark.parametrize("log, status", [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried", "OOM"),
    ("Traceback\nValueError: bad head dim\nSet the environment variable HYDRA_FULL_ERROR=1", "error: ValueError"),
])
def test_failed_cells_are_classified(log, status):
    assert compare_backends.failure(log).startswith(status)


def test_first_step_loss_mismatch_is_flagged():
    cells = [{"backend": b, "seq_len": 64, "mode": "eager", "status": "ok", "first_loss": loss}
             for b, loss in (("naive", 10.0), ("sdpa", 10.01), ("triton", 10.5))]
    compare_backends.check_agreement(cells, "bf16")
    assert [c["agrees"] for c in cells] == [True, True, False]
