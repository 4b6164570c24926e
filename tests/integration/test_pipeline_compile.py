"""The KFP pipeline: compiled YAML is current, and a real kfp.local run goes through the stages."""

import subprocess
import sys

import pytest
import yaml

from pipelines.compile import COMPILED_DIR, COMPILED_NAME


def test_compiled_pipeline_is_current(tmp_path):
    # `compatflow compile` as a user runs it, in a process of its own (8 s here); compiled inside the full
    # test session, which holds thousands of modules, it took 102 s (tests/durations.json before this).
    argv = [sys.executable, "-m", "pipelines.cli", "compile", "--out", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    fresh = (tmp_path / COMPILED_NAME).read_text()
    committed = COMPILED_DIR / COMPILED_NAME
    assert committed.is_file(), "run `compatflow compile` and commit pipelines/compiled/"
    assert fresh == committed.read_text(), (
        "pipelines/compiled/continual_upgrade.yaml is stale: run `compatflow compile` and commit it"
    )


def test_compiled_pipeline_gates_downstream_stages():
    spec = next(yaml.safe_load_all((COMPILED_DIR / COMPILED_NAME).read_text()))  # then the platform spec
    dags = [spec["root"]["dag"]] + [c["dag"] for c in spec["components"].values() if "dag" in c]
    tasks = {task["taskInfo"]["name"]: task for dag in dags for task in dag["tasks"].values()}

    def inner(component: str) -> set[str]:
        """Names of the tasks in a branch's DAG, through the groups an If/Else pair compiles to."""
        names = set()
        for task in spec["components"][component]["dag"]["tasks"].values():
            name = task["taskInfo"]["name"]
            names |= inner(task["componentRef"]["name"]) if name.startswith("condition-branches-") else {name}
        return names

    def guarded(branch: str, by: str, otherwise: bool = False) -> set[str]:
        """Names of the tasks inside the ``dsl.If`` (``otherwise``: ``dsl.Else``) branch, checking what
        its condition reads."""
        condition = tasks[branch].get("triggerPolicy", {}).get("condition", "")
        assert by in condition and condition.startswith("!(") == otherwise, f"{by} must guard {branch}"
        return inner(tasks[branch]["componentRef"]["name"])

    assert {"drift-op", "continual-op", "first-model", "upgrade"} <= guarded(
        "phase-valid", "validate-op-Output", otherwise=True
    )
    stages = {f"backfill-stage-{j}" for j in (1, 2, 3, 4)}  # the cluster config's four fractions
    ranges = {"rollout-ranges-op", *(f"rollout-ranges-op-{j}" for j in (2, 3, 4, 5))}
    assert guarded("gate-passed", "gate-op-Output") == {"rollout-op", *stages, *ranges}
    assert "ingest-op" in guarded("upgrade", "resolve-production-op-Output", otherwise=True)
    assert guarded("gate-blocked", "gate-op-Output", otherwise=True) == {"note-blocked-op-2"}
    assert guarded("first-model", "resolve-production-op-Output") == {"register-op", "serve-first-model-op"}
    assert guarded("phase-blocked", "validate-op-Output") == {"note-blocked-op"}


def test_local_runner_takes_the_else_branch(tmp_path):
    """kfp.local runs exactly one branch of a ``dsl.If``/``dsl.Else`` pair (the pipeline's three pairs)."""
    from kfp import dsl, local

    @dsl.component
    def verdict(passes: bool) -> str:
        return "pass" if passes else "block"

    @dsl.component
    def mark(path: str, name: str) -> None:
        import pathlib

        pathlib.Path(path, name).write_text(name)

    @dsl.pipeline
    def branches(path: str, passes: bool):
        decision = verdict(passes=passes)
        with dsl.If(decision.output == "pass", name="gate-passed"):
            mark(path=path, name="passed")
        with dsl.Else(name="gate-blocked"):
            mark(path=path, name="blocked")

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    for passes, taken in ((True, "passed"), (False, "blocked")):
        out = tmp_path / taken
        out.mkdir()
        branches(path=str(out), passes=passes)
        assert [p.name for p in out.iterdir()] == [taken]


def test_compile_pins_the_images_by_digest_and_submit_refuses_a_tag(tmp_path):
    """``compile --digest`` writes REGISTRY/NAME:TAG@sha256:... into every task; the committed package (tags
    only) is refused for a cluster, naming the images and the option; a malformed digest is refused."""
    from pipelines.submit import SubmitError, check_images, load_package

    cpu, gpu = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    argv = [sys.executable, "-m", "pipelines.cli", "compile", "--out", str(tmp_path)]
    done = subprocess.run(
        [*argv, "--digest", f"cpu={cpu}", "--digest", f"gpu={gpu}"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    package = load_package(tmp_path / COMPILED_NAME)
    assert set(package.images) == {
        f"ghcr.io/compatflow/compatflow-cpu:0.1.0@{cpu}",
        f"ghcr.io/compatflow/compatflow-cuda:0.1.0@{gpu}",
    }
    check_images(package)
    with pytest.raises(SubmitError, match=r"compatflow-cpu:0.1.0.* by tag only.*--digest cpu=sha256:"):
        check_images(load_package(COMPILED_DIR / COMPILED_NAME))
    bad = subprocess.run([*argv, "--digest", "cpu=sha256:short"], capture_output=True, text=True, timeout=240)
    assert bad.returncode == 2 and "give cpu=sha256:<64 hex>" in bad.stderr
