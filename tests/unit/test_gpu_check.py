"""benchmarks/gpu_check.py: it refuses without CUDA; its CPU smoke mode writes the tables and the records."""

from __future__ import annotations

import pytest

from benchmarks import gpu_check


def test_without_cuda_it_refuses_with_a_sentence_and_status_2(monkeypatch, capsys) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "torch.cuda.is_available() is false" in err


def test_the_cpu_is_only_the_smoke_mode(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--device", "cpu"])
    assert exc.value.code == 2 and "add --quick" in capsys.readouterr().err


def test_a_row_that_ran_out_of_memory_keeps_the_table_shape() -> None:
    env = dict(
        command="python benchmarks/gpu_check.py",
        model="ViT-B-32",
        quick=False,
        device="GPU",
        params_m=151.3,
        torch="2",
        open_clip="3",
        python="3.11",
        cuda="13.0",
        tf32_matmul=False,
        cudnn_benchmark=True,
    )
    common = dict(section="image", inputs="uint8 batch from pinned host memory", precision="bf16", iters=20)
    records = [
        dict(
            common,
            what="image encoder + copy",
            batch=256,
            seconds=0.5,
            ms_per_batch=25.0,
            items_per_s=10240.0,
        ),
        dict(common, what="image encoder + copy", batch=1024, error="out of memory: CUDA out of memory"),
    ]
    text = gpu_check.render(env, records, ["training step (CLIP loss, AdamW), fp32, batch 256"])
    rows = [line for line in text.splitlines() if line.startswith("| image encoder")]
    assert len(rows) == 2 and {row.count("|") for row in rows} == {9}
    assert "Backfill rate for the projection: 10,240 images/s per GPU (bf16, batch 256" in text
    assert "Skipped (over the time budget): training step" in text
