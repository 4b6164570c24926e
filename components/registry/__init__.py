"""Names kept for files written by earlier releases; the registry itself is
:mod:`components.adapters.registry`."""
