"""The ``compatflow`` command line: the root options, then each module of :data:`COMMANDS` registered."""

from __future__ import annotations

import logging
import os
import sys

import typer

import pipelines.commands.adopt
import pipelines.commands.compat
import pipelines.commands.data
import pipelines.commands.drift
import pipelines.commands.evaluate
import pipelines.commands.gate
import pipelines.commands.index
import pipelines.commands.lineage
import pipelines.commands.models
import pipelines.commands.pipeline
import pipelines.commands.registry
import pipelines.commands.report
import pipelines.commands.rollout
import pipelines.commands.run
import pipelines.commands.serve
import pipelines.commands.state
import pipelines.commands.stream
import pipelines.commands.train
import pipelines.commands.validate

app = typer.Typer(
    name="compatflow",
    help="Continual, backward-compatible upgrades of CLIP-style embedding models for production retrieval.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: paragraphs wrapped to the terminal, no boxes or markup
)

OFFLINE_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "GX_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
}

NOISY_LOGGERS = ("faiss", "milvus_lite")
PROGRESS_LOGGER = "compat.progress"


def _print_version(value: bool) -> None:
    """``--version``: print the installed compatflow version and exit."""
    from importlib.metadata import PackageNotFoundError, version

    if not value:
        return
    try:
        installed = version("compatflow")
    except PackageNotFoundError:  # run from a source tree that is not installed
        from compat import __version__ as installed
    typer.echo(f"compatflow {installed}")
    raise typer.Exit()


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at each record, so log lines go above live progress bars
    (rich redirects stderr while it draws them) instead of through them."""

    stream = property(lambda _self: sys.stderr, lambda _self, _value: None)  # type: ignore[assignment]


@app.callback()
def _root(
    verbose: int = typer.Option(
        0,
        "--verbose",
        "-v",
        count=True,
        show_default=False,
        help="Log what each step does too (-vv: debug messages); by default only warnings and errors.",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars or progress lines either."),
    _version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    from compat.progress import MODE_ENV

    for key, value in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if quiet:
        os.environ[MODE_ENV] = "quiet"  # task subprocesses inherit it
    level = logging.WARNING if quiet or not verbose else logging.INFO if verbose == 1 else logging.DEBUG
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    logging.basicConfig(level=level, handlers=[handler])
    if not quiet:  # progress lines (when stderr is no terminal) are INFO records of their own logger
        logging.getLogger(PROGRESS_LOGGER).setLevel(min(level, logging.INFO))
    if verbose < 2:  # libraries' start-up chatter (which faiss build loaded, milvus-lite's port) is debug
        for name in NOISY_LOGGERS:
            logging.getLogger(name).setLevel(max(level, logging.WARNING))


COMMANDS = (  # the command modules, each with ``register(app)``, registered in this order
    pipelines.commands.adopt,
    pipelines.commands.compat,
    pipelines.commands.data,
    pipelines.commands.drift,
    pipelines.commands.evaluate,
    pipelines.commands.gate,
    pipelines.commands.index,
    pipelines.commands.lineage,
    pipelines.commands.models,
    pipelines.commands.pipeline,
    pipelines.commands.registry,
    pipelines.commands.report,
    pipelines.commands.rollout,
    pipelines.commands.run,
    pipelines.commands.serve,
    pipelines.commands.state,
    pipelines.commands.stream,
    pipelines.commands.train,
    pipelines.commands.validate,
)


for _module in COMMANDS:
    _module.register(app)


def main() -> None:
    from compat import _torchvision_fix

    _torchvision_fix.install()  # where the program starts (a no-op when the .pth start-up hook already did)
    app()


if __name__ == "__main__":
    main()
