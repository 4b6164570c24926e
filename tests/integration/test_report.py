"""The on-call report renders: every plot is an embedded PNG, absent stages say "not run"."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

from components.gate import run_gate
from components.report import render, summary, write_report, write_reports

ROOT = Path(__file__).resolve().parents[2]


def _pair(r1: float) -> dict[str, float]:
    return {"R@1": r1, "R@5": min(r1 + 25, 100), "R@10": min(r1 + 35, 100)}


def make_run(root: Path, *, i2t_new_old: float = 33.0) -> Path:
    """A run directory with every stage's output, as the pipeline lays it out."""
    run = root / "runs" / "run-42"
    retrieval = {
        "t2i": {
            "old/old": _pair(30.0),
            "new/old": _pair(34.5),
            "new/new": _pair(41.0),
            "old/new": _pair(18.0),
        },
        "i2t": {"old/old": _pair(35.0), "new/old": _pair(i2t_new_old), "new/new": _pair(45.0)},
    }
    margins, ecc = {}, {}
    for d, pairs in retrieval.items():
        margins[d] = {}
        ecc[d] = {}
        for m in ("R@1", "R@5", "R@10"):
            margin = pairs["new/old"][m] - pairs["old/old"][m]
            margins[d][m] = {"margin": margin, "ci_low": margin - 1.2, "ci_high": margin + 1.4}
            ecc[d][m] = margin > 0
    report = {
        "schema_version": 1,
        "method": "lambda_orth",
        "scenario": "continual",
        "data_phase": 3,
        "old_model": {"name": "compatflow-clip", "version": "4"},
        "new_model": {"name": "candidate"},
        "retrieval": retrieval,
        "independent_new_new": {"t2i": _pair(42.0), "i2t": _pair(46.0)},
        "eval_sizes": {"images": 800, "captions": 4000, "domains": ["street", "forest"]},
        "margins": margins,
        "ecc": ecc,
        "ecc_passed": all(v for d in ecc.values() for v in d.values()),
    }
    files = {
        "validate/validation.json": {
            "total": 2000,
            "passed": 1968,
            "quarantined": 32,
            "blocked": False,
            "by_reason": {"blank_caption": 20, "corrupt_image": 12},
            "blocked_reasons": [],
        },
        "drift/drift.json": {
            "severity": "medium",
            "html_report": "evidently.html",
            "verdicts": {
                "caption_length": {"drift": False, "score": 0.08, "severity": "none"},
                "image_embedding": {"drift": True, "score": 0.41, "severity": "medium"},
            },
        },
        "continual/metrics.json": {
            "curve": [
                {"step": s, "loss": 4.0 * 0.97**s + 0.3, "kl": 0.5 / (1 + s)} for s in range(0, 300, 10)
            ],
            "domains": {
                "street": {"t2i": {"R@1": 31.0}, "i2t": {"R@1": 36.0}},
                "forest": {"t2i": {"R@1": 29.5}, "i2t": {"R@1": 33.0}},
            },
        },
        "evaluate/compat_report.json": report,
        "rollout/rollout_state.json": {
            "status": "completed",
            "stage": 4,
            "fraction_backfilled": 1.0,
            "curve": [
                {"fraction": f, "t2i_R@1": 34.5 + 6.5 * f, "i2t_R@1": 38.0 + 7 * f}
                for f in (0.0, 0.1, 0.25, 0.5, 1.0)
            ],
        },
    }
    for name, doc in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(json.dumps(doc))
    (run / "drift" / "evidently.html").write_text("<html><body>evidently</body></html>")
    policy = run / "policy.yaml"  # a caption gallery's policy: both directions judged
    policy.write_text("directions: [t2i, i2t]\n")
    run_gate(
        run / "evaluate" / "compat_report.json",
        run / "gate",
        policy=policy,
        validation=run / "validate" / "validation.json",
        drift=run / "drift" / "drift.json",
    )
    return run


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[dict] = []
        self.links: list[str] = []
        self.external: list[str] = []
        self.sections: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs)
        if tag == "a":
            self.links.append(attrs.get("href", ""))
        if tag in {"link", "script"} or (
            tag != "a" and any(str(v).startswith("http") for v in attrs.values())
        ):
            self.external.append(tag)
        if tag == "section":
            self.sections.append(attrs["id"])


def parse(text: str) -> _Collector:
    collector = _Collector()
    collector.feed(text)
    collector.close()
    return collector


def decode_png(src: str) -> Image.Image:
    prefix = "data:image/png;base64,"
    assert src.startswith(prefix)
    raw = base64.b64decode(src[len(prefix) :], validate=True)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    image = Image.open(io.BytesIO(raw))
    image.load()
    return image


def test_full_report_embeds_every_plot(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    out = write_report(run, tmp_path / "out" / "report.html")
    text = out.read_text()
    page = parse(text)
    assert page.sections == ["gate", "validation", "drift", "training", "compat", "margins", "rollout"]
    assert len(page.images) == 4  # training curves, heatmap, margins, backfill
    for img in page.images:
        image = decode_png(img["src"])
        assert image.size[0] > 300 and image.size[1] > 150 and img["alt"]
    assert page.external == []  # self-contained: no stylesheet, script or remote image
    assert "../runs/run-42/drift/evidently.html" in page.links
    # the gate blocked on i2t (new/old 33 < old/old 35) and drift stayed within policy
    assert "Gate: BLOCK" in text and "ecc_margin" in text and "i2t" in text
    assert "not run" not in text
    if shutil.which("chromium") or shutil.which("chromium-browser"):
        _screenshot_if_possible(out, tmp_path / "report.png")


def test_missing_and_unreadable_stages(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "early"
    (run / "validate").mkdir(parents=True)
    (run / "validate" / "validation.json").write_text('{"total": 10, "pass')  # truncated
    (run / "blocked.json").write_text(json.dumps({"step": "validate", "reason": "quarantined 40% > 5%"}))
    text = render(run)
    page = parse(text)
    assert page.images == []
    assert text.count("not run") >= 6 and "unreadable" in text and "Gate: not run" in text
    assert "The run stopped at step validate: quarantined 40% &gt; 5%" in text


def test_markdown_and_both_formats(tmp_path: Path) -> None:
    run = make_run(tmp_path, i2t_new_old=37.5)
    paths = write_reports(run, tmp_path / "report")
    md = paths["md"].read_text()
    assert "## Release gate — pass" in md
    assert "| t2i | new/old | 34.50 | 59.50 | 69.50 |" in md
    assert "[Evidently drift report](../runs/run-42/drift/evidently.html)" in md
    assert "## Rollout and backfill — completed" in md
    assert "|  | t2i R@1 | i2t R@1 |" in md and "| forest | 29.50 | 33.00 |" in md
    assert len(parse(paths["html"].read_text()).images) == 4
    with pytest.raises(ValueError, match="format"):
        render(run, "pdf")


def test_cli_report(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    cmd = [sys.executable, "-m", "pipelines.cli", "report"]
    printed = subprocess.run(
        [*cmd, str(run), "--format", "md"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.startswith("# compatflow run run-42")
    by_id = subprocess.run(
        [*cmd, "run-42", "--workspace", str(tmp_path), "--out", str(tmp_path / "r.html")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert by_id.returncode == 0, by_id.stderr
    assert len(parse((tmp_path / "r.html").read_text()).images) == 4
    bad = subprocess.run(
        [*cmd, "nope", "--workspace", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert bad.returncode == 2 and "neither a directory nor a run" in bad.stderr


def _chromium(html_file: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium on ``html_file`` with ``args`` (skips the test when no browser is installed)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium installed (apt-get install -y chromium)")
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
    cmd += ["--no-first-run", "--hide-scrollbars", *args, html_file.as_uri()]
    # Chromium's singleton socket must fit in a unix socket path: give it a short TMPDIR and profile
    with tempfile.TemporaryDirectory(prefix="cf-", dir="/tmp") as short_tmp:
        env = {**os.environ, "TMPDIR": short_tmp}
        result = subprocess.run(
            [*cmd[:1], f"--user-data-dir={short_tmp}/profile", *cmd[1:]],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def _screenshot_if_possible(html_file: Path, png: Path) -> None:
    """Headless Chromium screenshot of the page; checks it is a real image."""
    _chromium(html_file, "--window-size=1200,3000", f"--screenshot={png}")
    with Image.open(png) as shot:
        assert shot.size == (1200, 3000)
        colours = shot.convert("RGB").resize((60, 150)).getcolors(maxcolors=100000)
        assert colours is not None and len(colours) > 20  # rendered content, not a blank page


def _as_ran(run: Path, outcome: str, *, tracking_uri: str = "") -> Path:
    """``run`` (from :func:`make_run`) completed as the pipeline records a run: plan, step usage, the
    registered candidate v5 (production was v4) and the outcome."""
    workspace = run.parent.parent
    files = {
        "run.json": {"run_id": run.name, "phase": 3, "job_name": "compatflow-continual-upgrade-x"},
        "usage/step-validate.json": {"step": "validate", "at": "2026-11-29T01:00:30+00:00", "wall_s": 30.0},
        "usage/step-rollout.json": {"step": "rollout", "at": "2026-11-29T01:12:05+00:00", "wall_s": 95.0},
        "register/registered.json": {
            "mlflow_run_id": "0123abcd",
            "version": "5",
            "source": f"file://{workspace}/mlartifacts/0123abcd/artifacts/model",
            "model_name": "compatflow-clip",
            "tracking_uri": tracking_uri or f"sqlite:///{workspace}/mlflow.db",
            "tags": {"method": "lambda_orth"},
        },
        "outcome.json": {"status": outcome, "pipeline_state": "SUCCEEDED", "error": None},
    }
    for name, doc in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(json.dumps(doc))
    os.utime(run / "outcome.json", (1795914730, 1795914730))  # 01:12:10 UTC: 12 min 10 s after the start
    (workspace / "models" / "v5").mkdir(parents=True, exist_ok=True)
    return run


def shipped_run(root: Path, **options: str) -> Path:
    """A run whose candidate v5 passed the gate and was rolled out: production and serving v4 -> v5."""
    run = _as_ran(make_run(root, i2t_new_old=37.5), "succeeded", **options)
    state = {"previous_query_model": {"version": "4"}, "query_model": {"version": "5"}, "status": "completed"}
    rollout = {"version": "5", "promoted": True, "rollout": state}
    (run / "rollout" / "rollout.json").write_text(json.dumps(rollout))
    return run


def blocked_run(root: Path) -> Path:
    """A run whose candidate v5 the gate blocked (i2t new/old below old/old): production v4 stays."""
    run = make_run(root)
    (run / "rollout" / "rollout_state.json").unlink()
    reason = {"step": "gate", "reason": "the release gate blocked the candidate"}
    (run / "blocked.json").write_text(json.dumps(reason))
    return _as_ran(run, "rejected")


def _page_text(html_file: Path) -> str:
    """What Chromium shows of the page: its DOM after loading, tags stripped."""
    import re
    from html import unescape

    dom = _chromium(html_file, "--dump-dom").stdout
    assert "<main>" in dom
    return unescape(re.sub(r"<[^>]+>", "", dom))


def _stated_sha256(report: Path, shown: str) -> None:
    """The sha256 the page shows is what its own check command computes over the file."""
    import re

    check = subprocess.run(
        f"grep -v report-sha256 {report} | sha256sum", shell=True, capture_output=True, text=True, check=True
    )
    digest = check.stdout.split()[0]
    assert re.search(rf"report sha256: {digest} \(check: grep -v report-sha256 FILE \| sha256sum", shown)


def test_header_of_a_shipped_and_a_blocked_run_in_chromium(tmp_path: Path) -> None:
    """Opened in headless Chromium, each report's header shows the outcome, run, duration, production and
    serving before and after, links to the MLflow run and model version, its own sha256 (which the stated
    command reproduces) and the command that undoes the run, or, for a blocked run, what to do next."""
    shipped = shipped_run(tmp_path / "a")
    out = write_report(shipped, shipped / "report" / "report.html")
    shown = _page_text(out)
    assert "Outcome: succeeded · Gate: PASS" in shown
    for fact in ("run: run-42", "phase: 3", "duration: 12 min 10 s", "candidate: v5"):
        assert fact in shown
    assert "production: v4 -> v5" in shown and "serving: v4 -> v5" in shown
    assert f"MLflow run 0123abcd artifacts: {tmp_path}/a/mlartifacts/0123abcd/artifacts" in shown
    assert f"model compatflow-clip v5: {tmp_path}/a/models/v5" in shown
    assert "Undo: production v5 back to v4" in shown
    assert f"compatflow rollback --workspace {tmp_path / 'a'}" in shown
    _stated_sha256(out, shown)
    links = parse(out.read_text()).links
    assert "../../../models/v5" in links and "../../../mlartifacts/0123abcd/artifacts" in links
    _screenshot_if_possible(out, tmp_path / "shipped.png")

    blocked = blocked_run(tmp_path / "b")
    out = write_report(blocked, blocked / "report" / "report.html")
    shown = _page_text(out)
    assert "Outcome: rejected · Gate: BLOCK" in shown
    assert "production: v4 (unchanged)" in shown and "serving: v4 (unchanged)" in shown
    assert "Nothing shipped, nothing to undo: production v4 still serves" in shown
    assert "compatflow run --phase 3" in shown and "compatflow rollback" not in shown
    assert "MLflow run 0123abcd" in shown
    _stated_sha256(out, shown)


def test_header_links_to_a_tracking_server_and_markdown_seal(tmp_path: Path) -> None:
    """With an MLflow server the links are its pages; the Markdown report carries its own checkable sha256."""
    import hashlib

    run = shipped_run(tmp_path, tracking_uri="http://mlflow.example:5000/")
    outcome = json.loads((run / "outcome.json").read_text())
    kfp_run = "https://kubeflow.example.com/pipeline/#/runs/details/k-1"  # recorded when it ran on KFP
    (run / "outcome.json").write_text(json.dumps({**outcome, "kfp_run_url": kfp_run}))
    md = render(run, "md")
    assert f"[KFP run]({kfp_run})" in md
    assert "[MLflow run 0123abcd](http://mlflow.example:5000/#/runs/0123abcd)" in md
    assert "(http://mlflow.example:5000/#/models/compatflow-clip/versions/5)" in md
    assert "**Undo: production v5 back to v4" in md and "`compatflow rollback --workspace" in md
    kept = "".join(line + "\n" for line in md.split("\n")[:-1] if "report-sha256" not in line)
    assert f"_report-sha256: {hashlib.sha256(kept.encode()).hexdigest()} (" in md
    assert "next: Undo: production v5 back to v4" in summary(run)


def test_ungated_direction_and_probe_floor(tmp_path: Path) -> None:
    """A gate judging t2i only passes over a failing i2t: the report says the candidate holds the ECC where it
    is judged and labels i2t "measured, not gated"; the rollout section states the probe's own floor."""
    run = make_run(tmp_path)  # i2t new/old 33 < old/old 35: the ECC fails there
    policy = run / "policy.yaml"
    policy.write_text("directions: [t2i]\n")
    run_gate(
        run / "evaluate" / "compat_report.json",
        run / "gate",
        policy=policy,
        validation=run / "validate" / "validation.json",
        drift=run / "drift" / "drift.json",
    )
    state = json.loads((run / "rollout" / "rollout_state.json").read_text())
    state.update(baseline={"R@1": 8.2}, floors={"R@1": 7.4}, probe_tolerance=1.0)
    (run / "rollout" / "rollout_state.json").write_text(json.dumps(state))
    md = render(run, "md")
    assert "## Release gate — pass" in md
    assert "## Compatibility matrix — ECC holds (t2i)" in md and "ECC fails" not in md
    assert "i2t: measured, not gated" in md and "| i2t | R@1 |" in md
    assert "| measured, not gated |" in md
    assert "R@1 7.40 (the probe set's old/old is 8.20, the floor 1.00 standard error(s) below it" in md
    assert len(parse(render(run)).images) == 4


def test_cli_report_prints_path_and_summary(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "report", "--workspace", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "<html" not in out.stdout.lower()
    assert f"report: {run / 'report' / 'report.html'}" in out.stdout
    assert "compatflow run run-42" in out.stdout and "Release gate: block" in out.stdout
    assert "Rollout and backfill: completed" in out.stdout
    assert (run / "report" / "report.md").is_file()


def test_retrieval_examples_show_their_pictures(tmp_path: Path) -> None:
    """examples.json (written by the steps that change what is served) becomes a section: each query with
    its hits' thumbnails in HTML, their captions in Markdown; a hit without a picture says so."""
    from components.serving.thumbnails import thumbnail_uri

    picture = io.BytesIO()
    Image.new("RGB", (640, 480), (200, 30, 30)).save(picture, "PNG")
    hit = {"item_id": "a1", "score": 0.91, "model_version": "2", "caption": "a red circle"}
    examples = {
        "queries": [
            {"text": "a red circle", "hits": [{**hit, "thumbnail": thumbnail_uri(picture.getvalue())}]},
            {"text": "a blue square", "hits": [{**hit, "item_id": "b2", "thumbnail": None}]},
        ]
    }
    run = tmp_path / "run-7"
    (run / "rollout").mkdir(parents=True)
    (run / "rollout" / "examples.json").write_text(json.dumps(examples))

    html = render(run, "html")
    sources = [str(image.get("src", "")) for image in parse(html).images]
    thumbnails = [src for src in sources if src.startswith("data:image/jpeg;base64,")]
    assert len(thumbnails) == 1
    assert Image.open(io.BytesIO(base64.b64decode(thumbnails[0].split(",")[1]))).size == (96, 72)
    assert "Retrieval examples" in html and "1/2 first hits captioned alike" in html and "no picture" in html
    md = render(run, "md")
    assert "| a blue square | a red circle (0.910) |" in md

    (run / "rollout" / "examples.json").write_text(json.dumps({"error": "ServingError: no serving record"}))
    assert "unavailable" in render(run, "md") and "no serving record" in render(run, "md")
