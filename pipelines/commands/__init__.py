"""One module per command group, each with ``register(app)``, listed in :data:`pipelines.cli.COMMANDS`;
module-level imports stay light (heavy libraries are imported inside the commands)."""
