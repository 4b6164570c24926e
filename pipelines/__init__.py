"""The continual-upgrade pipeline: its KFP definition, local runner, configs and the CLI."""
