"""scripts/bench_decode.py: one tiny shape end to end (CPU through the Triton interpreter, or a GPU), and its report's
arithmetic from a synthetic result."""

import json
import sys
from pathlib import Path

import pytest
import torch

from kernels import env

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_decode  # noqa: E402


@pytest.mark.skipif(not torch.cuda.is_available() and not env.INTERPRET, reason="no GPU: run with TRITON_INTERPRET=1")
def test_runs_one_tiny_shape_and_reports_every_method(tmp_path: Path) -> None:
    bench_decode.main(["--shapes", "2,4/2,48,32", "--num-splits", "2", "--out", str(tmp_path)])

    report = json.loads((tmp_path / "bench.json").read_text())
    row = report["rows"][0]
    assert (row["B"], row["Hq"], row["Hkv"], row["S"], row["D"]) == (2, 4, 2, 48, 32)
    assert row["kv_bytes"] == 2 * 2 * 2 * 48 * 32 * 2  # bf16
    assert set(row["methods"]) == set(bench_decode.METHODS)
    for method in ("ours", "sdpa-default", "sdpa-math"):  # these run everywhere; pinned kernels may be n/a
        assert row["methods"][method]["us"] > 0, method
    assert row["plan"]["n_splits"] == 2  # --num-splits reaches our kernel: the combine path ran
    assert row["max_abs_diff_vs_sdpa"] < 2e-2  # bf16 outputs of magnitude < 1: a few ulps
    assert row["sdpa_default_kernel"] in ("flash", "efficient", "cudnn", "math")
    assert row["ours_over_best_sdpa"] > 0 and row["best_sdpa"].startswith("sdpa")
    assert report["meta"]["dtype"] == "bf16" and report["meta"]["peak_bw"] == 4.8e12
    assert "| 2,4/2,48,32 |" in (tmp_path / "bench.md").read_text()


def test_report_gives_bandwidth_and_our_speed_over_the_fastest_sdpa_method(tmp_path: Path) -> None:
    S, B, Hkv, D = 8192, 16, 8, 128
    kv_bytes = 2 * B * Hkv * S * D * 2

    def timed(us: float) -> dict:
        return {"us": us, "bytes_per_s": kv_bytes / (us * 1e-6), "pct_peak_bw": 100 * kv_bytes / (us * 1e-6) / 4.8e12}

    row = {"B": B, "Hq": 32, "Hkv": Hkv, "S": S, "D": D, "kv_bytes": kv_bytes, "plan": {"n_splits": 4},
           "max_abs_diff_vs_sdpa": 0.0078125, "sdpa_default_kernel": "flash",
           "methods": {"ours": timed(100.0), "sdpa-default": timed(160.0), "sdpa-flash": timed(150.0),
                       "sdpa-efficient": timed(400.0), "sdpa-cudnn": {"status": "n/a", "reason": "no GQA"},
                       "sdpa-math": timed(2000.0)}}
    bench_decode.add_ratios(row)
    assert row["best_sdpa"] == "sdpa-flash" and row["ours_over_best_sdpa"] == pytest.approx(1.5)
    meta = {"device": "test", "torch": "x", "triton": "y", "cuda": "z", "dtype": "bf16", "date": "today",
            "peak_bw": 4.8e12, "timing": "GPU time"}
    bench_decode.write_report(tmp_path, {"meta": meta, "rows": [row]}, bench_decode.render_markdown(
        {"meta": meta, "rows": [row]}), name="bench")

    md = (tmp_path / "bench.md").read_text()
    line = next(line for line in md.splitlines() if line.startswith("| 16,32/8,8192,128 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    # 536,870,912 bytes of cache in 100 µs: 5.37 TB/s, 112 % of 4.8 TB/s
    assert cells[1:6] == ["512.0", "100.0 (5.37)", "112", "4", "160.0 (3.36) (flash)"], line
    assert cells[6:10] == ["150.0 (3.58)", "400.0 (1.34)", "n/a", "2000.0 (0.27)"], line
    assert cells[10:] == ["1.50 (sdpa-flash)", "7.8e-03"], line


def test_shapes_parse_grouped_and_multi_head() -> None:
    assert bench_decode.parse_shape("16,32/8,8192,128") == (16, 32, 8, 8192, 128)
    assert bench_decode.parse_shape("1,12,1024,64") == (1, 12, 12, 1024, 64)
    assert bench_decode.label({"B": 1, "Hq": 12, "Hkv": 12, "S": 1024, "D": 64}) == "1,12,1024,64"
    assert bench_decode.label({"B": 16, "Hq": 32, "Hkv": 8, "S": 8192, "D": 128}) == "16,32/8,8192,128"
