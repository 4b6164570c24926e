"""Results of the benchmark scripts: :func:`publish` writes a script's own file; a file shared by several
scripts gives each one marked section; :func:`sizes_parser` and :func:`print_records` serve the scripts timed
at gallery sizes on either Milvus backend.

A section lies between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``; :func:`write_section` replaces
that section only (or appends it when the file has none), so running one script keeps what the others wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Any


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


def results_head(title: str, command: str, machine_note: str) -> list[str]:
    """The first lines of a results file: ``# title``, the command that wrote it and the machine it ran on
    (platform, CPUs, Python, load average at the end), that line ending with ``machine_note``."""
    load = " / ".join(f"{v:.1f}" for v in os.getloadavg()[:2])
    return [
        f"# {title}",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"shared with other work (load average {load} at the end){machine_note}  ",
    ]


def sizes_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a script timed at gallery sizes on either Milvus backend: --sizes, --backend, --json."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--backend", choices=("lite", "standalone"), default="standalone")
    parser.add_argument("--json", type=Path, help="Write the records here.")
    return parser


def print_records(table: str, records: list[dict[str, Any]], json_path: Path | None) -> None:
    """Print a script's ``table``; write its ``records`` as JSON to ``json_path`` when one is given."""
    print(table)
    if json_path:
        json_path.write_text(json.dumps(records, indent=1))
