"""scripts/bench_fsdp.py on CPU (gloo, eager, a tiny model): every cell runs the loop's step, FSDP2's hooks show in
its trace summary, and the table compares each variant with the plain step of its case."""

import pytest
from helpers import table_rows

from scripts import bench_fsdp
from training.config import Reshard


def test_bench_fsdp_measures_each_variant_and_finds_fsdp_hooks_only_under_fsdp(tmp_path):
    results = bench_fsdp.main(["--device", "cpu", "--cases", "tiny:2:16",
                               "--variants", "plain,fsdp-blocks-auto-localopt", "--no-compile",
                               "--warmup", "1", "--steps", "1", "--profile-steps", "1",
                               "--out", str(tmp_path)])
    plain, fsdp = results["cells"]
    assert plain["status"] == fsdp["status"] == "ok"
    assert plain["fsdp_cpu_ms"] == {} and fsdp["fsdp_cpu_ms_per_unit"] > 0
    assert {"FSDP::pre_forward", "FSDP::post_backward_reduce"} <= set(fsdp["fsdp_cpu_ms"])
    rows = table_rows((tmp_path / "results.md").read_text())
    assert [(r["variant"], r["vs plain"]) for r in rows] == [
        ("plain", "1.000×"), ("fsdp-blocks-auto-localopt", f"{fsdp['tokens_per_sec'] / plain['tokens_per_sec']:.3f}×")]


def test_bench_fsdp_variant_names_set_their_fsdp_settings_and_unknown_ones_fail():
    fsdp, nogc = bench_fsdp.parse_variant("fsdp-blocks-never-unit0-localopt-nogc")
    assert (fsdp.reshard_after_forward, fsdp.blocks_per_unit, fsdp.local_optimizer, fsdp.compile_blocks, nogc) == (
        Reshard.never, 0, True, True, True)
    fsdp, nogc = bench_fsdp.parse_variant("fsdp-model")  # the defaults of a name, whatever FsdpConfig's are
    assert (fsdp.reshard_after_forward, fsdp.blocks_per_unit, fsdp.local_optimizer, fsdp.compile_blocks, nogc) == (
        Reshard.always, 1, False, False, False)
    assert bench_fsdp.parse_variant("plain-nogc") == (None, True)
    for bad in ("plain-auto", "fsdp-blocks-unit", "fsdp-blocks-auto4", "fsdp"):
        with pytest.raises(ValueError, match=bad):
            bench_fsdp.parse_variant(bad)
