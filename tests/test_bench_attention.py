"""scripts/bench_attention.py's reports on CPU, from a synthetic result: ratios come from the right timings."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_attention  # noqa: E402


def result(gpu_fwdbwd_ms: float, eager_fwdbwd_ms: float, peak_mib: float) -> dict:
    flops = bench_attention.fwd_flops(16, 12, 1024, 64, True)
    gpu, eager = {"fwd": 0.1, "bwd": 0.2, "fwdbwd": gpu_fwdbwd_ms}, {"fwd": 0.1, "bwd": 0.2, "fwdbwd": eager_fwdbwd_ms}
    return {"gpu_ms": gpu, "eager_ms": eager, "gpu_tflops": bench_attention.to_tflops(gpu, flops),
            "eager_tflops": bench_attention.to_tflops(eager, flops), "peak_mib": peak_mib}


def test_reports_ratio_gpu_time_and_eager_separately(tmp_path):
    row = {"B": 16, "H": 12, "H_kv": 12, "T": 1024, "D": 64, "causal": True,
           "fwd_flops": bench_attention.fwd_flops(16, 12, 1024, 64, True),
           "methods": {"triton": result(0.5, 1.2, 10), "sdpa-flash": result(1.0, 1.0, 20),
                       "sdpa-cudnn": result(0.4, 0.9, 30), "sdpa-default": {**result(0.4, 0.6, 30), "backend": "cudnn"},
                       "flex": {"status": "n/a", "reason": "no GPU"}}}
    meta = {"device": "test", "torch": "x", "triton": "y", "cuda": "z", "dtype": "bf16", "date": "today"}
    bench_attention.write_reports({"meta": meta, "rows": [row]}, tmp_path)

    md = (tmp_path / "bench.md").read_text()
    headline = next(line for line in md.splitlines() if line.startswith("| 16,12,1024,64 | yes |"))
    cells = [c.strip() for c in headline.strip("|").split("|")]
    # triton/FA2 and triton/cuDNN in GPU time (0.5 ms vs 1.0 and 0.4), then eager triton/FA2 and triton/SDPA default
    # (1.2 ms vs 1.0 and 0.6; pinned cuDNN took 0.9 eager)
    assert cells[7:11] == ["2.00", "0.80", "0.83", "0.50"], headline
    # fwd+bwd TFLOP/s in GPU time: 3.5 * 25.8 GFLOP in 0.5 ms is 180
    assert cells[2:7] == ["180", "90", "225", "225 (cudnn)", "n/a"], headline
    assert cells[11] == "10 / 30", headline
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][0]["methods"]["triton"]["gpu_ms"]["fwdbwd"] == 0.5
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_shapes_parse_multi_head_and_grouped_query_heads():
    assert bench_attention.parse_shape("16,12,1024,64,1") == (16, 12, 12, 1024, 64, True)
    assert bench_attention.parse_shape("8,15/5,2048,64,0") == (8, 15, 5, 2048, 64, False)
    assert bench_attention.label({"B": 8, "H": 15, "H_kv": 5, "T": 2048, "D": 64}) == "8,15/5,2048,64"
