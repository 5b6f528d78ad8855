"""scripts/bench_fsdp.py on CPU (gloo, eager, a tiny model): every cell runs the loop's step, FSDP2's hooks show in
its trace summary, and the table compares each variant with the plain step of its case."""

import pytest
import torch
from helpers import table_rows
from torch.distributed.tensor import DTensor

from scripts import bench_fsdp
from training.config import Reshard


def test_bench_fsdp_measures_each_variant_and_finds_fsdp_hooks_only_under_fsdp(tmp_path):
    results = bench_fsdp.main(["--device", "cpu", "--cases", "tiny:2:16",
                               "--variants", "plain,fsdp-blocks-auto-localopt", "--no-compile",
                               "--warmup", "1", "--steps", "1", "--profile-steps", "1", "--cprofile-steps", "1",
                               "--out", str(tmp_path)])
    plain, fsdp = results["cells"]
    assert plain["status"] == fsdp["status"] == "ok"
    assert plain["fsdp_cpu_ms"] == {} and fsdp["fsdp_cpu_ms_per_unit"] > 0
    assert {"FSDP::pre_forward", "FSDP::post_backward_reduce"} <= set(fsdp["fsdp_cpu_ms"])
    assert "_fully_shard" in fsdp["cprofile"] and "_fully_shard" not in plain["cprofile"]  # FSDP2's own functions
    report = (tmp_path / "results.md").read_text()
    assert "## cProfile: tiny:2:16 fsdp-blocks-auto-localopt, 1 steps" in report
    rows = table_rows(report)
    assert [(r["variant"], r["vs plain"]) for r in rows] == [
        ("plain", "1.000×"), ("fsdp-blocks-auto-localopt", f"{fsdp['tokens_per_sec'] / plain['tokens_per_sec']:.3f}×")]


def test_bench_fsdp_variant_names_set_their_fsdp_settings_and_unknown_ones_fail():
    fsdp, nogc = bench_fsdp.parse_variant("fsdp-blocks-never-unit0-localopt-nogc")
    assert (fsdp.reshard_after_forward, fsdp.blocks_per_unit, fsdp.local_optimizer, fsdp.compile_blocks, nogc) == (
        Reshard.never, 0, True, True, True)
    assert not fsdp.compile_units and bench_fsdp.parse_variant("fsdp-blocks-units")[0].compile_units
    assert not fsdp.gather_fp32 and bench_fsdp.parse_variant("fsdp-blocks-fp32gather")[0].gather_fp32
    fsdp, nogc = bench_fsdp.parse_variant("fsdp-model")  # the defaults of a name, whatever FsdpConfig's are
    assert (fsdp.reshard_after_forward, fsdp.blocks_per_unit, fsdp.local_optimizer, fsdp.compile_blocks, nogc) == (
        Reshard.always, 1, False, False, False)
    fsdp, _ = bench_fsdp.parse_variant("fsdp-blocks-auto-unit0-localopt-multi")  # the world size of the policy only
    assert fsdp == bench_fsdp.parse_variant("fsdp-blocks-auto-unit0-localopt")[0]
    assert bench_fsdp.parse_variant("plain-nogc") == (None, True)
    for bad in ("plain-auto", "fsdp-blocks-unit", "fsdp-blocks-auto4", "fsdp"):
        with pytest.raises(ValueError, match=bad):
            bench_fsdp.parse_variant(bad)


@pytest.mark.parametrize("variant, gathered, accum", [("fsdp-blocks-auto-unit1", [0, 1, 2, 3], 1),
                                                      ("fsdp-blocks-auto-unit1-multi", [3], 1),
                                                      ("fsdp-blocks-auto-unit1-multi", [3], 2)])
def test_bench_fsdp_multi_variant_gives_the_reshard_policy_of_several_gpus_in_every_micro_batch(
        variant, gathered, accum):
    args = bench_fsdp.parse_args(["--device", "cpu", "--no-compile", "--attention", "naive",
                                  "--grad-accum", str(accum)])
    bench_fsdp.join_world_of_one(torch.device("cpu"))
    try:
        step, model, _ = bench_fsdp.build_step("tiny", 2, 16, variant, args)
        seen = []  # as the head runs, after every block's forward: the blocks still gathered (no DTensor weights)
        model.transformer.ln_f.register_forward_pre_hook(lambda m, a: seen.append(
            [i for i, b in enumerate(model.transformer.h) if not isinstance(b.attn.c_proj.weight, DTensor)]))
        step()
    finally:
        torch.distributed.destroy_process_group()
    assert seen == [gathered] * accum
