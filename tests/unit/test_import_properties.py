"""Generated sources for each import reader (sidecar folders, tables, Karpathy split files): an import ends
with a report in which every file left out has a known reason and a message, or is refused as a whole with
a :class:`DataImportError` naming the source; never a traceback."""

from __future__ import annotations

import csv
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from compat.data.importer import DataImportError, ImportSettings, import_images
from schemas import schema_errors

# An example is a whole import (a few milliseconds of files and fsyncs): half the profile's examples each.
_HALF = settings(max_examples=max(1, settings.default.max_examples // 2))
_BIG = "<a 5,000-digit integer>"  # written into the JSON as one (hypothesis cannot show such an int)
_TEXT = st.text(max_size=40) | st.sampled_from(["", "  ", "a\x00b", "\ud800", "caption", "x" * 70_000])
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.just(_BIG)
    | st.floats()
    | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=8,
)
_PATHS = st.sampled_from(["0.png", "1.png", "missing.png", "../0.png", "/dev/null", "sub", ""]) | _TEXT


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where each example makes its source: a fresh folder per example, under one module folder."""
    return tmp_path_factory.mktemp("sources")


def _source(pictures: Path) -> Path:
    src = Path(tempfile.mkdtemp(dir=pictures))
    Image.new("RGB", (20, 20), "red").save(src / "0.png")
    Image.new("RGB", (20, 20), "blue").save(src / "1.png")
    (src / "sub").mkdir()
    return src


def _imported(src: Path, fmt: str) -> None:
    """Import ``src``; the report is schema-valid: every refusal carries a known reason and a message."""
    try:
        result = import_images(src, src.parent / f"{src.name}-out", ImportSettings(source_format=fmt))
    except DataImportError as err:  # the source refused as a whole: it is named
        assert src.name in str(err)
        return
    assert schema_errors(result.report, "stream_import") == []


def _dump(value: Any) -> str:
    return json.dumps(value, allow_nan=True).replace(f'"{_BIG}"', "9" * 5000)


@_HALF
@given(
    entries=st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "filename": _PATHS | _JSON,
                "filepath": st.sampled_from(["", ".", "sub"]) | _JSON,
                "split": st.sampled_from(["train", "restval", "val", "test"]) | _JSON,
                "sentences": st.lists(st.fixed_dictionaries({"raw": _TEXT}) | _JSON, max_size=4) | _JSON,
                "imgid": _JSON,
            },
        )
        | _JSON,
        max_size=4,
    ),
    wrapper=st.sampled_from(['{"images": %s}', '{"dataset": 1, "images": %s, "x": []}', "%s", '{"i": %s}']),
)
def test_any_karpathy_file_imports_or_is_refused_by_name(pictures: Path, entries: list, wrapper: str) -> None:
    src = _source(pictures)
    (src / "dataset.json").write_text(wrapper.replace("%s", _dump(entries)))
    _imported(src / "dataset.json", "karpathy")


@_HALF
@given(
    rows=st.lists(st.tuples(_PATHS, _TEXT, _TEXT), max_size=5),
    header=st.sampled_from(
        [("path", "caption", "extra"), ("path", "caption", "source"), ("file", "text", "x")]
    ),
)
def test_any_table_imports_or_is_refused_by_name(pictures: Path, rows: list, header: tuple) -> None:
    src = _source(pictures)
    with open(src / "pairs.csv", "w", newline="", encoding="utf-8", errors="surrogatepass") as f:
        csv.writer(f).writerows([header, *rows])
    _imported(src / "pairs.csv", "table")


@_HALF
@given(
    captions=st.lists(
        st.binary(max_size=60) | _TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")), max_size=2
    ),
    metadata=st.lists(st.binary(max_size=60) | _JSON.map(lambda v: _dump(v).encode()), max_size=3),
)
def test_any_sidecar_folder_imports(pictures: Path, captions: list[bytes], metadata: list[bytes]) -> None:
    src = _source(pictures)
    for n, data in enumerate(captions):
        (src / f"{n}.txt").write_bytes(data)
    for n, data in enumerate(metadata):
        (src / f"{n}.json").write_bytes(data)
    _imported(src, "sidecar")
