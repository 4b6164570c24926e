"""A backfill order at gallery scale: built by streaming the collection, kept as ranked chunks on disk.

Nothing here holds one Python object per gallery item. The plan reads the serving collection once, in
batches, into *spill blocks* on disk (item ids as fixed-width bytes, ``embedded_at``, and the vectors when
the order needs them); every later pass reads those blocks back one at a time. Each item gets a sort key:

* ``random``: a seeded 64-bit hash of its item id (a seeded random order that needs no permutation of N);
* ``oldest_first``: ``embedded_at``;
* ``lambda_orth`` (lambda-orthogonality Sec. 3.6): minus the L2 distance of F(h^k_i) to the mean of its class,
  the classes being k-means clusters fitted on a bounded, seeded sample of the vectors (a bottom-k sample by
  hash, whatever order the index returns rows in); the class means mu_c are the exact means of every member,
  accumulated in a streaming pass (:func:`compat.backfill.class_mean_distances` on the whole gallery);
* ``uncertainty``: minus the margin (or entropy) score of :func:`compat.backfill.uncertainty_scores` against
  cluster centres fitted on the same sample.

Items are ranked by (key, item id), ascending. Sorted runs of at most ``run_rows`` items go to disk and are
merged, block by block, into ranked chunks of ``chunk_rows`` ids (``chunk-<n>.npy``) with a manifest holding
the order's sha256 (:func:`compat.backfill.order_digest` of the ids, one per line) and each chunk's own, so a
reader verifies only the chunks it opens. :class:`RankedOrder` reads a rank range ``[start, end)`` of it.

Memory of a plan: ``run_rows`` keys and ids, the k-means sample (``sample_rows`` x D), and one index batch.
Disk: the spill (ids, times, vectors) and the order, both removed/kept as the docstrings of
:func:`build_order` say.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compat.io import write_json_atomic

log = logging.getLogger(__name__)

ORDERS_NEEDING_VECTORS = ("lambda_orth", "uncertainty")
RUN_ROWS = 1 << 20  # items sorted in memory at once (keys and ids: ~50-80 MB at 1M ids of ~40 bytes)
SPILL_ROWS = 1 << 17  # items per spill block on disk (its vectors are what a pass holds: 32 MB at 64-d)
CHUNK_ROWS = 1 << 16  # ids per ranked chunk file
SAMPLE_ROWS = 1 << 16  # vectors the k-means of lambda_orth / uncertainty is fitted on, at most
MANIFEST = "manifest.json"
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


class OrderError(RuntimeError):
    """The order on disk is missing or does not match what the rollout state recorded."""


# ------------------------------------------------------------------------------------------- item hashing
def encode_ids(ids: list[str] | np.ndarray) -> np.ndarray:
    """Item ids as a fixed-width bytes array (UTF-8), the form every file here holds."""
    arr = np.asarray(ids)
    if arr.dtype.kind == "S":
        return arr
    return np.char.encode(arr.astype(str), "utf-8") if arr.size else np.zeros(0, dtype="S1")


def decode_ids(ids: np.ndarray) -> list[str]:
    return [b.decode("utf-8") for b in ids.tolist()]


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


def hash_ids(ids: np.ndarray, seed: int = 0) -> np.ndarray:
    """A seeded 64-bit hash of each item id (FNV-1a over its bytes, then splitmix64), vectorised over the
    ids: one numpy pass per byte of the widest id, no Python object per id."""
    b = encode_ids(ids)
    width = b.dtype.itemsize
    data = np.frombuffer(b.tobytes(), dtype=np.uint8).reshape(len(b), width) if len(b) else np.zeros((0, 1))
    h = np.full(len(b), np.uint64(0xCBF29CE484222325) ^ np.uint64(seed & 0xFFFFFFFFFFFFFFFF), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(data.shape[1]):
            col = data[:, j].astype(np.uint64)
            live = col != 0  # numpy pads shorter ids with NUL bytes, which are not part of the id
            h = np.where(live, ((h ^ col) * np.uint64(0x100000001B3)) & _MASK64, h)
    return _splitmix64(h)


# ------------------------------------------------------------------------------------------------ spill
@dataclass(frozen=True)
class SpillBlock:
    """One block of the plan's read of the collection, on disk."""

    ids: Path
    embedded_at: Path
    vectors: Path | None

    def load(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        vectors = np.load(self.vectors, mmap_mode="r") if self.vectors else None
        return np.load(self.ids), np.load(self.embedded_at), vectors


class Spill:
    """The collection as read once by a plan, in blocks of at most ``block_rows`` items on disk."""

    def __init__(self, directory: Path, block_rows: int | None = None) -> None:
        self.directory, self.block_rows = Path(directory), block_rows or SPILL_ROWS
        self.blocks: list[SpillBlock] = []  # one per block_rows items: bounded by N / block_rows
        self.n_items = 0
        self.dim: int | None = None

    def write(
        self,
        batches: Iterator[list[dict[str, Any]]],
        with_vectors: bool,
        transform: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> Spill:
        """Read ``batches`` of index rows (``item_id``, ``embedded_at``, ``vector`` when ``with_vectors``);
        ``transform`` maps each batch's vectors (the gallery transform F of lambda-orth)."""
        if self.directory.exists():
            shutil.rmtree(self.directory)
        self.directory.mkdir(parents=True)
        ids: list[np.ndarray] = []
        times: list[np.ndarray] = []
        vectors: list[np.ndarray] = []
        held = 0
        for batch in batches:
            if not batch:
                continue
            ids.append(encode_ids([str(r["item_id"]) for r in batch]))
            times.append(np.asarray([int(r["embedded_at"]) for r in batch], dtype=np.int64))
            if with_vectors:
                v = np.asarray([r["vector"] for r in batch], dtype=np.float32)
                vectors.append(np.asarray(transform(v), dtype=np.float32) if transform else v)
            held += len(batch)
            if held >= self.block_rows:
                self._flush(ids, times, vectors)
                held = 0
        self._flush(ids, times, vectors)
        return self

    def _flush(self, ids: list[np.ndarray], times: list[np.ndarray], vectors: list[np.ndarray]) -> None:
        if not ids:
            return
        n = len(self.blocks)
        stem = self.directory / f"block-{n:06d}"
        block = SpillBlock(
            Path(f"{stem}.ids.npy"), Path(f"{stem}.t.npy"), Path(f"{stem}.vec.npy") if vectors else None
        )
        id_block = np.concatenate(ids)
        np.save(block.ids, id_block)
        np.save(block.embedded_at, np.concatenate(times))
        if vectors:
            v = np.concatenate(vectors)
            self.dim = int(v.shape[1])
            np.save(block.vectors, v)
        self.blocks.append(block)
        self.n_items += len(id_block)
        ids.clear(), times.clear(), vectors.clear()

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


# ------------------------------------------------------------------------------------------ sort keys
def _bottom_k_sample(spill: Spill, k: int, seed: int) -> np.ndarray:
    """The vectors of the ``k`` items of smallest seeded id hash: a uniform sample that does not depend on the
    order the index returned rows in; at most ``k`` vectors are held."""
    keep_h = np.zeros(0, dtype=np.uint64)
    keep_v: np.ndarray | None = None
    for block in spill.blocks:
        ids, _, vectors = block.load()
        h = hash_ids(ids, seed)
        cand_h = np.concatenate([keep_h, h])
        cand_v = np.asarray(vectors) if keep_v is None else np.concatenate([keep_v, np.asarray(vectors)])
        if len(cand_h) > k:
            pick = np.argpartition(cand_h, k - 1)[:k]
            cand_h, cand_v = cand_h[pick], cand_v[pick]
        keep_h, keep_v = cand_h, cand_v
    assert keep_v is not None
    return keep_v[np.argsort(keep_h, kind="stable")]


def _nearest(x: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """The index of the nearest centre (L2) of each row, in chunks of bounded size."""
    out = np.empty(len(x), dtype=np.int64)
    c2 = (centres**2).sum(1)
    for s in range(0, len(x), 8192):
        part = np.asarray(x[s : s + 8192], dtype=np.float64)
        out[s : s + len(part)] = np.argmin(c2[None, :] - 2.0 * part @ centres.T, axis=1)
    return out


def _cluster_keys(
    spill: Spill, order: str, seed: int, n_clusters: int | None, sample_rows: int
) -> Iterator[np.ndarray]:
    """Per spill block, the sort key of ``lambda_orth`` or ``uncertainty`` (smaller first)."""
    from compat.backfill import default_n_clusters, kmeans, uncertainty_scores, unit_rows

    sample = np.asarray(_bottom_k_sample(spill, min(sample_rows, spill.n_items), seed), dtype=np.float64)
    k = min(len(sample), n_clusters or default_n_clusters(len(sample)))
    if order == "uncertainty":
        centres, _ = kmeans(unit_rows(sample), k, seed=seed)
        for block in spill.blocks:
            yield -uncertainty_scores(np.asarray(block.load()[2]), centres)
        return
    centres, _ = kmeans(sample, k, seed=seed)
    sums, counts = np.zeros_like(centres), np.zeros(len(centres))
    for block in spill.blocks:  # exact class means mu_c over every member (Sec. 3.6)
        x = np.asarray(block.load()[2], dtype=np.float64)
        labels = _nearest(x, centres)
        np.add.at(sums, labels, x)
        counts += np.bincount(labels, minlength=len(centres))
    means = sums / np.maximum(counts, 1)[:, None]
    for block in spill.blocks:
        x = np.asarray(block.load()[2], dtype=np.float64)
        labels = _nearest(x, centres)
        yield -np.linalg.norm(x - means[labels], axis=1)


def sort_keys(
    spill: Spill, order: str, seed: int, n_clusters: int | None = None, sample_rows: int = SAMPLE_ROWS
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, key) per spill block for backfill order ``order`` (see the module doc); float64 keys."""
    from compat.backfill import ORDERS

    if order not in ORDERS:
        raise ValueError(f"unknown backfill order {order!r}; choose one of {', '.join(ORDERS)}")
    if order in ORDERS_NEEDING_VECTORS:
        if spill.blocks and spill.blocks[0].vectors is None:
            raise ValueError(f"order {order!r} needs the gallery vectors in the spill")
        for block, key in zip(
            spill.blocks, _cluster_keys(spill, order, seed, n_clusters, sample_rows), strict=True
        ):
            yield block.load()[0], key
        return
    for block in spill.blocks:
        ids, times, _ = block.load()
        if order == "random":
            # the top 53 bits, exact in float64: ties between different ids are left to the id itself
            key = (hash_ids(ids, seed) >> np.uint64(11)).astype(np.float64)
        else:
            key = times.astype(np.float64)
        yield ids, key


# ------------------------------------------------------------------------------------------- sort + merge
def _records(ids: np.ndarray, key: np.ndarray, width: int) -> np.ndarray:
    rec = np.empty(len(ids), dtype=[("key", "<f8"), ("id", f"S{width}")])
    rec["key"], rec["id"] = key, ids
    return rec


def _merge_runs(runs: list[Path], write: Callable[[np.ndarray], None], block: int) -> None:
    """k-way merge of sorted record runs on disk, ``block`` records per run in memory at a time: each round
    emits every record no greater than the smallest last-loaded record of a run not yet exhausted."""
    width = max(np.load(p, mmap_mode="r").dtype["id"].itemsize for p in runs)
    dtype = np.dtype([("key", "<f8"), ("id", f"S{width}")])
    files = [np.load(p, mmap_mode="r") for p in runs]
    pos = [0] * len(files)
    bufs = [np.zeros(0, dtype=dtype) for _ in files]

    def refill(i: int) -> None:
        if len(bufs[i]) == 0 and pos[i] < len(files[i]):
            bufs[i] = np.asarray(files[i][pos[i] : pos[i] + block]).astype(dtype)
            pos[i] += len(bufs[i])

    for i in range(len(files)):
        refill(i)
    while any(len(b) for b in bufs):
        live = [i for i, b in enumerate(bufs) if len(b)]
        bounds = [bufs[i][-1] for i in live if pos[i] < len(files[i])]  # runs with more on disk
        if bounds:
            limit = np.sort(np.asarray(bounds, dtype=dtype))[0]
            cuts = {i: int(np.searchsorted(bufs[i], limit, side="right")) for i in live}
        else:
            cuts = {i: len(bufs[i]) for i in live}
        out = np.concatenate([bufs[i][: cuts[i]] for i in live])
        out.sort(kind="stable")
        for i in live:
            bufs[i] = bufs[i][cuts[i] :]
            refill(i)
        write(out["id"])


class _ChunkWriter:
    """Writes ranked ids into chunk files of ``chunk_rows`` and digests them as they pass."""

    def __init__(self, directory: Path, chunk_rows: int) -> None:
        self.directory, self.chunk_rows = directory, chunk_rows
        self.digest = hashlib.sha256()
        self.chunks: list[dict[str, Any]] = []
        self.pending: list[np.ndarray] = []
        self.held = 0

    def __call__(self, ids: np.ndarray) -> None:
        self.pending.append(ids)
        self.held += len(ids)
        while self.held >= self.chunk_rows:
            self._emit(self.chunk_rows)

    def _emit(self, rows: int) -> None:
        ids = np.concatenate(self.pending)
        chunk, rest = ids[:rows], ids[rows:]
        self.pending, self.held = ([rest] if len(rest) else []), len(rest)
        name = f"chunk-{len(self.chunks):06d}.npy"
        np.save(self.directory / name, chunk)
        text = b"\n".join(chunk.tolist()) + b"\n"
        self.digest.update(text)
        self.chunks.append(
            {"file": name, "rows": int(len(chunk)), "sha256": hashlib.sha256(text).hexdigest()}
        )

    def close(self) -> None:
        if self.held:
            self._emit(self.held)


def build_order(
    spill: Spill,
    directory: Path,
    order: str,
    *,
    seed: int = 0,
    n_clusters: int | None = None,
    sample_rows: int | None = None,
    run_rows: int | None = None,
    chunk_rows: int | None = None,
) -> RankedOrder:
    """Rank the items of ``spill`` in backfill order ``order`` into ``directory`` (replaced); see the module
    doc. The sorted runs are removed once merged; the spill is the caller's. Sizes default to the module's
    ``SAMPLE_ROWS``, ``RUN_ROWS`` and ``CHUNK_ROWS``."""
    sample_rows, run_rows, chunk_rows = (
        sample_rows or SAMPLE_ROWS,
        run_rows or RUN_ROWS,
        chunk_rows or CHUNK_ROWS,
    )
    if directory.exists():
        shutil.rmtree(directory)
    runs_dir = directory / "runs"
    runs_dir.mkdir(parents=True)
    runs: list[Path] = []
    pending: list[np.ndarray] = []
    held = 0

    def flush_run() -> None:
        nonlocal held
        if not pending:
            return
        width = max(p.dtype["id"].itemsize for p in pending)  # ids of different widths: cast to the widest
        dtype = np.dtype([("key", "<f8"), ("id", f"S{width}")])
        rec = np.concatenate([p.astype(dtype) for p in pending])
        rec.sort(kind="stable")
        path = runs_dir / f"run-{len(runs):06d}.npy"
        np.save(path, rec)
        runs.append(path)
        pending.clear()
        held = 0

    for ids, key in sort_keys(spill, order, seed, n_clusters, sample_rows):
        for s in range(0, len(ids), run_rows):
            part_ids, part_key = ids[s : s + run_rows], key[s : s + run_rows]
            if held + len(part_ids) > run_rows:
                flush_run()
            pending.append(_records(part_ids, part_key, ids.dtype.itemsize))
            held += len(part_ids)
    flush_run()
    if not runs:
        raise OrderError(f"nothing to order: the collection read into {spill.directory} is empty")
    writer = _ChunkWriter(directory, chunk_rows)
    _merge_runs(runs, writer, block=max(1, min(chunk_rows, run_rows // max(1, len(runs)))))
    writer.close()
    shutil.rmtree(runs_dir)
    manifest = {
        "order": order,
        "seed": seed,
        "n_items": int(sum(c["rows"] for c in writer.chunks)),
        "chunk_rows": chunk_rows,
        "digest": writer.digest.hexdigest(),
        "chunks": writer.chunks,
    }
    write_json_atomic(directory / MANIFEST, manifest)
    log.info("backfill order %s: %d items in %d chunks", order, manifest["n_items"], len(writer.chunks))
    return RankedOrder(directory)


# ------------------------------------------------------------------------------------------------ reader
class RankedOrder:
    """The ids of a backfill order by rank, read from its chunks on disk (verified against the manifest's
    digest as each chunk is first opened; at most ``cache`` chunks kept)."""

    def __init__(self, directory: str | Path, expected_digest: str | None = None, cache: int = 2) -> None:
        self.directory = Path(directory)
        path = self.directory / MANIFEST
        try:
            self.manifest = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise OrderError(f"cannot read the backfill order manifest {path}: {exc}") from exc
        if expected_digest is not None and self.manifest["digest"] != expected_digest:
            raise OrderError(
                f"{path} is the order {self.manifest['digest'][:12]}..., not the "
                f"{expected_digest[:12]}... the "
                "rollout state recorded: the order was replaced; roll back and start again"
            )
        self.chunk_rows = int(self.manifest["chunk_rows"])
        self._cache: dict[int, np.ndarray] = {}
        self._cache_size = cache

    def __len__(self) -> int:
        return int(self.manifest["n_items"])

    @property
    def digest(self) -> str:
        return str(self.manifest["digest"])

    def _chunk(self, n: int) -> np.ndarray:
        if n not in self._cache:
            meta = self.manifest["chunks"][n]
            path = self.directory / meta["file"]
            try:
                ids = np.load(path, allow_pickle=False)
            except OSError as exc:
                raise OrderError(f"cannot read {path} of the backfill order: {exc}") from exc
            if hashlib.sha256(b"\n".join(ids.tolist()) + b"\n").hexdigest() != meta["sha256"]:
                raise OrderError(
                    f"{path} does not match the digest in {self.directory / MANIFEST}: the order file was "
                    "modified; roll back and start again"
                )
            while len(self._cache) >= self._cache_size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[n] = ids
        return self._cache[n]

    def ids(self, start: int, end: int) -> np.ndarray:
        """Ids of ranks ``[start, end)`` as bytes."""
        start, end = max(0, start), min(len(self), end)
        parts = []
        for n in range(start // self.chunk_rows, (end - 1) // self.chunk_rows + 1 if end > start else 0):
            lo = n * self.chunk_rows
            parts.append(self._chunk(n)[max(start - lo, 0) : end - lo])
        return np.concatenate(parts) if parts else np.zeros(0, dtype="S1")

    def __getitem__(self, key: int | slice) -> Any:
        """``order[start:end]`` -> list of item ids; ``order[i]`` -> one id."""
        if isinstance(key, slice):
            if key.step not in (None, 1):
                raise ValueError("a backfill order is read in rank ranges (no step)")
            return decode_ids(self.ids(key.start or 0, len(self) if key.stop is None else key.stop))
        if not 0 <= key < len(self):
            raise IndexError(f"rank {key} outside the order of {len(self)} items")
        return decode_ids(self.ids(key, key + 1))[0]

    def __iter__(self) -> Iterator[list[str]]:
        """The ids chunk by chunk."""
        for n in range(len(self.manifest["chunks"])):
            yield decode_ids(self._chunk(n))
