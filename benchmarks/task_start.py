"""What a local run spends outside its steps' work: tasks forked from the warm task host
(:mod:`pipelines.warm_tasks`) against a fresh Python per task (``COMPATFLOW_WARM_TASKS=0``, the code before),
in the same run of this script.

Two measures, each mode on its own workspace over one shared, pre-generated stream:

- **A task's start**: a process that imports what a step imports (``components.steps`` and the libraries of
  :data:`pipelines.warm_tasks.PRELOAD`) and exits, started plain and through a warm host (median of
  ``--starts``).
- **Runs**: ``compatflow run`` as a user types it, the first run of a workspace (the bootstrap) and the
  upgrades after it, for each of ``--sizes``: ``shipped`` (``pipelines/configs/local.yaml``, what
  ``make run`` runs) and ``small`` (the end-to-end tests' sizes). Per run: wall, the steps' own wall (their
  usage records, lazy imports included), and each step's wall.

    .venv/bin/python benchmarks/task_start.py [--sizes shipped small] [--runs 2 1] [--starts 5]

Writes benchmarks/results/task_start.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT = ROOT / "benchmarks" / "results" / "task_start.md"
MODES = {"fresh process per task (before)": "0", "warm task host": "1"}
PROBE = "import sys, importlib\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"


def small(config: dict[str, Any]) -> None:
    """The end-to-end tests' sizes (tests/_pipelines.local_config)."""
    config["stream"].update(phases=3, samples_per_phase=160, eval_per_domain=20, gallery_per_domain=40)
    config["drift"]["sample_size"] = 80
    config["training"].update(steps=6, batch_size=16, replay_buffer_size=40, replay_rows=4)
    config["compat"].update(steps=6, batch_size=16)


def task_start(work: Path, starts: int) -> dict[str, float]:
    """Median seconds from launch to exit of a process importing every preloaded module, per mode."""
    from pipelines.warm_tasks import PRELOAD, warm_task_host

    (work / "probe").mkdir()
    (work / "probe" / "import_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(work / "probe")}
    argv = ["-m", "import_probe", *PRELOAD]
    times = {}
    plain = []
    for _ in range(starts):
        start = time.perf_counter()
        subprocess.run([sys.executable, *argv], env=env, check=True, capture_output=True)
        plain.append(time.perf_counter() - start)
    times["fresh process per task (before)"] = statistics.median(plain)
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    try:
        with warm_task_host(work / "host") as launcher:
            ready = work / "host" / "host.log"
            while "preloaded in" not in (ready.read_text() if ready.exists() else ""):
                time.sleep(0.1)
            served = {**os.environ}  # now with the host's socket
            warm = []
            for _ in range(starts):
                start = time.perf_counter()
                subprocess.run([str(launcher), *argv], env=served, check=True, capture_output=True)
                warm.append(time.perf_counter() - start)
    finally:
        os.environ.pop("PYTHONPATH", None)
    times["warm task host"] = statistics.median(warm)
    if "task " not in ready.read_text():
        raise SystemExit(f"the warm host served no task: {ready.read_text()[-2000:]}")
    return times


def runs(work: Path, config: dict[str, Any], count: int) -> dict[str, list[dict[str, Any]]]:
    from pipelines.config import resolve
    from pipelines.local_runner import ensure_stream

    stream = work / "stream"
    config["stream"]["uri"] = str(stream)
    ensure_stream(resolve({**config, "workspace": str(work / "generate")}))
    results: dict[str, list[dict[str, Any]]] = {}
    for mode, flag in MODES.items():
        workspace = work / f"ws-{flag}"
        config_file = work / f"config-{flag}.yaml"
        config_file.write_text(yaml.safe_dump({**config, "workspace": str(workspace)}))
        env = {**os.environ, "COMPATFLOW_WARM_TASKS": flag}
        results[mode] = []
        for _ in range(count):
            start = time.perf_counter()
            done = subprocess.run(
                [str(Path(sys.executable).with_name("compatflow")), "run", "--config", str(config_file)],
                env=env,
                capture_output=True,
                text=True,
            )
            wall = time.perf_counter() - start
            if done.returncode not in (0, 3):  # succeeded or rejected, blocked (a full run all the same)
                tail = done.stdout[-2000:] + done.stderr[-2000:]
                raise SystemExit(f"compatflow run failed ({mode}):\n{tail}")
            run_dir = max((workspace / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
            steps = {
                f.stem.removeprefix("step-"): json.loads(f.read_text())["wall_s"]
                for f in sorted((run_dir / "usage").glob("step-*.json"))
            }
            results[mode].append({"run": run_dir.name, "wall": wall, "steps": steps})
            print(f"{mode}: {run_dir.name} {wall:.1f} s, steps {sum(steps.values()):.1f} s", flush=True)
    return results


def table(starts: dict[str, float], measured: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    before, after = MODES
    lines = [
        "# What a local run spends outside its steps' work",
        "",
        f"`benchmarks/task_start.py` on {platform.node()} ({os.cpu_count()} cores), "
        f"{time.strftime('%Y-%m-%d')}. Same machine, same run, each mode on its own workspace over one "
        "stream.",
        "",
        "## A task's start (import every preloaded module, exit)",
        "",
        "| mode | median s |",
        "|---|---|",
        *(f"| {mode} | {seconds:.2f} |" for mode, seconds in starts.items()),
    ]
    for size, results in measured.items():
        lines += [
            "",
            f"## Runs at the {size} sizes (`compatflow run`, one after the other on one workspace)",
            "",
            "| run | before: wall s | before: steps s | warm: wall s | warm: steps s "
            "| outside steps s, before -> warm |",
            "|---|---|---|---|---|---|",
        ]
        pairs = list(enumerate(zip(results[before], results[after], strict=True)))
        for i, (b, a) in pairs:
            b_steps, a_steps = sum(b["steps"].values()), sum(a["steps"].values())
            kind = "bootstrap" if i == 0 else "upgrade"
            lines.append(
                f"| {i} ({kind}) | {b['wall']:.1f} | {b_steps:.1f} | {a['wall']:.1f} |"
                f" {a_steps:.1f} | {b['wall'] - b_steps:.1f} -> {a['wall'] - a_steps:.1f} |"
            )
        for i, (b, a) in pairs:
            lines += ["", f"### {size}, run {i}: each step's wall s (its usage record), before -> warm", ""]
            lines += ["| step | before | warm |", "|---|---|---|"]
            for step in b["steps"]:
                lines.append(
                    f"| {step} | {b['steps'][step]:.2f} | {a['steps'].get(step, float('nan')):.2f} |"
                )
    lines += [
        "",
        "A step's wall holds its own lazy imports; 'outside steps' is kfp.local, the task processes' start "
        "and their imports before the step. The warm host's preloads run beside the first tasks.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=("shipped", "small"), default=["shipped", "small"])
    parser.add_argument("--runs", nargs="+", type=int, default=[2, 2], help="runs per size, in order")
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--out", default=str(RESULT))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="task-start-"))
    measured = {}
    try:
        starts = task_start(work, args.starts)
        print(starts, flush=True)
        for size, count in zip(args.sizes, args.runs, strict=True):
            config = yaml.safe_load((ROOT / "pipelines" / "configs" / "local.yaml").read_text())
            if size == "small":
                small(config)
            (work / size).mkdir()
            measured[size] = runs(work / size, config, count)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(table(starts, measured))
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
