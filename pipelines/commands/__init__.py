"""One module per command group; each defines ``register(app: typer.Typer) -> None``.

Keep module level imports light (typer, stdlib): import heavy libraries inside the
command functions.
"""
