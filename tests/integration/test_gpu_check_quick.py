"""The GPU check's CPU quick mode end to end: it prints its tables, writes its records and its section."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import gpu_check
from benchmarks.sections import markers


def test_cpu_quick_mode_prints_the_tables_and_writes_records_and_a_section(tmp_path: Path, capsys) -> None:
    import torch

    threads = torch.get_num_threads()
    out, records = tmp_path / "results.md", tmp_path / "gpu.json"
    # fp32 encoders, bf16 autocast training: both paths, in a few seconds
    argv = ["--device", "cpu", "--quick", "--precisions", "fp32", "--train-precisions", "bf16"]
    argv += ["--json", str(records), "--out", str(out)]
    assert gpu_check.main(argv) == 0
    assert torch.get_num_threads() == threads  # an in-process run leaves torch as it was
    printed = capsys.readouterr().out
    for title in ("Image encoder", "Text encoder", "Training steps", "Backfill rate for the projection"):
        assert title in printed
    assert "Command: `python benchmarks/gpu_check.py --device cpu --quick" in printed
    payload = json.loads(records.read_text())
    assert payload["model"] == gpu_check.SMOKE_MODEL and payload["torch"] == torch.__version__
    assert payload["skipped"] == [] and not [r for r in payload["records"] if "error" in r]
    sections = {r["section"] for r in payload["records"]}
    assert sections == {"image", "text", "train"}
    assert all(r["items_per_s"] > 0 for r in payload["records"])
    assert all(out.read_text().count(m) == 1 for m in markers(gpu_check.SECTION))
