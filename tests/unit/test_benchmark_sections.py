"""Benchmark scripts that share a results file each replace their own marked section and keep the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.sections import markers, write_section

ROOT = Path(__file__).resolve().parents[2]


def test_a_section_is_replaced_and_everything_else_kept(tmp_path: Path) -> None:
    path = tmp_path / "results.md"
    write_section(path, "first", "## First\n\nold figures", "Results")
    write_section(path, "second", "## Second\n\nfigures", "Results")
    path.write_text(path.read_text() + "\nA note written by hand.\n")
    write_section(path, "first", "## First\n\nnew figures", "Results")
    text = path.read_text()
    assert text.startswith("# Results\n") and "old figures" not in text
    assert text.index("new figures") < text.index("## Second") < text.index("A note written by hand.")
    assert all(text.count(m) == 1 for name in ("first", "second") for m in markers(name))


def test_broken_markers_are_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "results.md"
    begin, _ = markers("first")
    path.write_text(f"# Results\n\n{begin}\nhalf a section\n")
    with pytest.raises(ValueError, match="results.md"):
        write_section(path, "first", "figures", "Results")


@pytest.mark.parametrize(
    ("results", "sections"),
    [("loader.md", ("loader", "large-images")), ("data_import.md", ("data-import", "import-resize"))],
)
def test_shared_results_files_hold_each_scripts_section_once(results: str, sections: tuple[str, ...]) -> None:
    text = (ROOT / "benchmarks" / "results" / results).read_text()
    assert all(text.count(m) == 1 for name in sections for m in markers(name))
