"""scripts/common.py, what the benchmark scripts share: metadata, report files, output folders, table cells."""

import datetime
import json
import sys

import torch

from scripts.common import ROOT, cprofile_table, default_out, fmt, run_meta, write_report


def test_run_meta_records_device_versions_utc_date_command_and_settings(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["scripts/bench_x.py", "--steps", "3"])
    meta = run_meta(torch.device("cpu"), dtype="fp32", steps=3)
    assert meta["device"] == "cpu" and meta["torch"] == torch.__version__ and meta["cuda"] == torch.version.cuda
    assert "triton" in meta and meta["command"] == "python scripts/bench_x.py --steps 3"
    stamp = datetime.datetime.strptime(meta["date"], "%Y-%m-%d %H:%M UTC").replace(tzinfo=datetime.timezone.utc)
    assert abs(datetime.datetime.now(datetime.timezone.utc) - stamp) < datetime.timedelta(minutes=2)
    assert (meta["dtype"], meta["steps"]) == ("fp32", 3)
    assert run_meta("NVIDIA H200")["device"] == "NVIDIA H200" and "device" not in run_meta()


def test_write_report_writes_the_json_and_the_markdown_when_given(tmp_path):
    out = tmp_path / "new" / "folder"
    write_report(out, {"cells": [1]})  # a partial save: JSON only
    assert json.loads((out / "results.json").read_text()) == {"cells": [1]} and not (out / "results.md").exists()
    write_report(out, {"cells": [1, 2]}, "| a |\n", name="bench")
    assert json.loads((out / "bench.json").read_text()) == {"cells": [1, 2]}
    assert (out / "bench.md").read_text() == "| a |\n"


def test_default_out_is_a_dated_folder_of_its_topic_under_outputs_bench():
    out = default_out("generation")
    assert out.parent == ROOT / "outputs" / "bench" and not out.exists()
    stamp = datetime.datetime.strptime(out.name.removeprefix("generation-"), "%Y-%m-%d_%H-%M-%S")
    assert abs(datetime.datetime.now() - stamp) < datetime.timedelta(minutes=2)


def test_fmt_shows_missing_and_nan_values_as_a_dash():
    assert [fmt(None, ".2f"), fmt(float("nan"), ".2f"), fmt(1234.5, ",.0f")] == ["–", "–", "1,234"]


def test_cprofile_table_counts_each_profiled_call_and_leaves_out_what_runs_between():
    def profiled_call() -> None:
        sum(range(100))

    def between_calls() -> None:
        sum(range(100))

    table = cprofile_table(profiled_call, 3, 20, between_calls)
    row = next(line for line in table.splitlines() if "(profiled_call)" in line)
    assert row.split()[0] == "3" and "between_calls" not in table
