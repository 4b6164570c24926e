"""The command line's explicit list of command modules (:data:`pipelines.cli.COMMANDS`) against the
modules in ``pipelines/commands``; every help page as a terminal shows it."""

from __future__ import annotations

import pkgutil
import re

import typer.main
from typer.testing import CliRunner

from pipelines import cli, commands


def test_every_command_module_is_listed_once_and_registers_itself():
    # walked here on purpose: the command line itself never walks the folder
    on_disk = {
        info.name
        for info in pkgutil.iter_modules(commands.__path__, f"{commands.__name__}.")
        if not info.name.rpartition(".")[2].startswith("_")
    }
    listed = [module.__name__ for module in cli.COMMANDS]
    assert len(set(listed)) == len(listed), "a command module is listed twice in COMMANDS"
    assert on_disk - set(listed) == set(), "command modules missing from pipelines.cli.COMMANDS"
    assert set(listed) - on_disk == set(), "COMMANDS lists modules that are not in pipelines/commands"
    for module in cli.COMMANDS:
        assert callable(getattr(module, "register", None)), f"{module.__name__} has no register(app)"


MARKUP = re.compile(r"``|`[^`\s][^`]*`|\*\*\S|:(?:mod|class|func|meth|attr|data):")


def _commands(command, path=()):
    """Every command under ``command`` with its words, depth first."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_every_help_page_is_plain_text_and_lists_its_exit_codes():
    runner = CliRunner()
    pages = list(_commands(typer.main.get_command(cli.app)))
    assert len(pages) > 30
    for path, command in pages:
        page = runner.invoke(cli.app, [*path, "--help"], terminal_width=100)
        words = " ".join(("compatflow", *path))
        assert page.exit_code == 0, f"{words} --help: {page.output}"
        assert not MARKUP.search(page.output), f"{words} --help shows markup: {MARKUP.search(page.output)[0]}"
        if getattr(command, "commands", None) is not None:
            continue  # a group: its commands declare their codes
        codes = getattr(command.callback, "exit_codes", None)
        assert codes is not None, f"{words}: declare its exit codes (pipelines.commands._common.exit_codes)"
        if set(codes) - {0, 1}:
            part = page.output.split("Exit codes:", 1)
            assert len(part) == 2, f"{words} --help has no 'Exit codes:' part"
            for code, meaning in codes.items():
                assert f"{code}  {meaning}" in part[1], f"{words} --help: exit code {code} not listed"
