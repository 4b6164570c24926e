"""Import captioned images into img2dataset-layout shards split train / eval / gallery.

Sources, output layout, stored formats and the refusal reasons (the ``reason`` enum of
``schemas/stream_import.schema.json``) are described under `compatflow data import` in README.md. Each
picture is decoded once, during the scan (a converted one waits in ``DIR/.import-spool/``); the plan's
digest is stored before the first shard and shards are written atomically, so a killed import started
again writes only the missing shards.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import hashlib
import io
import json
import logging
import math
import os
import re
import shutil
import stat
import time
from collections import Counter
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from compat.data import shards as shard_io  # shard_io.write_shard: a kill test patches it
from compat.data.images import MAX_PIXELS, ImageDecodeError, ImageTooLargeError, decode_rgb, read_header
from compat.io import read_json, write_json_atomic
from compat.progress import track

log = logging.getLogger(__name__)

FORMAT = "compatflow-import"
VERSION = 1
REPORT = "import.json"
PENDING = ".import-pending.json"
LOCK = ".import.lock"  # held by the import writing into the folder (released by the OS when it dies)
SPLITS = ("train", "eval", "gallery")
SOURCE_FORMATS = ("sidecar", "class-folders", "table", "karpathy")
# A Karpathy split file's splits: restval (COCO's 30k validation pictures outside val and test) trains;
# test is the split the retrieval literature reports recall on, so it is evaluated on here.
KARPATHY_SPLITS = {"train": "train", "restval": "train", "test": "eval", "val": "gallery"}
KEY_HEX = 20
MAX_SIDECAR_BYTES = 1024 * 1024  # a metadata file (the validation policy's max_metadata_bytes)
MAX_CAPTION_BYTES = 64 * 1024  # one caption, UTF-8; also the validation policy's max_caption_bytes
MAX_CAPTIONS = 1000  # distinct captions of one picture (COCO and Flickr30k have five)
MAX_INT_DIGITS = 19  # an integer in a metadata document (a Karpathy entry's imgid, a .json sidecar): 64 bits
# The most pixels a picture's header may declare for the import to decode it (to resize it): Pillow's
# decompression-bomb limit (2 x PIL.Image.MAX_IMAGE_PIXELS), above which PIL refuses to open it at all.
MAX_DECODE_PIXELS = 178_956_970
CAPTION_EXT, METADATA_EXT = ".txt", ".json"
KEPT_FORMATS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp"}  # what the pipeline decodes
RESIZE_MODES = ("keep_ratio", "center_crop", "border", "no")  # img2dataset's --resize_mode names
ORIGINALS = "originals"  # the folder of --keep-originals shards
SPOOL = ".import-spool"  # pictures stored resized or converted, from the scan until their shard is written
_KEY_PREFIX = re.compile(r"^[A-Za-z0-9_-]*$")
# Fields the importer writes into every {key}.json; a table's extra column may not reuse one.
RESERVED_FIELDS = tuple(
    "key caption captions source width height original_width original_height mode format sha256 "
    "source_sha256 source_row status split label source_meta resize".split()
)


class DataImportError(ValueError):
    """The import cannot run: bad source, settings or output directory; the message says what to do."""


class _Refused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


@dataclass(frozen=True)
class ImportSettings:
    """What decides the output bytes besides the source files."""

    source_format: str = "sidecar"
    template: str = "a photo of a {label}"
    split: tuple[float, float, float] = (0.8, 0.1, 0.1)
    seed: int = 0
    samples_per_shard: int = 1000
    key_prefix: str = ""
    max_image_bytes: int = 32 * 1024 * 1024  # the validation policy's default max_image_bytes
    path_column: str = "path"
    caption_column: str = "caption"
    # 2x the largest model input of the shipped configs (224 px, pipelines/configs/cluster.yaml) and room for
    # a bigger one; a 12-megapixel photo is stored as 768 x 512.
    max_side: int = 512
    resize_mode: str = "keep_ratio"
    keep_originals: bool = False
    max_pixels: int = MAX_DECODE_PIXELS

    def check(self) -> None:
        """Raise :class:`DataImportError` naming the setting that is wrong."""
        if self.source_format not in SOURCE_FORMATS:
            raise DataImportError(
                f"--format must be one of {', '.join(SOURCE_FORMATS)}, got {self.source_format!r}"
            )
        if self.source_format == "class-folders":
            try:
                self.template.format(label="x")
            except (KeyError, IndexError, ValueError) as exc:
                raise DataImportError(
                    f"--template {self.template!r} is not a caption template ({exc}): "
                    "use {label} as its only field"
                ) from exc
            if "{label}" not in self.template:
                raise DataImportError(f"--template {self.template!r} must contain {{label}}")
        split = self.split
        if len(split) != 3 or not all(0 <= f < math.inf for f in split) or abs(sum(split) - 1) > 1e-6:
            raise DataImportError(
                f"--split {','.join(str(f) for f in split)} must be three non-negative fractions "
                "(train,eval,gallery) summing to 1, e.g. 0.8,0.1,0.1"
            )
        if self.samples_per_shard < 1:
            raise DataImportError(f"--samples-per-shard must be at least 1, got {self.samples_per_shard}")
        if not _KEY_PREFIX.match(self.key_prefix) or len(self.key_prefix) > 64:
            raise DataImportError(
                f"--key-prefix {self.key_prefix!r} may hold only letters, digits, '_' and '-' (64 at most)"
            )
        if self.resize_mode not in RESIZE_MODES:
            raise DataImportError(
                f"--resize-mode must be one of {', '.join(RESIZE_MODES)} (img2dataset's names), "
                f"got {self.resize_mode!r}"
            )
        if self.max_side < 16:
            raise DataImportError(
                f"--max-side must be at least 16 (the validation policy's min_width), got {self.max_side}"
            )
        if self.max_image_bytes < 1:
            raise DataImportError(f"--max-image-bytes must be positive, got {self.max_image_bytes}")
        if not 1 <= self.max_pixels <= MAX_DECODE_PIXELS:
            raise DataImportError(
                f"--max-pixels must be between 1 and {MAX_DECODE_PIXELS:,} (Pillow's decompression-bomb "
                f"limit, above which no picture is decoded), got {self.max_pixels:,}"
            )


@dataclass
class _Candidate:
    source: str  # what the report names: the path relative to SRC, or "table row N: path"
    path: Path | None  # the image file
    caption: str | None = None  # class folders and tables: the caption itself
    captions: tuple[str, ...] | None = None  # Karpathy files: the entry's sentences
    caption_file: Path | None = None  # sidecar: the file to read it from
    metadata_file: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    label: str | None = None
    listed: str | None = None  # tables: the path cell as written (the sample's "source"), and its row
    row: int | None = None
    refused: tuple[str, str] | None = None  # known before reading anything
    split: str | None = None  # Karpathy files: the entry's split (else the hash split of the key)
    meta: dict[str, Any] | None = None  # Karpathy files: the entry without its sentences (source_meta)


@dataclass
class ImportResult:
    """What an import did: the report written to ``DIR/import.json`` and where it lies."""

    out: Path
    report: dict[str, Any]
    written_shards: int
    reused_shards: int
    timings: dict[str, float] = field(default_factory=dict)  # wall and CPU seconds of the scan and the writes

    @property
    def imported(self) -> int:
        return int(self.report["imported"])

    def summary(self) -> dict[str, Any]:
        """What ``compatflow data import`` prints: the report's counts and the shards this run wrote."""
        keys = (
            "imported counts captions caption_counts grouped duplicates in_stream refused refused_by_reason"
        )
        return {
            **{k: self.report[k] for k in keys.split() if k in self.report},
            "shards_written": self.written_shards,
            "shards_already_there": self.reused_shards,
            "report": str(self.out / REPORT),
        }


def parse_split(text: str) -> tuple[float, float, float]:
    """``--split``'s ``train,eval,gallery`` fractions (checked by :meth:`ImportSettings.check`)."""
    try:
        return tuple(float(f) for f in text.split(","))  # type: ignore[return-value]
    except ValueError:
        raise DataImportError(
            f"--split {text!r} must be three fractions train,eval,gallery, e.g. 0.8,0.1,0.1"
        ) from None


def _walk(root: Path, skip: Path | None) -> list[Path]:
    """Every non-hidden file under ``root`` (not under ``skip``), sorted by relative POSIX path."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and (skip is None or here / d != skip)]
        found += [here / f for f in filenames if not f.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _sidecar_candidates(root: Path, skip: Path | None) -> list[_Candidate]:
    files = _walk(root, skip)
    by_stem: dict[tuple[Path, str], list[Path]] = {}
    for f in files:
        by_stem.setdefault((f.parent, f.stem), []).append(f)
    out = []
    for f in files:
        rel = f.relative_to(root).as_posix()
        suffix = f.suffix.lower()
        group = by_stem[(f.parent, f.stem)]
        if suffix in (CAPTION_EXT, METADATA_EXT):
            sidecars = [g.suffix.lower() for g in group]
            orphan = all(x in (CAPTION_EXT, METADATA_EXT) for x in sidecars)
            if orphan and (suffix == CAPTION_EXT or CAPTION_EXT not in sidecars):  # reported once per stem
                what = "a caption" if suffix == CAPTION_EXT else "metadata"
                out.append(_Candidate(rel, None, refused=("image_missing", f"{rel}: {what} with no image")))
            continue
        caption = next((g for g in group if g.suffix == CAPTION_EXT), None)
        caption = caption or next((g for g in group if g.suffix.lower() == CAPTION_EXT), None)
        metadata = next((g for g in group if g.suffix.lower() == METADATA_EXT), None)
        out.append(_Candidate(rel, f, caption_file=caption, metadata_file=metadata))
    return out


def _class_folder_candidates(root: Path, skip: Path | None, template: str) -> list[_Candidate]:
    out = []
    for f in _walk(root, skip):
        rel, label = f.relative_to(root).as_posix(), f.relative_to(root).parts[0]
        refused = None if "/" in rel else ("not_in_class_folder", f"{rel}: not inside a label folder")
        caption = template.format(label=label.replace("_", " ").strip())
        out.append(_Candidate(rel, f, caption, label=label, refused=refused))
    return out


def _json_safe(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "item") and not isinstance(value, (list, tuple, dict)):  # numpy scalars
        return _json_safe(value.item())
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _read_table(table: Path) -> tuple[list[str], list[dict[str, Any]]]:
    suffix = table.suffix.lower()
    if suffix not in (".csv", ".parquet"):
        raise DataImportError(f"{table}: a table must be a .csv or .parquet file")
    try:
        if suffix == ".csv":
            with open(table, newline="", encoding="utf-8-sig") as f:
                reader = csv.DictReader(f)
                return list(reader.fieldnames or []), list(reader)
        import pyarrow.parquet as pq

        data = pq.read_table(table)
        return list(data.column_names), data.to_pylist()
    except (OSError, UnicodeDecodeError, csv.Error, ValueError) as exc:
        raise DataImportError(f"{table} cannot be read as a {suffix[1:]} table: {exc}") from exc


def _not_a_file(source: str, path: Path) -> tuple[str, str] | None:
    """Why a listed path that is not a regular file is refused (None when it is one); it is never opened."""
    try:
        if path.is_file():
            return None
        path.lstat()
    except FileNotFoundError:
        return "image_missing", f"{source}: no such file {path}"
    except (OSError, ValueError) as exc:  # a name too long or holding a NUL, a folder that cannot be searched
        why = getattr(exc, "strerror", None) or exc
        return "image_missing", f"{source}: {path} cannot be looked at: {why}"
    if path.is_dir() and not path.is_symlink():
        return "image_missing", f"{source}: {path} is a folder, not an image file"
    return "not_a_regular_file", f"{source}: {path} is not a regular file (a device, a FIFO or a broken link)"


def _table_candidates(table: Path, settings: ImportSettings) -> list[_Candidate]:
    columns, rows = _read_table(table)
    if missing := [c for c in (settings.path_column, settings.caption_column) if c not in columns]:
        raise DataImportError(
            f"{table} has no column {', '.join(repr(c) for c in missing)} (columns: {', '.join(columns)}); "
            "name them path and caption, or pass --path-column / --caption-column"
        )
    extras = [c for c in columns if c not in (settings.path_column, settings.caption_column)]
    if clash := [c for c in extras if c in RESERVED_FIELDS]:
        raise DataImportError(
            f"{table}: column(s) {', '.join(clash)} would overwrite field(s) the importer writes into each "
            "sample's .json; rename them"
        )
    out = []
    for n, row in enumerate(rows, start=1):  # data rows, the header not counted
        cell = row.get(settings.path_column)
        where = f"{table.name} row {n}"
        extra = {c: _json_safe(row.get(c)) for c in extras}
        text = row.get(settings.caption_column)
        caption = "" if text is None or (isinstance(text, float) and math.isnan(text)) else str(text)
        if cell is None or not str(cell).strip():
            out.append(_Candidate(where, None, refused=("image_missing", f"{where}: the path cell is empty")))
            continue
        rel = str(cell).strip()
        source, path = f"{where}: {rel}", table.parent / rel  # an absolute rel stays as it is
        refused = _not_a_file(source, path)
        out.append(_Candidate(source, path, caption, extra=extra, listed=rel, row=n, refused=refused))
    return out


_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_SURROGATE = re.compile(r"[\ud800-\udfff]|\\u[dD][89a-fA-F]")  # one as it is, or a JSON escape of one


class _BoundedJSON(json.JSONDecoder):
    """A JSON decoder that reads an integer of more than :data:`MAX_INT_DIGITS` digits as 0, noted in
    ``oversized`` (Python refuses one of over 4,300 digits, which would end the whole read)."""

    def __init__(self, text: str) -> None:
        super().__init__(parse_int=self._int)
        self.oversized: list[int] = []  # the digits of each integer read as 0
        self.surrogates = _SURROGATE.search(text) is not None  # else no decoded string can hold one

    def _int(self, digits: str) -> int:
        if len(digits.lstrip("-")) <= MAX_INT_DIGITS:
            return int(digits)
        self.oversized.append(len(digits.lstrip("-")))
        return 0


def _doc_problem(doc: Any, decoder: _BoundedJSON) -> str | None:
    """Why a decoded metadata document cannot be stored (None when it can), clearing ``decoder.oversized``."""
    oversized, decoder.oversized = decoder.oversized, []
    if oversized:
        return f"an integer of {oversized[0]:,} digits (at most {MAX_INT_DIGITS})"
    if not decoder.surrogates:
        return None
    try:
        json.dumps(doc, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"text that is not Unicode ({exc.object[exc.start : exc.end]!r}, a lone surrogate)"
    return None


def _json_array_items(text: str, key: str, where: Path, decoder: json.JSONDecoder) -> Iterator[Any]:
    """The elements of the top-level object's ``key`` array in ``text``, decoded one at a time (COCO's
    Karpathy file is 140 MB of text, several GB as one decoded tree)."""

    def expect(i: int, chars: str, what: str) -> tuple[str, int]:
        i = _JSON_SPACE.match(text, i).end()  # type: ignore[union-attr]  # the pattern matches ""
        if i >= len(text) or text[i] not in chars:
            found = repr(text[i]) if i < len(text) else "the end of the file"
            raise DataImportError(
                f"{where} is not a Karpathy split file: {what} expected at character {i}, found {found}"
            )
        return text[i], _JSON_SPACE.match(text, i + 1).end()  # type: ignore[union-attr]

    _, i = expect(0, "{", "a JSON object")
    found, mark = False, "}" if text[i : i + 1] == "}" else ","  # "}": an empty object
    while mark == ",":
        name, i = decoder.raw_decode(text, i)
        _, i = expect(i, ":", "':'")
        if name == key and not found:
            found = True
            _, i = expect(i, "[", f"the {key!r} array")
            mark, i = ("]", i + 1) if text[i : i + 1] == "]" else (",", i)
            while mark == ",":
                element, i = decoder.raw_decode(text, i)
                yield element
                mark, i = expect(i, ",]", "',' or ']'")
        else:
            _, i = decoder.raw_decode(text, i)
        mark, i = expect(i, ",}", "',' or '}'")
    if not found:
        raise DataImportError(
            f"{where} has no {key!r} list: not a Karpathy split file (dataset_coco.json, "
            "dataset_flickr30k.json)"
        )


def _sentence_text(sentence: Any) -> str | None:
    if isinstance(sentence, dict):
        if isinstance(sentence.get("raw"), str):
            return sentence["raw"]
        tokens = sentence.get("tokens")
        if isinstance(tokens, list) and all(isinstance(t, str) for t in tokens):
            return " ".join(tokens)
    return sentence if isinstance(sentence, str) else None


def _karpathy_candidates(file: Path) -> list[_Candidate]:
    try:
        text = file.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataImportError(f"{file} cannot be read as a UTF-8 JSON file: {exc}") from exc
    decoder = _BoundedJSON(text)
    try:
        return [
            _karpathy_candidate(file, f"{file.name} image {n}", entry, _doc_problem(entry, decoder))
            for n, entry in enumerate(_json_array_items(text, "images", file, decoder), start=1)
        ]
    except (json.JSONDecodeError, RecursionError) as exc:
        raise DataImportError(f"{file} is not valid JSON: {exc}") from exc


def _karpathy_candidate(file: Path, where: str, entry: Any, problem: str | None) -> _Candidate:
    """The candidate of one Karpathy entry (``problem``: why its decoded document cannot be stored)."""
    filename = entry.get("filename") if isinstance(entry, dict) else None
    if problem or not isinstance(filename, str) or not filename.strip():
        return _Candidate(where, None, refused=("entry_invalid", f"{where}: {problem or 'no filename'}"))
    folder, rel = entry.get("filepath"), filename.strip()
    if isinstance(folder, str) and folder.strip():
        rel = f"{folder.strip().rstrip('/')}/{rel}"
    source = f"{where}: {rel}"
    split, sentences = entry.get("split"), entry.get("sentences")
    if not isinstance(split, str) or split not in KARPATHY_SPLITS:
        problem = f"{source}: split {json.dumps(split)[:80]} is not one of {', '.join(KARPATHY_SPLITS)}"
        return _Candidate(source, None, refused=("entry_invalid", problem))
    if isinstance(sentences, list) and len(sentences) > MAX_CAPTIONS:
        problem = f"{source}: {len(sentences):,} sentences, at most {MAX_CAPTIONS:,} per picture"
        return _Candidate(source, None, refused=("too_many_captions", problem))
    texts = [_sentence_text(x) for x in sentences] if isinstance(sentences, list) else None
    if not texts or any(t is None for t in texts):
        problem = f"{source}: 'sentences' must be a non-empty list of {{\"raw\": caption}} objects"
        return _Candidate(source, None, refused=("entry_invalid", problem))
    path = file.parent / rel  # an absolute rel stays as it is
    if refused := _not_a_file(source, path):
        return _Candidate(source, path, refused=refused)
    meta = _json_safe({k: v for k, v in entry.items() if k != "sentences"})
    split = KARPATHY_SPLITS[split]
    return _Candidate(source, path, captions=tuple(texts), listed=rel, split=split, meta=meta)


def detect_format(src: Path) -> str:
    """``table`` for a .csv/.parquet file, ``karpathy`` for a .json file, ``sidecar`` for a folder."""
    if src.is_file():
        if src.suffix.lower() in (".csv", ".parquet"):
            return "table"
        if src.suffix.lower() == ".json":
            return "karpathy"
        raise DataImportError(
            f"{src} is a file but not a .csv or .parquet table nor a Karpathy .json; give a folder or a table"
        )
    if src.is_dir():
        return "sidecar"
    raise DataImportError(
        f"{src} does not exist; give a folder of images, a .csv/.parquet table or a Karpathy .json"
    )


def _candidates(src: Path, out: Path, settings: ImportSettings) -> list[_Candidate]:
    fmt = settings.source_format
    if fmt in ("table", "karpathy"):
        if not src.is_file():
            needs = "a .csv or .parquet file" if fmt == "table" else "the split .json file"
            raise DataImportError(f"--format {fmt} needs {needs}; {src} is not a file")
        return _table_candidates(src, settings) if fmt == "table" else _karpathy_candidates(src)
    if not src.is_dir():
        raise DataImportError(f"--format {fmt} needs a folder; {src} is not a folder")
    skip = out if out.is_relative_to(src) else None
    if fmt == "class-folders":
        return _class_folder_candidates(src, skip, settings.template)
    return _sidecar_candidates(src, skip)


def _header(data: bytes, max_pixels: int) -> dict[str, Any]:
    """Format, mode, size and transparency an image's header declares (nothing decoded); raises ``_Refused``
    when it is not an image or declares more than ``max_pixels`` (``image_pixels``)."""
    from PIL import UnidentifiedImageError

    try:
        return asdict(read_header(data, formats=None, max_pixels=max_pixels))
    except ImageTooLargeError as exc:
        pixels, size = exc.pixels, exc.size
        amount = f"{pixels:,} pixels, {pixels / 1e6:.1f} megapixels" if pixels else "over Pillow's limit"
        what = f"{size[0]}x{size[1]} ({amount})" if size else amount
        raise _Refused(
            "image_pixels",
            f"the image is {what}, above max_pixels {max_pixels:,} ({max_pixels / 1e6:g} megapixels; "
            "--max-pixels, at most Pillow's decompression-bomb limit): not decoded",
        ) from exc
    except ImageDecodeError as exc:
        if isinstance(exc.__cause__, UnidentifiedImageError):
            raise _Refused("not_an_image", "not an image PIL can identify") from exc
        raise _Refused("image_unreadable", str(exc)) from exc


def _load(image: Any) -> None:
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise _Refused("image_unreadable", f"cannot decode the image: {exc}") from exc


def stored_image(data: bytes, fmt: str) -> tuple[str, bytes, dict[str, Any]]:
    """An image whose format the pipeline does not decode as lossless PNG (CMYK: JPEG quality 95), with the
    facts :func:`resize_image` gives; raises ``_Refused`` for a mode neither can hold."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        _load(image)
        with contextlib.suppress(OSError, KeyError, ValueError):
            return _encoded(image, image.size, as_jpeg=False)
        if image.mode == "CMYK":
            return _encoded(image, image.size, as_jpeg=True)
    raise _Refused(
        "unsupported_mode", f"a {fmt} image in mode {image.mode} can be stored neither as PNG nor JPEG"
    )


def resized_size(width: int, height: int, max_side: int, mode: str) -> tuple[int, int] | None:
    """The size ``mode`` stores a ``width`` x ``height`` picture at, or None when it is stored as it is
    (img2dataset's modes, never enlarging)."""
    short, long = min(width, height), max(width, height)
    if mode == "keep_ratio" and short > max_side:
        scaled = max(1, round(long * max_side / short))
        return (max_side, scaled) if width <= height else (scaled, max_side)
    if mode == "center_crop" and long > max_side:
        side = min(short, max_side)
        return (side, max_side) if width <= height else (max_side, side)
    if mode == "border" and long > max_side:
        return max_side, max_side
    return None


def resize_image(
    data: bytes, fmt: str, max_side: int, mode: str, size: tuple[int, int]
) -> tuple[str, bytes, dict[str, Any]]:
    """The member extension, bytes and facts (stored and original upright size) of ``data`` (``size`` in
    its header) resized by ``mode``, decoded once at the size it needs (a JPEG at a reduced scale). Raises
    :class:`compat.data.images.ImageDecodeError` when it does not decode."""
    from PIL import Image

    short, long = min(size), max(size)
    need = max_side if mode in ("keep_ratio", "center_crop") else max(1, math.ceil(max_side * short / long))
    # area averaging for the last scaling, as img2dataset downscales (OpenCV's INTER_AREA)
    image = decode_rgb(data, formats=None, size=need, max_pixels=None, resample=Image.Resampling.BOX)
    original = image.info["original_size"]
    if mode == "center_crop":
        width, height = min(image.width, max_side), min(image.height, max_side)
        left, top = (image.width - width) // 2, (image.height - height) // 2
        image = image.crop((left, top, left + width, top + height))
    elif mode == "border":
        inner = (max_side, max(1, round(image.height * max_side / image.width)))
        if image.width < image.height:
            inner = (max(1, round(image.width * max_side / image.height)), max_side)
        if image.size != inner:
            image = image.resize(inner, Image.Resampling.BICUBIC)
        canvas = Image.new("RGB", (max_side, max_side), (0, 0, 0))
        canvas.paste(image, ((max_side - inner[0]) // 2, (max_side - inner[1]) // 2))
        image = canvas
    return _encoded(image, original, as_jpeg=fmt in ("JPEG", "MPO"))


def _encoded(image: Any, original: tuple[int, int], as_jpeg: bool) -> tuple[str, bytes, dict[str, Any]]:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG" if as_jpeg else "PNG", **({"quality": 95} if as_jpeg else {}))
    facts = {"width": image.width, "height": image.height}
    facts |= {"original_width": original[0], "original_height": original[1]}
    return ("jpg" if as_jpeg else "png"), buffer.getvalue(), facts


@dataclass(frozen=True)
class _Place:
    """Where the files an import reads may lie: ``root`` (SRC, or a table's folder) and ``allowed``."""

    root: Path
    allowed: tuple[Path, ...] = ()

    def check(self, path: Path, what: str = "the file") -> Path:
        """The real path of ``path``; ``_Refused`` for a link or a path outside the root, unless allowed."""
        real = Path(os.path.realpath(path))
        if any(real.is_relative_to(a) for a in self.allowed):
            return real
        if Path(os.path.abspath(path)) != real:
            raise _Refused(
                "not_a_regular_file",
                f"{what} {path.name} is a symbolic link (or lies under one) to {real}: copy the file "
                "into the source folder, or pass --allow-outside with the folder it points into",
            )
        if not real.is_relative_to(self.root):
            raise _Refused(
                "outside_source",
                f"{what} {real} lies outside {self.root}: copy it there, or pass --allow-outside "
                "with its folder",
            )
        return real

    def read(self, path: Path, limit: int, what: str, reason: str) -> tuple[Path, bytes | None]:
        """:meth:`check`, then :func:`read_regular`; an unreadable file is refused with ``reason``."""
        real = self.check(path, what)
        try:
            return real, read_regular(real, limit, what)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link that appeared after the check
                raise _Refused("not_a_regular_file", f"{what} {path.name} is a symbolic link") from exc
            raise _Refused(reason, f"cannot read {what} {path.name}: {exc}") from exc


def read_regular(path: Path, limit: int, what: str = "the file") -> bytes | None:
    """The bytes of ``path`` (None when over ``limit``, never more read), opened without following a link
    and read only when it is a regular file with one name (``_Refused`` otherwise)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Refused("not_a_regular_file", f"{what} {path.name} is not a regular file")
        if st.st_nlink > 1:
            raise _Refused(
                "not_a_regular_file",
                f"{what} {path.name} is a hard link ({st.st_nlink} names, some maybe outside the source "
                "folder): copy it so that it has one name",
            )
        data = f.read(limit + 1)
    return None if len(data) > limit else data


def _read_sidecar(path: Path, what: str, limit: int, place: _Place) -> bytes:
    _, data = place.read(path, limit, f"the {what} file", "sidecar_unreadable")
    if data is None:
        reason = "caption_too_large" if what == "caption" else "sidecar_unreadable"
        raise _Refused(reason, f"the {what} file {path.name} is over {limit} bytes")
    return data


def _read_captions(candidate: _Candidate, place: _Place) -> tuple[list[str], list[tuple[str, str, str]]]:
    """The candidate's captions, and a Karpathy entry's sentences left out as (which, reason, message);
    ``_Refused`` when no caption remains."""
    if candidate.captions is None:
        return [_read_caption(candidate, place)], []
    kept, skipped = [], []
    for n, raw in enumerate(candidate.captions, start=1):
        if problem := _caption_problem(raw.strip()):
            skipped.append((f"sentence {n}", *problem))
        else:
            kept.append(raw.strip())
    if not kept:
        raise _Refused(skipped[0][1], f"no usable sentence ({'; '.join(m for _, _, m in skipped)})")
    return kept, skipped


def _read_caption(candidate: _Candidate, place: _Place) -> str:
    if candidate.caption_file is not None:
        data = _read_sidecar(candidate.caption_file, "caption", MAX_CAPTION_BYTES, place)
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise _Refused("caption_not_utf8", f"{candidate.caption_file.name} is not UTF-8: {exc}") from exc
    elif candidate.caption is not None:
        text = candidate.caption
    else:  # a sidecar picture
        raise _Refused("caption_missing", f"no caption file {candidate.path.stem}{CAPTION_EXT} beside it")
    if problem := _caption_problem(text.strip()):
        raise _Refused(*problem)
    return text.strip()


def _caption_problem(text: str) -> tuple[str, str] | None:
    """Why a stripped caption cannot be stored (reason, message), or None."""
    if not text:
        return "caption_empty", "the caption is empty"
    if len(text.encode("utf-8")) > MAX_CAPTION_BYTES:
        return "caption_too_large", f"the caption is over {MAX_CAPTION_BYTES} bytes"
    return None


def _read_metadata(candidate: _Candidate, place: _Place) -> dict[str, Any] | None:
    if candidate.meta is not None:
        return candidate.meta
    if candidate.metadata_file is None:
        return None
    data = _read_sidecar(candidate.metadata_file, "metadata", MAX_SIDECAR_BYTES, place)
    try:
        text = data.decode(json.detect_encoding(data), "surrogatepass")  # as json.loads decodes
        decoder = _BoundedJSON(text)
        doc = decoder.decode(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _Refused("metadata_not_json", f"{candidate.metadata_file.name} is not JSON: {exc}") from exc
    if problem := _doc_problem(doc, decoder):
        raise _Refused("metadata_not_json", f"{candidate.metadata_file.name} holds {problem}")
    if not isinstance(doc, dict):
        raise _Refused("metadata_not_json", f"{candidate.metadata_file.name} is not a JSON object")
    return _json_safe(doc)


def split_of(key: str, seed: int, fractions: Sequence[float]) -> str:
    """The split of ``key``: a seeded hash mapped to [0, 1), cut at the cumulative fractions."""
    digest = hashlib.sha256(f"compatflow-split/{seed}/{key}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    edge = 0.0
    for split, fraction in zip(SPLITS, fractions, strict=True):
        edge += fraction
        if u < edge and fraction > 0:
            return split
    return next(s for s, f in zip(reversed(SPLITS), reversed(fractions), strict=True) if f > 0)


def _inspect(
    candidate: _Candidate, settings: ImportSettings, place: _Place, spool: Path, planned: Container[str]
) -> dict[str, Any]:
    """The plan item of one candidate (raises ``_Refused``), its stored picture's facts in ``stored``. A
    picture already ``planned`` is not decoded again: the item then holds only its SHA-256 and captions."""
    if candidate.refused:
        raise _Refused(*candidate.refused)
    assert candidate.path is not None
    real, data = place.read(candidate.path, settings.max_image_bytes, "the file", "image_unreadable")
    if data is None:
        raise _Refused("image_too_large", f"over max_image_bytes {settings.max_image_bytes}")
    if not data:
        raise _Refused("not_an_image", "the file is empty (0 bytes)")
    sha = hashlib.sha256(data).hexdigest()
    if sha in planned:
        captions, skipped = _read_captions(candidate, place)
        return {"sha256": sha, "captions": captions, "skipped_captions": skipped}
    info = _header(data, settings.max_pixels)
    size = (info["width"], info["height"])
    target = resized_size(*size, settings.max_side, settings.resize_mode)
    if target is None and size[0] * size[1] > MAX_PIXELS:
        raise _Refused(
            "too_many_pixels",
            f"{size[0]}x{size[1]} is more than the {MAX_PIXELS:,} pixels readers decode: "
            f"store it smaller (--resize-mode keep_ratio, center_crop or border; --max-side)",
        )
    stored = _store(data, sha, info, target is not None, settings, spool)
    captions, skipped = _read_captions(candidate, place)
    return {
        "key": settings.key_prefix + sha[:KEY_HEX],
        "split": candidate.split or split_of(sha[:KEY_HEX], settings.seed, settings.split),
        "path": str(real),
        "source": candidate.listed or candidate.source,
        "row": candidate.row,
        "captions": captions,
        "skipped_captions": skipped,
        "sha256": sha,
        "size": len(data),
        **info,
        "label": candidate.label,
        "extra": candidate.extra,
        "source_meta": _read_metadata(candidate, place),
        "resize": None if target is None else {"mode": settings.resize_mode, "max_side": settings.max_side},
        "stored": stored,
    }


def _store(
    data: bytes, sha: str, info: dict[str, Any], resize: bool, settings: ImportSettings, spool: Path
) -> dict[str, Any] | None:
    """Decode the picture once, making the resized, converted or flattened one into ``spool``; returns the
    facts of what was made (None when stored as it is)."""
    size = (info["width"], info["height"])
    made: tuple[str, bytes, dict[str, Any]] | None = None
    if resize or info["transparent"]:  # resized, or matted on white as img2dataset stores it
        try:
            if resize:
                made = resize_image(data, info["format"], settings.max_side, settings.resize_mode, size)
            else:  # upright, on white, as PNG
                image = decode_rgb(data, formats=None, max_pixels=None)
                made = _encoded(image, image.info["original_size"], as_jpeg=False)
        except ValueError as exc:  # compat.data.images.ImageDecodeError
            raise _Refused("image_unreadable", str(exc)) from exc
    elif info["format"] not in KEPT_FORMATS:  # decoded and stored as PNG (refuses what cannot be)
        made = stored_image(data, info["format"])
    else:  # the one decode: the bytes are stored as they are
        from PIL import Image

        with Image.open(io.BytesIO(data)) as image:
            if image.format in ("JPEG", "MPO"):
                image.draft(None, (1, 1))  # 1/8 scale, which reads every byte all the same
            _load(image)
        return None
    ext, made_bytes, facts = made
    spool.mkdir(parents=True, exist_ok=True)
    (spool / f"{sha}.{ext}").write_bytes(made_bytes)
    return {"ext": ext, "sha256": hashlib.sha256(made_bytes).hexdigest(), "size": len(made_bytes), **facts}


def _plan(
    src: Path,
    out: Path,
    settings: ImportSettings,
    progress: Callable[..., Iterator[Any]],
    allowed: tuple[Path, ...] = (),
    exclude: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Which picture goes to which shard with which captions: the files or rows of one picture join the first
    one's item, in source order (the scan holds pictures and distinct captions, never their bytes)."""
    candidates = _candidates(src, out, settings)
    place = _Place(src.parent if settings.source_format in ("table", "karpathy") else src, allowed)
    items: list[dict[str, Any]] = []
    refused: list[dict[str, str]] = []
    duplicates: list[dict[str, str]] = []
    in_stream: list[dict[str, str]] = []  # keys the stream given as ``exclude`` already holds
    # per planned picture (SHA-256 of its bytes): the source that brought it, its item (None when the stream
    # given as ``exclude`` holds it) and the set of its captions
    first_of: dict[str, tuple[str, dict[str, Any] | None, set[str]]] = {}
    grouped = 0  # files or rows whose picture an earlier one brought, and that added a caption to it
    for candidate in progress(candidates, f"reading {len(candidates)} files", total=len(candidates)):
        source = candidate.source
        try:
            item = _inspect(candidate, settings, place, out / SPOOL, first_of)
        except _Refused as refusal:
            message = (
                refusal.message if refusal.message.startswith(source) else f"{source}: {refusal.message}"
            )
            refused.append({"source": source, "reason": refusal.reason, "message": message})
            continue
        for which, reason, message in item.pop("skipped_captions"):
            where = f"{source} {which}"
            refused.append({"source": where, "reason": reason, "message": f"{where}: {message}"})
        sha, captions = item["sha256"], item["captions"]
        new = sha not in first_of
        if new:
            held = exclude is not None and item["key"] in exclude
            item["captions"] = []
            first_of[sha] = (source, None if held else item, set())
            items += [] if held else [item]
        if first_of[sha][1] is None:  # the stream given as ``exclude`` holds the picture
            key = settings.key_prefix + sha[:KEY_HEX]
            in_stream.append({"source": source, "key": key, "shard": (exclude or {})[key]})
            continue
        added = _add_captions(source, captions, first_of[sha], duplicates, refused)
        grouped += not new and added > 0
    for item in [i for i in items if len(_sample_json(i)) > MAX_SIDECAR_BYTES]:
        items.remove(item)
        size = len(_sample_json(item))
        message = f"{item['source']}: its {{key}}.json would be {size:,} bytes, over {MAX_SIDECAR_BYTES:,}"
        refused.append({"source": item["source"], "reason": "sample_too_large", "message": message})
    per = settings.samples_per_shard
    shards = {
        split: [
            {"path": f"{split}/{n:05d}.tar", "items": of_split[start : start + per]}
            for n, start in enumerate(range(0, len(of_split), per))
        ]
        for split, of_split in ((s, [i for i in items if i["split"] == s]) for s in SPLITS)
    }
    portable = {  # without each item's absolute path (SRC may move) and stored picture (its bytes decide it)
        s: [[{k: v for k, v in i.items() if k not in ("path", "stored")} for i in sh["items"]] for sh in v]
        for s, v in shards.items()
    }
    content = json.dumps({"settings": asdict(settings), "shards": portable}, sort_keys=True)
    plan = {"settings": asdict(settings), "shards": shards, "refused": refused, "duplicates": duplicates}
    plan |= {"grouped": grouped, "digest": hashlib.sha256(content.encode()).hexdigest()}
    return plan | ({"in_stream": in_stream} if exclude is not None else {})


def _add_captions(
    source: str,
    captions: list[str],
    planned: tuple[str, dict[str, Any], set[str]],
    duplicates: list[dict[str, str]],
    refused: list[dict[str, str]],
) -> int:
    """Add ``source``'s captions to the ``planned`` picture (its first source, item and known captions);
    returns how many were new. A repeat is listed in ``duplicates``, one past :data:`MAX_CAPTIONS` refused."""
    first, item, known = planned
    added = 0
    for caption in captions:
        if caption in known:
            duplicates.append({"source": source, "duplicate_of": first, "caption": caption})
        elif len(known) >= MAX_CAPTIONS:
            message = f"{source}: {first} has {MAX_CAPTIONS:,} captions, the most per picture"
            refused.append({"source": source, "reason": "too_many_captions", "message": message})
            break
        else:
            known.add(caption)
            item["captions"].append(caption)
            added += 1
    return added


def _checked_bytes(path: Path, size: int, sha: str) -> bytes:
    """A planned or spooled file's bytes, read again and checked against the digest taken when planning."""
    try:
        data = read_regular(path, size)
    except (OSError, _Refused) as exc:
        raise DataImportError(f"{path} can no longer be read ({exc}); run the import again") from exc
    if data is None or hashlib.sha256(data).hexdigest() != sha:
        raise DataImportError(f"{path} changed while it was being imported; run the import again")
    return data


def _original_members(item: dict[str, Any]) -> tuple[str, dict[str, bytes]]:
    """The ``--keep-originals`` sample: the untouched file and what it is."""
    data = _checked_bytes(Path(item["path"]), item["size"], item["sha256"])
    meta = {"key": item["key"], "source": item["source"], "format": item["format"], "sha256": item["sha256"]}
    ext = KEPT_FORMATS.get(item["format"], str(item["format"]).lower())
    return item["key"], {ext: data, "json": json.dumps(meta, sort_keys=True).encode("utf-8")}


def _members(item: dict[str, Any], spool: Path) -> tuple[str, dict[str, bytes]]:
    made = item.get("stored")
    if made is not None:  # resized or converted during the scan
        path = spool / f"{item['sha256']}.{made['ext']}"
        ext, stored = made["ext"], _checked_bytes(path, made["size"], made["sha256"])
    else:
        ext = KEPT_FORMATS[item["format"]]
        stored = _checked_bytes(Path(item["path"]), item["size"], item["sha256"])
    return item["key"], {ext: stored, "txt": item["captions"][0].encode("utf-8"), "json": _sample_json(item)}


def _sample_json(item: dict[str, Any]) -> bytes:
    """The sample's ``{key}.json`` member."""
    made, width, height = item.get("stored"), item["width"], item["height"]
    stored = made or {"width": width, "height": height, "original_width": width, "original_height": height}
    meta: dict[str, Any] = {
        **{k: item[k] for k in ("key", "source", "mode", "format", "split", "label", "source_meta")},
        **{k: stored[k] for k in ("width", "height", "original_width", "original_height")},
        "caption": item["captions"][0],
        "captions": item["captions"],
        "sha256": made["sha256"] if made is not None else item["sha256"],
        "status": "success",
        "resize": {**(item["resize"] or {}), "applied": bool(item["resize"])},
        "source_row": item["row"],
        "source_sha256": item["sha256"] if made is not None else None,
    }
    meta = {k: v for k, v in meta.items() if v is not None}  # the optional fields only when they apply
    return json.dumps(
        meta | item["extra"], ensure_ascii=False, separators=(",", ":"), sort_keys=True
    ).encode()


def _report(src: Path, plan: dict[str, Any]) -> dict[str, Any]:
    items_of = {s: [i for sh in plan["shards"][s] for i in sh["items"]] for s in SPLITS}
    counts = {s: len(of_split) for s, of_split in items_of.items()}
    caption_counts = {s: sum(len(i["captions"]) for i in of_split) for s, of_split in items_of.items()}
    items = [i for of_split in items_of.values() for i in of_split]
    converted = sum(1 for i in items if i["format"] not in KEPT_FORMATS and not i.get("resize"))
    originals = {s: [f"{ORIGINALS}/{sh['path']}" for sh in plan["shards"][s]] for s in SPLITS}
    in_stream = plan.get("in_stream")
    return {
        "format": FORMAT,
        "version": VERSION,
        "source": str(src),
        "settings": {**plan["settings"], "split": list(plan["settings"]["split"])},
        "imported": sum(counts.values()),
        "counts": counts,
        "captions": sum(caption_counts.values()),
        "caption_counts": caption_counts,
        "grouped": plan["grouped"],
        "shards": {s: [sh["path"] for sh in plan["shards"][s]] for s in SPLITS},
        "converted_to_png_or_jpeg": converted,
        "resized": sum(1 for i in items if i.get("resize")),
        "matted_on_white": sum(1 for i in items if i["transparent"]),
        **({"originals": originals} if plan["settings"].get("keep_originals") else {}),
        "duplicates": len(plan["duplicates"]),
        "duplicate_files": plan["duplicates"],
        **({"in_stream": len(in_stream), "in_stream_files": in_stream} if in_stream is not None else {}),
        "refused": len(plan["refused"]),
        "refused_by_reason": dict(sorted(Counter(r["reason"] for r in plan["refused"]).items())),
        "refused_files": plan["refused"],
        "plan_sha256": plan["digest"],
    }


def import_images(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    settings: ImportSettings | None = None,
    *,
    progress: bool = True,
    allow_outside: Sequence[str | os.PathLike[str]] = (),
    exclude: Mapping[str, str] | None = None,
) -> ImportResult:
    """Import ``src`` into shards under ``out`` (see the module docstring); resumes a killed import.

    Raises :class:`DataImportError` for a bad source, settings or output folder, or an ``out`` holding a
    finished import of other input. ``allow_outside``: folders outside SRC whose files may be read.
    ``exclude``: keys a stream holds, each with its shard (:func:`compat.data.manifest.stream_keys`).
    """
    settings = settings or ImportSettings(source_format=detect_format(Path(src)))
    settings.check()
    src_path, out_path = Path(src).resolve(), Path(out).resolve()
    if src_path == out_path:
        raise DataImportError("--out must be another folder than the source")
    allowed = []
    for folder in allow_outside:
        if not Path(folder).is_dir():
            raise DataImportError(f"--allow-outside {folder} is not a folder; name an existing folder")
        allowed.append(Path(os.path.realpath(folder)))

    def show(items: Any, desc: str, total: int | None = None) -> Any:
        return track(items, desc, total=total) if progress else items

    if out_path.exists() and not out_path.is_dir():
        raise DataImportError(f"--out {out_path} is a file; give a new or empty folder")
    created = not out_path.exists()
    try:
        out_path.mkdir(parents=True, exist_ok=True)
        with _out_lock(out_path):
            try:
                return _import(src_path, out_path, settings, show, tuple(allowed), exclude)
            finally:  # the spool goes whatever happened (a killed import's is overwritten by the next scan)
                shutil.rmtree(out_path / SPOOL, ignore_errors=True)
    finally:
        if created and out_path.is_dir() and not any(out_path.iterdir()):
            out_path.rmdir()


@contextlib.contextmanager
def _out_lock(out: Path) -> Iterator[None]:
    """Hold :data:`LOCK` in ``out`` (removed when done): a second import is refused, naming its process."""
    import fcntl

    path = out / LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataImportError(
                f"another import (process {holder}) is writing into {out} (it holds {path}): wait for it to "
                "end, or give another --out folder"
            ) from None
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(fd).st_ino == os.stat(path).st_ino:  # not a file its last holder removed meanwhile
                break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)


def _import(
    src: Path,
    out: Path,
    settings: ImportSettings,
    show: Callable[..., Iterator[Any]],
    allowed: tuple[Path, ...],
    exclude: Mapping[str, str] | None,
) -> ImportResult:
    """:func:`import_images` once its arguments are checked: scan, then write the missing shards."""

    def damaged(why: str) -> DataImportError:
        return DataImportError(f"{why}; delete {out} and import again")

    report, pending = read_json(out / REPORT, damaged), read_json(out / PENDING, damaged)
    if report is None and pending is None and any(p.name not in (SPOOL, LOCK) for p in out.iterdir()):
        raise DataImportError(f"{out} is not empty and holds no import; give a new or empty --out folder")
    spool = out / SPOOL
    wall, cpu = time.perf_counter(), time.process_time()
    plan = _plan(src, out, settings, show, allowed, exclude)
    timings = {"scan_s": time.perf_counter() - wall, "scan_cpu_s": time.process_time() - cpu}
    shards = [sh for s in SPLITS for sh in plan["shards"][s]]
    if report is not None:
        if report.get("plan_sha256") == plan["digest"] and all((out / sh["path"]).is_file() for sh in shards):
            log.info("%s already holds this import: nothing written", out)
            return ImportResult(out, report, 0, len(shards), timings)
        raise DataImportError(
            f"{out} holds a finished import of other input or settings ({out / REPORT}); "
            "give a new --out folder or delete this one"
        )
    folders = [out / s for s in SPLITS] + [out / ORIGINALS / s for s in SPLITS]
    if restart := pending is not None and pending.get("digest") != plan["digest"]:
        log.warning("%s: the source or settings changed since the import started; starting over", out)
    for folder in folders:  # temporary files of a killed write, and the shards of another plan
        for stale in [*folder.glob(".*.tmp"), *(folder.glob("*.tar") if restart else ())]:
            stale.unlink()
    write_json_atomic(out / PENDING, {"digest": plan["digest"], "settings": plan["settings"]})

    def written(shard: dict[str, Any]) -> bool:
        original = out / ORIGINALS / shard["path"]
        return (out / shard["path"]).is_file() and (not settings.keep_originals or original.is_file())

    todo = [sh for sh in shards if not written(sh)]
    wall, cpu = time.perf_counter(), time.process_time()
    for shard in show(todo, f"writing {len(todo)} of {len(shards)} shards", total=len(todo)):
        if settings.keep_originals:
            originals = (_original_members(i) for i in shard["items"])
            shard_io.write_shard(out / ORIGINALS / shard["path"], originals)
        shard_io.write_shard(out / shard["path"], (_members(item, spool) for item in shard["items"]))
    report = _report(src, plan)
    write_json_atomic(out / REPORT, report)
    (out / PENDING).unlink()
    timings.update(write_s=time.perf_counter() - wall, write_cpu_s=time.process_time() - cpu)
    return ImportResult(out, report, len(todo), len(shards) - len(todo), timings)
