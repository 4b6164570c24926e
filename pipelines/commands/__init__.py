"""One module per command group; each defines ``register(app: typer.Typer) -> None`` and is listed in
:data:`pipelines.cli.COMMANDS` (a new module is added there; ``_*.py`` modules are shared helpers).

Keep module level imports light (typer, stdlib): import heavy libraries inside the
command functions."""
