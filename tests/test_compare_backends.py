"""scripts/compare_backends.py on CPU with a tiny model: every cell runs (or records why not), the table holds the JSON
results, the plots are written, --report rebuilds the table from saved results, later files replacing cells, and
results go to a fresh folder under outputs/bench/ unless --out says otherwise."""

import json
import os
from pathlib import Path

import pytest
from helpers import table_rows

from scripts import common, compare_backends
from scripts.common import failure

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """A 2-sequence-length eager sweep of 3 backends (4 with the Triton interpreter), two cells at a time."""
    out = tmp_path_factory.mktemp("sweep")
    backends = "naive,sdpa:math,sdpa:cudnn" + (",triton" if os.environ.get("TRITON_INTERPRET") == "1" else "")
    results = compare_backends.main([
        "--model", "tiny", "--vocab-size", "0", "--device", "cpu", "--dtype", "fp32", "--seq-lens", "16,32",
        "--tokens-per-step", "64", "--modes", "eager", "--steps", "2", "--warmup", "2", "--log-interval", "1",
        "--backends", backends, "--gpus", "0,1", "--out", str(out), "model.n_layer=1", "model.n_embd=32",
        "model.n_head=2", f"data.cache_dir={out / 'cache'}", "data.max_documents=10",
    ])
    return results, out


def test_sweep_runs_every_cell_and_records_a_backend_that_cannot_run(sweep):
    results, out = sweep
    cells = results["cells"]
    backends = {c["backend"] for c in cells}
    assert sorted((c["backend"], c["seq_len"]) for c in cells) == sorted((b, t) for b in backends for t in (16, 32))
    assert {c["gpu"] for c in cells} <= {"0", "1"}  # --gpus: two cells at a time, each pinned to one "GPU"
    for c in cells:
        if c["backend"] == "sdpa:cudnn":  # cannot run on CPU: a result in the table, not a crash of the sweep
            assert c["status"].startswith("error:") and "sdpa_backend=cudnn cannot run" in c["status"]
            continue
        assert c["status"] == "ok" and c["tokens_per_sec"] > 0 and c["peak_rss_gib"] > 0, c
        assert c["agrees"], c  # same seed: the first-step losses of all backends match
        assert c["batch_size"] == 64 // c["seq_len"]
    assert {c["sdpa_kernel"] for c in cells if c["backend"] == "sdpa:math"} == {"math"}
    saved = json.loads((out / "results.json").read_text())
    assert saved["cells"] == cells and saved["meta"]["dtype"] == "fp32" and saved["partial"] is False
    for png in ("tokens_per_sec.png", "peak_reserved.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_has_one_row_per_cell_with_its_results(sweep):
    results, out = sweep
    rows = {(r["backend"], int(r["T"])): r for r in table_rows((out / "results.md").read_text())}
    cells = {(c["backend"], c["seq_len"]): c for c in results["cells"]}
    assert rows.keys() == cells.keys()
    for key, c in cells.items():
        row = rows[key]
        assert (row["mode"], int(row["B"])) == ("eager", c["batch_size"])
        if c["status"] != "ok":
            assert row["tokens/s"] == c["status"]
            continue
        assert float(row["tokens/s"].replace(",", "")) == pytest.approx(c["tokens_per_sec"], abs=0.5)
        assert float(row["first loss"]) == pytest.approx(c["first_loss"], abs=5e-5)
        assert row["SDPA kernel"] == (c["sdpa_kernel"] or "–") and row["agrees"] == "✓"
        naive = cells[("naive", c["seq_len"])]
        assert row["vs naive"] == f"{c['tokens_per_sec'] / naive['tokens_per_sec']:.2f}×"


def test_report_of_split_results_rebuilds_the_table_and_later_files_replace_cells(sweep, tmp_path):
    results, out = sweep
    cells, saved = results["cells"], json.loads((out / "results.json").read_text())
    half = len(cells) // 2
    for name, part in (("a.json", cells[:half]), ("b.json", cells[half:])):  # an interrupted sweep and its rest
        (tmp_path / name).write_text(json.dumps({**saved, "cells": part}))
    again = compare_backends.main(["--report", f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}",
                                   "--out", str(tmp_path / "report")])
    assert again["cells"] == cells
    assert (tmp_path / "report" / "results.md").read_text() == (out / "results.md").read_text()
    rerun = {**cells[0], "tokens_per_sec": 123.0}
    (tmp_path / "c.json").write_text(json.dumps({**saved, "cells": [rerun]}))
    merged = compare_backends.main(["--report", f"{tmp_path / 'a.json'},{tmp_path / 'b.json'},{tmp_path / 'c.json'}",
                                    "--out", str(tmp_path / "merged")])
    assert sorted(map(str, merged["cells"])) == sorted(map(str, [rerun, *cells[1:]]))


def test_default_out_is_a_fresh_folder_under_outputs_bench_not_the_committed_results_in_docs(sweep, tmp_path,
                                                                                             monkeypatch):
    out = compare_backends.parse_args([]).out
    assert out.parent == ROOT / "outputs" / "bench" and out.name.startswith("compare-backends-")
    assert (ROOT / "docs") not in out.parents
    # Without --out, a run (here the --report of the sweep's results) writes there and nowhere else.
    monkeypatch.setattr(common, "ROOT", tmp_path)  # the repository root that default_out builds on
    compare_backends.main(["--report", str(sweep[1] / "results.json")])
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    folder = next((tmp_path / "outputs" / "bench").iterdir()).name
    assert folder.startswith("compare-backends-")
    assert written == [f"outputs/bench/{folder}/{name}"
                       for name in ("peak_reserved.png", "results.json", "results.md", "tokens_per_sec.png")]


@pytest.mark.parametrize("log, status", [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried", "OOM"),
    ("Traceback\nValueError: bad head dim\nSet the environment variable HYDRA_FULL_ERROR=1", "error: ValueError"),
    ("error: train.max_steps must be >= 1, got 0\n", "error: train.max_steps must be >= 1"),
])
def test_failed_cells_are_classified(log, status):
    assert failure(log).startswith(status)


def test_first_step_loss_mismatch_is_flagged():
    cells = [{"backend": b, "seq_len": 64, "mode": "eager", "status": "ok", "first_loss": loss}
             for b, loss in (("naive", 10.0), ("sdpa", 10.01), ("triton", 10.5))]
    compare_backends.check_agreement(cells, "bf16")
    assert [c["agrees"] for c in cells] == [True, True, False]


def test_unknown_backend_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        compare_backends.parse_args(["--backends", "naive,sdpa:fast"])
    error = capsys.readouterr().err
    assert "unknown sdpa:fast: choose from naive, sdpa, sdpa:flash, sdpa:efficient, sdpa:cudnn" in error
