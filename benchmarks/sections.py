"""Results files of the benchmark scripts: :func:`publish` writes a script's own file; a file shared by
several scripts gives each one marked section.

A section lies between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``; :func:`write_section` replaces
that section only (or appends it when the file has none), so running one script keeps what the others wrote.
"""

from __future__ import annotations

from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    """The begin and end lines of section ``name``."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_section(path: Path, name: str, body: str, title: str) -> str:
    """Write ``body`` as section ``name`` of ``path`` and return the section; every other line of the file is
    kept. A new file starts with ``# title``. Raises ``ValueError`` when the file's markers are broken."""
    begin, end = markers(name)
    section = f"{begin}\n{body.strip()}\n{end}\n"
    text = path.read_text() if path.exists() else f"# {title}\n"
    if text.count(begin) != text.count(end) or text.count(begin) > 1:
        raise ValueError(f"{path}: section {name!r} must have one {begin} and one {end} line; fix the file")
    if begin in text:
        head, rest = text.split(begin, 1)
        if end not in rest:
            raise ValueError(f"{path}: {end} comes before {begin}; fix the file")
        tail = rest.split(end, 1)[1].lstrip("\n")
        text = head + section + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return section


def publish(path: Path, lines: list[str]) -> None:
    """Write ``lines`` as the results file ``path`` (its folder made when missing) and print them."""
    text = "\n".join(lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
