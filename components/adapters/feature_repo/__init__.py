"""Feast feature repository of gallery-item lineage (``feature_store.yaml`` + ``items.py``).

:class:`components.adapters.lineage.LineageStore` copies these two files into a workspace's ``feast/``
directory; there ``feast apply`` / ``feast feature-views list`` work as in any Feast repo.
Paths in ``feature_store.yaml`` are relative to the repo directory it is copied to.
"""

from pathlib import Path

REPO_TEMPLATE_DIR = Path(__file__).resolve().parent
REPO_FILES = ("feature_store.yaml", "items.py")
