"""Small file helpers shared across stages: atomic JSON writes and content hashes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path | str, document: Any) -> Path:
    """Write ``document`` as indented JSON via a temporary file and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path
