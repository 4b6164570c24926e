"""The on-call report of one pipeline run: why a model shipped or was blocked, on one page (``html``,
self-contained, or ``md``), and ``summary``, plain text for a terminal. Each report carries its own sha256
over every line but the one that shows it."""

from __future__ import annotations

from pathlib import Path

FORMATS = ("html", "md")


def render(run_dir: str | Path, fmt: str = "html", *, link_base: str | Path | None = None) -> str:
    """The report of the run in ``run_dir``; links are relative to ``link_base`` (default: the run dir)."""
    from components.report import header, renderers, sections
    from components.report import inputs as run_inputs

    if fmt not in FORMATS:
        raise ValueError(f"unknown report format {fmt!r}: use one of {', '.join(FORMATS)}")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    loaded = run_inputs.load(run_dir)
    base = Path(link_base).resolve() if link_base else loaded.run_dir
    body = sections.build(loaded, base)
    title = f"compatflow run {loaded.run_id}"
    writer = renderers.html if fmt == "html" else renderers.markdown
    return header.seal(writer(title, header.build(loaded, base), body))


def write_report(run_dir: str | Path, out: str | Path, fmt: str | None = None) -> Path:
    """Write the report to ``out`` (format from ``fmt`` or the file suffix); links relative to ``out``."""
    out = Path(out)
    fmt = fmt or ("md" if out.suffix.lower() in {".md", ".markdown"} else "html")
    out.parent.mkdir(parents=True, exist_ok=True)
    text = render(run_dir, fmt, link_base=out.parent)
    from compat.io import atomic_write

    return atomic_write(out, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_reports(run_dir: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """``report.html`` and ``report.md`` of the run, written into ``out_dir``."""
    from components.state.run_dir import report_file_name

    out_dir = Path(out_dir)
    return {fmt: write_report(run_dir, out_dir / report_file_name(fmt), fmt) for fmt in FORMATS}


def summary(run_dir: str | Path) -> str:
    """Plain text for a terminal: the key facts, then each section's status and its first warnings."""
    from components.report import header, sections
    from components.report import inputs as run_inputs

    loaded = run_inputs.load(Path(run_dir))
    head = header.build(loaded, loaded.run_dir)
    lines = [f"compatflow run {loaded.run_id}"]
    lines += [f"  {label}: {value}" for label, value in head.facts if label != "run"]
    lines.append(f"  next: {head.next}" + (f" {head.command}" if head.command else ""))
    for section in sections.build(loaded):
        lines.append(f"{section.title}: {section.status}")
        notes = [i for i in section.items if isinstance(i, sections.Note) and i.tone in ("bad", "warn")]
        lines += [f"  {note.text}" for note in notes[:3]]
    return "\n".join(lines) + "\n"
