"""Policies shipped with compatflow (package data): ``gate_default.yaml`` is the release gate's default."""
