"""scripts/bench_finetune.py on CPU with the tiny Llama preset: our cells (train.py) and the transformers cells (the
script re-invoked), full fine-tuning and LoRA, all run, results.json holds them and results.md has a row for each,
compared to transformers doing the same; a failed cell is a row."""

import json
import os
from pathlib import Path

import pytest

from scripts import bench_finetune


def table_rows(markdown: str) -> list[dict[str, str]]:
    """The rows of the markdown tables in the text, as {column header: cell} (the tables share one header)."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    cells = lambda line: [cell.strip() for cell in line.strip().strip("|").split("|")]  # noqa: E731
    header = cells(lines[0])
    return [dict(zip(header, cells(line), strict=True)) for line in lines
            if not line.startswith("|---") and cells(line) != header]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("finetune")
    backends = "sdpa,transformers,sdpa-lora,transformers-lora" + (
        ",triton" if os.environ.get("TRITON_INTERPRET") == "1" else "")
    results = bench_finetune.main([
        "--presets", "llama-tiny", "--device", "cpu", "--dtype", "fp32", "--no-compile", "--batch-size", "2",
        "--seq-len", "32", "--steps", "2", "--warmup", "2", "--log-interval", "1", "--backends", backends,
        "--out", str(out), f"data.cache_dir={out / 'cache'}", "data.max_documents=10",
    ])
    return results, out


def test_every_cell_runs_and_is_saved(run):
    results, out = run
    cells = results["cells"]
    expected = {"ours-sdpa", "transformers", "ours-sdpa LoRA", "transformers+peft LoRA"} | (
        {"ours-triton"} if os.environ.get("TRITON_INTERPRET") == "1" else set())
    assert {c["backend"] for c in cells} == expected and len(cells) == len(expected)
    for c in cells:
        assert c["preset"] == "llama-tiny" and c["status"] == "ok", c
        assert c["tokens_per_sec"] > 0 and c["peak_rss_gib"] > 0 and c["device"] == "cpu", c
        assert 4 < c["first_loss"] < 7, c  # random weights, byte vocabulary: about ln 257 = 5.55
    assert {c["backend"]: c["sdpa_kernel"] for c in cells}["transformers"] not in (None, "unknown")
    assert results["presets"]["llama-tiny"]["loss_chunk_tokens"] == 0
    assert results["presets"]["llama-tiny"]["n_kv_head"] == 2
    saved = json.loads((out / "results.json").read_text())
    assert saved["cells"] == cells and saved["partial"] is False
    assert saved["meta"]["seq_len"] == 32 and saved["meta"]["transformers"]


def test_table_has_a_row_per_cell_with_ratios_to_transformers(run):
    results, out = run
    rows = {r["model"]: r for r in table_rows((out / "results.md").read_text())}
    cells = {c["backend"]: c for c in results["cells"]}
    assert rows.keys() == cells.keys()
    for name, c in cells.items():
        hf = cells["transformers+peft LoRA" if name.endswith("LoRA") else "transformers"]
        assert float(rows[name]["tokens/s"].replace(",", "")) == pytest.approx(c["tokens_per_sec"], abs=0.5)
        assert rows[name]["vs transformers"] == f"{c['tokens_per_sec'] / hf['tokens_per_sec']:.2f}×"
        assert rows[name]["memory vs transformers"] == f"{c['peak_rss_gib'] / hf['peak_rss_gib']:.2f}×"


def test_a_failed_cell_is_a_row_and_ratios_need_an_ok_transformers_cell():
    meta = {"batch_size": 8, "seq_len": 2048, "dtype": "bf16", "compile": True, "steps": 20, "warmup": 5,
            "device": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "transformers": "5.0", "date": "today"}
    ok = {"status": "ok", "tokens_per_sec": 1000.0, "mfu": 0.4, "peak_reserved_gib": 10.0, "sdpa_kernel": "cudnn"}
    cells = [{"preset": "p", "backend": "ours-sdpa", **ok}, {"preset": "p", "backend": "transformers", "status": "OOM"}]
    presets = {"p": {"n_params": 360_000_000, "vocab_size": 49152, "loss_chunk_tokens": 0}}
    rows = {r["model"]: r for r in table_rows(bench_finetune.markdown({"meta": meta, "presets": presets,
                                                                        "cells": cells}))}
    assert rows["transformers"]["tokens/s"] == "OOM"
    assert (rows["ours-sdpa"]["tokens/s"], rows["ours-sdpa"]["vs transformers"]) == ("1,000", "–")
    assert (rows["ours-sdpa"]["MFU"], rows["ours-sdpa"]["peak reserved GiB"]) == ("40.0%", "10.00")
