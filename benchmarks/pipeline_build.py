"""How long building the pipeline takes (what ``compatflow run`` and ``compatflow compile`` do before any task
starts), with kfp's caller lookup as kfp ships it and as :mod:`pipelines.kfp_stack` makes it, side by side.

kfp's task setters name their caller with ``inspect.stack()``, whose cost grows with the stack's depth times
the number of modules loaded. Each case runs in a fresh process that loads either kfp and the pipeline only
("small") or also torch, open_clip, Great Expectations, Evidently, Feast and MLflow ("heavy", as a test
session or a long-lived service holds them), then builds the local-runner pipeline under a stack ``--depth``
frames deep. Writes ``benchmarks/results/pipeline_build.md``.

    python benchmarks/pipeline_build.py [--depth 30] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "pipeline_build.md"
HEAVY = ("torch", "open_clip", "great_expectations", "evidently", "feast", "mlflow")

_CASE = """
import importlib, inspect, json, sys, time
heavy, shim = sys.argv[1] == "heavy", sys.argv[2] == "source-free"
depth, repeats = int(sys.argv[3]), int(sys.argv[4])
if heavy:
    for name in {heavy_modules!r}:
        importlib.import_module(name)
from pipelines.compile import build_pipeline
from kfp.dsl import pipeline_task
if not shim:
    pipeline_task.inspect = inspect  # kfp as shipped
def nested(n, f):
    return f() if n == 0 else nested(n - 1, f)
times = []
for _ in range(repeats):
    t0 = time.perf_counter()
    nested(depth, lambda: build_pipeline(runner="local"))
    times.append(time.perf_counter() - t0)
print(json.dumps({{"modules": len(sys.modules), "seconds": min(times)}}))
"""


def run_case(modules: str, lookup: str, depth: int, repeats: int) -> dict:
    code = _CASE.format(heavy_modules=HEAVY)
    done = subprocess.run(
        [sys.executable, "-c", code, modules, lookup, str(depth), str(repeats)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=30, help="frames on the stack under the build")
    parser.add_argument("--repeats", type=int, default=2, help="builds per case (the fastest is reported)")
    args = parser.parse_args(argv)
    rows = []
    for modules in ("small", "heavy"):
        measured = {
            lookup: run_case(modules, lookup, args.depth, args.repeats) for lookup in ("kfp", "source-free")
        }
        base, fixed = measured["kfp"], measured["source-free"]
        rows.append(
            f"| {modules} | {fixed['modules']:,} | {base['seconds']:.1f} | {fixed['seconds']:.1f} | "
            f"{base['seconds'] / fixed['seconds']:.1f}x |"
        )
        print(rows[-1], flush=True)
    table = "\n".join(
        [
            f"Building the local-runner pipeline under a stack {args.depth} frames deep, fastest of "
            f"{args.repeats} builds per case, each case in a fresh process "
            f"(`python benchmarks/pipeline_build.py --depth {args.depth} --repeats {args.repeats}`).",
            "",
            "| modules loaded | modules | kfp's `inspect.stack()` (s) | `inspect.stack(0)` (s) | speed-up |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    RESULTS.write_text(f"# Building the pipeline\n\n{__doc__.split(chr(10) * 2)[1]}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
