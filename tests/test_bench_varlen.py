"""scripts/bench_varlen.py: the packed rows it builds (lengths, positions, cu_seqlens), its useful-FLOP count against a
brute-force count of visible pairs, its report from a synthetic result, its command line; and on a GPU, one tiny
run of every method."""

import argparse
import json
from pathlib import Path

import pytest
import torch

from scripts import bench_varlen


def visible_mask(rows: list[list[int]], left: int | None) -> torch.Tensor:
    """(B, T, T) bool, brute force: query i sees key j of its row if both are in one sequence, j <= i, and (with a
    window) i - j <= left."""
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in rows])
    t = torch.arange(ids.shape[1])
    mask = (ids[:, :, None] == ids[:, None, :]) & (t[:, None] >= t[None, :])
    return mask & (t[:, None] - t[None, :] <= left) if left is not None else mask


def table_rows(markdown: str, first_header: str) -> list[list[str]]:
    """The cells of the data rows of the markdown table whose header begins with `first_header`."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


@pytest.mark.parametrize("spec", ["lognormal:400:1.0", "lognormal:50:2.0", "fixed:512", "fixed:3000", "fixed:9000"])
def test_pack_rows_is_seeded_and_fills_every_row_exactly_with_lengths_in_1_to_T(spec):
    dist = bench_varlen.parse_lengths(spec)
    rows = bench_varlen.pack_rows(dist, 4, 8192, seed=0)
    assert len(rows) == 4 and all(sum(row) == 8192 for row in rows)
    assert all(1 <= n <= 8192 for row in rows for n in row)
    assert bench_varlen.pack_rows(dist, 4, 8192, seed=0) == rows
    if dist["kind"] == "lognormal":
        assert bench_varlen.pack_rows(dist, 4, 8192, seed=1) != rows


def test_fixed_lengths_fill_a_row_and_cut_its_last_sequence_to_fit():
    assert bench_varlen.pack_rows(bench_varlen.parse_lengths("fixed:3000"), 2, 8192, seed=0) == [[3000, 3000, 2192]] * 2
    assert bench_varlen.pack_rows(bench_varlen.parse_lengths("fixed:9000"), 1, 8192, seed=0) == [[8192]]  # clipped to T


def test_lognormal_lengths_follow_the_stated_median_and_are_recorded():
    dist = bench_varlen.parse_lengths("lognormal:400:1.0")
    assert dist["mean"] == pytest.approx(400 * 1.6487, rel=1e-4)  # median * exp(sigma^2 / 2)
    rows = bench_varlen.pack_rows(dist, 64, 16384, seed=0)
    stats = bench_varlen.length_stats(rows, 16384)
    assert stats["num_seqs"] == sum(map(len, rows)) and stats["max"] <= 16384
    assert 330 < stats["median"] < 480  # ~400; the rows' cut last sequences pull it down a little


def test_positions_restart_at_zero_exactly_at_each_cu_seqlens_start():
    rows = bench_varlen.pack_rows(bench_varlen.parse_lengths("lognormal:40:1.0"), 3, 512, seed=0)
    positions = bench_varlen.positions_of(rows)
    cu_seqlens = bench_varlen.cu_seqlens_of(rows)
    assert positions.shape == (3, 512) and cu_seqlens.dtype == torch.int32
    assert cu_seqlens[0] == 0 and cu_seqlens[-1] == 3 * 512 and bool((cu_seqlens.diff() >= 1).all())
    flat = positions.flatten()
    starts = torch.zeros(3 * 512, dtype=torch.bool)
    starts[cu_seqlens[:-1].long()] = True
    assert torch.equal(flat == 0, starts)  # a 0 at every sequence start and nowhere else
    assert bool(starts[torch.arange(3) * 512].all())  # every row begins a sequence
    assert bool((flat[1:][~starts[1:]] == flat[:-1][~starts[1:]] + 1).all())  # +1 within a sequence


@pytest.mark.parametrize("left", [None, 0, 1, 3, 100])
def test_useful_flops_count_the_visible_pairs_of_a_brute_force_mask(left):
    rows = [[3, 1, 4], [5, 2, 1], [8]]
    pairs = int(visible_mask(rows, left).sum())
    lengths = [n for row in rows for n in row]
    assert sum(bench_varlen.visible_pairs(n, left) for n in lengths) == pairs
    assert bench_varlen.fwd_bwd_flops(lengths, 3, 16, left) == 3.5 * 4 * 3 * 16 * pairs  # Hq=3, D=16
    if left is None:
        assert bench_varlen.length_stats(rows, 8)["useful_fraction"] == pairs / (3 * 8 * 9 / 2)


def test_the_default_window_is_about_4_3x_smaller_than_full_causal():
    ratio = bench_varlen.visible_pairs(16384) / bench_varlen.visible_pairs(16384, 2048)
    assert ratio == pytest.approx(4.265, abs=1e-3)


def ok(ms: float, flops: float, **extra) -> dict:
    return {"ms": ms, "tflops": bench_varlen.tflops(flops, ms), **extra}


def synthetic_report() -> dict:
    """One packed row (ours 2 ms, Flex 3 ms, dense 10 ms; NJT kernels with repeated k/v, one timed eagerly, one n/a)
    and one window row
    (window 1 ms, causal 4 ms, Flex 1.5 ms)."""
    rows = [[4096] * 4, [2048] * 8]
    dist = bench_varlen.parse_lengths("fixed:4096")
    useful = bench_varlen.fwd_bwd_flops([4096] * 8, 32, 128)
    dense = bench_varlen.fwd_bwd_flops([16384, 16384], 32, 128)
    packed = {"lengths": dist, "B": 2, "T": 16384, "H": 32, "H_kv": 8, "D": 128,
              "realised": bench_varlen.length_stats(rows[:1] * 2, 16384), "useful_flops": useful, "dense_flops": dense,
              "methods": {"ours": ok(2.0, useful), "ours-by-example": ok(1.8, useful, max_abs_diff_vs_ours=2e-3),
                          "ours-by-example-whole": ok(1.9, useful, max_abs_diff_vs_ours=2e-3),
                          "ours-varlen": ok(2.2, useful, max_abs_diff_vs_ours=0.0),
                          "ours-dense": ok(10.0, useful, dense_tflops=bench_varlen.tflops(dense, 10.0),
                                           max_abs_diff_vs_ours=3.5),
                          "flex": ok(3.0, useful, max_abs_diff_vs_ours=7.8e-3),
                          "sdpa-njt-flash": ok(4.0, useful, gqa="repeated", max_abs_diff_vs_ours=3.9e-3),
                          "sdpa-njt-efficient": ok(5.0, useful, gqa="repeated", timing="kernels", eager_ms=140.0,
                                                      capture_error="AcceleratorError: capture failed"),
                          "sdpa-njt-cudnn": {"status": "n/a", "reason": "no kernel"}}}
    bench_varlen.add_packed_ratios(packed)
    causal, window = (bench_varlen.fwd_bwd_flops([16384], 16, 64, left) for left in (None, 2048))
    win = {"B": 1, "T": 16384, "H": 16, "H_kv": 16, "D": 64, "window": [2048, 0], "window_flops": window,
           "causal_flops": causal, "area_ratio": causal / window,
           "methods": {"ours-window": ok(1.0, window), "ours-causal": ok(4.0, causal, max_abs_diff_vs_ours=2.0),
                       "flex-window": ok(1.5, window, max_abs_diff_vs_ours=1e-2)}}
    bench_varlen.add_window_ratios(win)
    meta = {"device": "test GPU", "date": "today", "torch": "x", "triton": "y", "cuda": "z"}
    return {"meta": meta, "packed": [packed], "window": [win]}


def test_ratios_are_flex_over_ours_and_useful_over_dense_tflops_and_causal_over_window():
    report = synthetic_report()
    packed, win = report["packed"][0], report["window"][0]
    assert packed["ours_over_flex"] == pytest.approx(1.5)
    # useful 8 sequences of 4096 in 2 ms, against 2 rows of 16384 plain causal in 10 ms
    expected = (8 * 4096 * 4097 / 2 / 2.0) / (2 * 16384 * 16385 / 2 / 10.0)
    assert packed["useful_over_dense"] == pytest.approx(expected)
    assert win["causal_over_window"] == pytest.approx(4.0) and win["ours_over_flex"] == pytest.approx(1.5)


def test_markdown_tables_show_ms_useful_tflops_statuses_and_ratios(tmp_path):
    report = synthetic_report()
    packed = report["packed"][0]
    markdown = bench_varlen.render_markdown(report)
    bench_varlen.write_report(tmp_path, report, markdown)

    (row,) = table_rows(markdown, "lengths")
    methods = bench_varlen.PACKED_METHODS  # all present in the synthetic row
    assert row[:6] == ["fixed 4096", "2×16384", "32/8, D=128", "8", "4096 / 4096 / 4096", "25.0%"], row
    tf = lambda ms: f"{bench_varlen.tflops(packed['useful_flops'], ms):.0f}"  # noqa: E731
    assert row[6:6 + len(methods)] == [f"2.000 ({tf(2.0)})", f"1.800 ({tf(1.8)})", f"1.900 ({tf(1.9)})",
                                       f"2.200 ({tf(2.2)})",
                                       f"10.000 ({tf(10.0)})",
                                       f"3.000 ({tf(3.0)})", f"4.000 ({tf(4.0)}) †", f"5.000 ({tf(5.0)}) †‡",
                                       "n/a"], row
    dense_tf = bench_varlen.tflops(packed["dense_flops"], 10.0)
    assert row[6 + len(methods):] == [f"{dense_tf:.0f}", "1.50×", f"{packed['useful_over_dense']:.2f}"], row

    (win,) = table_rows(markdown, "B×T")
    assert win[:4] == ["1×16384", "16, D=64", "(2048, 0)", "4.26"], win
    assert win[6] == "4.00×" and win[8] == "1.50×", win
    assert win[4].startswith("1.000 (") and win[7].startswith("1.500 ("), win
    assert ("ours-by-example 2.0e-03, ours-by-example-whole 2.0e-03, ours-varlen 0.0e+00, ours-dense 3.5e+00, "
            "flex 7.8e-03") in markdown
    assert "† k/v heads repeated" in markdown
    assert "sdpa-njt-efficient: 140.000 ms per call run eagerly (AcceleratorError: capture failed)" in markdown
    assert json.loads((tmp_path / "results.json").read_text())["packed"][0]["methods"]["ours"]["ms"] == 2.0
    assert (tmp_path / "results.md").read_text() == markdown


def test_kernel_names_lose_return_type_templates_and_parameters():
    assert bench_varlen.kernel_name("_bwd_ws_kernel") == "_bwd_ws_kernel"
    assert bench_varlen.kernel_name("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl>(int, "
                                    "float)") == "at::native::elementwise_kernel"


def test_kernels_table_lists_each_methods_five_largest_kernels_and_the_rest():
    report = synthetic_report()
    report["packed"][0]["methods"]["ours"]["kernels"] = {f"k{i}": 0.5 - 0.05 * i for i in range(7)}
    report["window"][0]["methods"]["flex-window"]["kernels"] = {"flex_fwd": 0.4, "flex_bwd": 1.1}
    (ours, flex) = table_rows(bench_varlen.render_markdown(report), "row")
    assert ours == ["[fixed 4096; 2x16384; 32/8, D=128]", "ours", f"{sum(0.5 - 0.05 * i for i in range(7)):.3f}",
                    "k0 0.500; k1 0.450; k2 0.400; k3 0.350; k4 0.300; 2 more 0.450"], ours
    assert flex == ["[window 2048; 1x16384; 16, D=64]", "flex-window", "1.500", "flex_fwd 0.400; flex_bwd 1.100"]
    assert "by kernel" not in bench_varlen.render_markdown(synthetic_report())  # without --kernels: no table


def test_cli_defaults_are_three_length_distributions_two_head_configs_and_two_window_rows():
    args = bench_varlen.parse_args([])
    assert [d["spec"] for d in args.lengths] == ["lognormal:400:1.0", "fixed:512", "fixed:2048"]
    assert args.heads == [(15, 5, 64), (32, 8, 128)] and args.window_heads == [(16, 16, 64), (16, 16, 128)]
    assert (args.batch, args.seq_len, args.window, args.window_batch, args.window_seq_len) == (4, 16384, 2048, 1, 16384)
    assert args.methods == bench_varlen.METHODS and args.parts == ["packed", "window"] and args.out is None
    assert not args.kernels


def test_cli_quick_keeps_one_small_row_of_each_part_and_flags_select():
    args = bench_varlen.parse_args(["--quick", "--methods", "ours,flex-window", "--heads", "4/2,32", "8,64"])
    assert (args.batch, args.seq_len, args.window_seq_len, args.window) == (2, 2048, 2048, 512)
    assert len(args.lengths) == 1 and args.heads == [(4, 2, 32)] and len(args.window_heads) == 1
    assert args.methods == ["ours", "flex-window"]


@pytest.mark.parametrize("argv", [["--lengths", "normal:3"], ["--lengths", "lognormal:0:1"], ["--lengths", "fixed:0"],
                                  ["--heads", "15/4,64"], ["--heads", "16"], ["--methods", "ours,fa3"],
                                  ["--parts", "dense"], ["--batch", "0"]])
def test_cli_rejects_bad_specs(argv, capsys):
    with pytest.raises(SystemExit):
        bench_varlen.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_length_and_head_specs_parse():
    assert bench_varlen.parse_lengths("fixed:512")["length"] == 512
    assert bench_varlen.parse_lengths("lognormal:400:1")["sigma"] == 1.0
    assert bench_varlen.parse_heads("15/5,64") == (15, 5, 64) and bench_varlen.parse_heads("16,128") == (16, 16, 128)
    with pytest.raises(argparse.ArgumentTypeError):
        bench_varlen.parse_heads("0,64")


@pytest.mark.gpu
def test_a_tiny_run_reports_every_method_and_ours_agrees_with_flex(tmp_path: Path):
    report = bench_varlen.main(["--lengths", "lognormal:60:1.0", "--heads", "4/2,64", "--batch", "2", "--seq-len",
                                "512", "--window-heads", "4,64", "--window-seq-len", "512", "--window", "128",
                                "--kernels", "--out", str(tmp_path)])
    (packed,), (win,) = report["packed"], report["window"]
    assert set(packed["methods"]) == set(bench_varlen.PACKED_METHODS)
    assert set(win["methods"]) == set(bench_varlen.WINDOW_METHODS)
    for method in ("ours", "ours-varlen", "ours-dense", "flex"):
        assert packed["methods"][method]["ms"] > 0, method
    for method in ("ours-varlen", "flex"):  # bf16 outputs of magnitude < 1: a few ulps
        assert packed["methods"][method]["max_abs_diff_vs_ours"] < 2e-2, method
    assert win["methods"]["flex-window"]["max_abs_diff_vs_ours"] < 2e-2
    assert packed["useful_over_dense"] > 0 and win["causal_over_window"] > 0
    assert "| lognormal median 60, σ 1 |" in (tmp_path / "results.md").read_text()
    ours = packed["methods"]["ours"]  # its kernels' GPU time: about the graph replay's, never more than twice
    assert any("bwd" in name for name in ours["kernels"]) and 0 < sum(ours["kernels"].values()) < 2 * ours["ms"]
