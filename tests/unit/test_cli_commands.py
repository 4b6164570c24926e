"""The command line's explicit list of command modules (:data:`pipelines.cli.COMMANDS`) against the
modules in ``pipelines/commands``."""

from __future__ import annotations

import pkgutil

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
