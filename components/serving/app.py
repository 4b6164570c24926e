"""The HTTP search service (FastAPI): ``POST /search``, ``GET /healthz``, ``/readyz`` and ``/metrics``.

Bad input and the bounds of :mod:`components.serving.limits` are 422s whose ``detail`` names the field; a
body over ``MAX_BODY_BYTES`` is a 413 (:class:`BodyLimit`). No ``from __future__ import annotations`` here:
FastAPI reads the request model from the endpoint's annotations."""

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Annotated, Any

import prometheus_client as prometheus
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel, Field, field_validator
from starlette.exceptions import HTTPException

from components.serving import limits

log = logging.getLogger(__name__)

CLOSE = {"Connection": "close"}  # the connection ends with a 413, its body drained (BodyLimit) or not
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)


class _RolloutCollector:
    """Rollout gauges read from the rollout state file at scrape time (absent when there is no rollout)."""

    def __init__(self, state_path: Path | None) -> None:
        self.state_path = state_path

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        if self.state_path is None or not self.state_path.is_file():
            return
        from components.state.rollout_document import RolloutState

        try:  # the rollout's own document (the rollout engine sits above the service)
            state = RolloutState.read(self.state_path, ValueError)
        except Exception as exc:  # noqa: BLE001 - a state being rewritten or damaged: no gauges this scrape
            log.warning("rollout state %s unreadable for metrics: %s", self.state_path, exc)
            return
        if state is None:
            return
        probed = [s.probe for s in state.stages if s.probe]
        last = probed[-1]["R@1"] if probed else (state.curve[-1].t2i_r1 if state.curve else None)
        labels = [state.rollout_id, state.status]
        gauges = {
            "compatflow_rollout_stage": ("Backfill stage of the rollout", state.stage),
            "compatflow_rollout_fraction_backfilled": (
                "Fraction of the gallery backfilled",
                state.fraction_backfilled,
            ),
            "compatflow_rollout_probe_recall_at_1": ("R@1 (%) of the last rollout probe", last),
        }
        for name, (text, value) in gauges.items():
            if value is not None:
                family = GaugeMetricFamily(name, text, labels=["rollout_id", "status"])
                family.add_metric(labels, float(value))
                yield family


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes (declared, or as received) is a 413 that closes
    the connection, a body not arrived ``body_seconds`` after the request began a 408. The rest of an
    oversized body is drained first within the drain bounds, so that a client that sends its whole body
    before it reads (urllib, http.client) reads the 413 instead of a connection reset."""

    def __init__(
        self, app: Any, limit: int = limits.MAX_BODY_BYTES, body_seconds: float = limits.BODY_READ_SECONDS
    ) -> None:
        self.app, self.limit, self.body_seconds = app, limit, body_seconds

    async def _drain(self, receive: Any, received: int) -> int:
        """Read and discard the body up to its end or a bound; the bytes received by then."""
        deadline = time.monotonic() + limits.DRAIN_SECONDS
        while received <= limits.MAX_DRAIN_BYTES:
            left = min(limits.DRAIN_IDLE_SECONDS, deadline - time.monotonic())
            if left <= 0:
                break
            try:
                message = await asyncio.wait_for(receive(), left)
            except TimeoutError:
                break
            if message["type"] != "http.request":  # the client went away
                break
            received += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        return received

    def _too_large(self, what: str) -> str:
        return f"request body {what}, over the limit of {self.limit} bytes: send fewer or shorter queries"

    async def _answer(self, send: Any, status: int, detail: str) -> None:
        body = json.dumps({"detail": detail}).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            waits = headers.get(b"expect", b"").lower() == b"100-continue"
            if declared.isdigit() and int(declared) <= limits.MAX_DRAIN_BYTES and not waits:
                await self._drain(receive, 0)
            await self._answer(send, 413, self._too_large(f"of {declared.decode(errors='replace')} bytes"))
            return
        received, started, body_done = 0, False, False
        deadline = time.monotonic() + self.body_seconds

        async def limited_receive() -> dict[str, Any]:
            nonlocal received, body_done
            if body_done:  # after the body: a wait for the client's disconnect, unbounded
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                detail = (
                    f"request body not received within {self.body_seconds:g} s ({received} bytes arrived): "
                    "send the whole body at once"
                )
                raise HTTPException(408, detail, CLOSE) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:  # an HTTPException passes FastAPI's body parsing as it is
                    if message.get("more_body", False):
                        await self._drain(receive, received)
                    raise HTTPException(413, self._too_large(f"of more than {self.limit} bytes"), CLOSE)
            return message

        async def watched_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except HTTPException as exc:  # raised outside a route (no handler answered it)
            if exc.status_code not in (408, 413) or started:
                raise
            await self._answer(send, exc.status_code, exc.detail)


class SearchRequest(BaseModel):
    queries: list[Annotated[str, Field(max_length=limits.MAX_QUERY_CHARS)]] = Field(
        min_length=1, max_length=limits.MAX_QUERIES, description="Query texts."
    )
    k: int = Field(10, ge=1, le=limits.MAX_K, description="Hits per query.")
    phases: list[Annotated[int, Field(ge=0, le=limits.MAX_PHASE)]] | None = Field(
        None, max_length=limits.MAX_PHASES, description="Only items of these data phases."
    )
    thumbnails: bool = Field(False, description="Add each hit's thumbnail (a JPEG data URI).")

    @field_validator("queries")
    @classmethod
    def _words(cls, value: list[str]) -> list[str]:
        empty = [i for i, text in enumerate(value) if not text.strip()]
        if empty:
            raise ValueError(f"queries{empty[:5]} empty: give words to search for")
        return value


class _Metrics:
    """The service's own Prometheus series, in a registry of their own beside the standard collectors."""

    def __init__(self, state_path: Path | None) -> None:
        self.registry = registry = prometheus.CollectorRegistry()
        registry.register(prometheus.PROCESS_COLLECTOR)  # process_*
        registry.register(prometheus.PLATFORM_COLLECTOR)  # python_info
        registry.register(prometheus.GC_COLLECTOR)  # python_gc_*
        self.latency = prometheus.Histogram(
            "compatflow_query_latency_seconds",
            "Search latency per request (embedding, index search, captions and any thumbnails)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queries = prometheus.Counter("compatflow_queries", "Query texts answered", registry=registry)
        self.errors = prometheus.Counter(
            "compatflow_query_errors",
            "Search requests failed on the server side",
            ["kind"],
            registry=registry,
        )
        self.serving = prometheus.Gauge(
            "compatflow_serving_model_info",
            "1 for the query model version and collection serving now",
            ["version", "collection"],
            registry=registry,
        )
        self.swaps = prometheus.Counter(
            "compatflow_serving_swaps", "Query model and collection swaps", registry=registry
        )
        registry.register(_RolloutCollector(state_path))

    def on_swap(self, old: Any, new: Any) -> None:
        """The follower's swap callback: count the swap and move the serving gauge to the new pair."""
        if old is not None and (old.version, old.collection) == (new.version, new.collection):
            return
        if old is not None:
            self.swaps.inc()
            with contextlib.suppress(KeyError):
                self.serving.remove(old.version, old.collection)
        self.serving.labels(new.version, new.collection).set(1)


def search(body: SearchRequest, request: Request) -> Any:
    from components.serving.record import ServingError

    state = request.app.state
    t0 = time.perf_counter()
    try:
        expr = f"phase in {sorted(set(body.phases))}" if body.phases else None
        hits, pair = state.follower.answer(
            lambda p: p.search(body.queries, body.k, filter=expr, output_fields=("source_uri",))
        )
        uris = [h.fields.get("source_uri") for row in hits for h in row]
        texts = state.captions.lookup(uris)
        pictures = state.thumbnails.lookup(uris) if body.thumbnails else None
    except Exception as exc:
        kind = type(exc).__name__
        state.metrics.errors.labels(kind).inc()
        if isinstance(exc, ServingError):  # no record yet, or a record that cannot be loaded: said once
            log.warning("search failed: %s", exc)
        else:
            log.exception("search failed")
        return JSONResponse(status_code=503, content={"detail": f"search failed ({kind}): {exc}"})
    it, shown = iter(texts), iter(pictures or ())
    results = [
        [
            {"id": h.item_id, "score": h.score, "caption": next(it), "model_version": h.model_version}
            | ({"thumbnail": next(shown)} if pictures is not None else {})
            for h in row
        ]
        for row in hits
    ]
    state.metrics.latency.observe(time.perf_counter() - t0)
    state.metrics.queries.inc(len(body.queries))
    return {"results": results, "model_version": pair.version, "collection": pair.collection}


def healthz() -> dict[str, str]:
    return {"status": "ok"}


def readyz(request: Request) -> Any:
    follow = request.app.state.follower
    try:
        pair = follow.current()  # the record as it is now: loaded, or why it cannot be
    except Exception as exc:  # noqa: BLE001 - nothing to serve yet: not ready, say why
        return JSONResponse(status_code=503, content={"ready": False, "detail": str(exc)})
    try:
        reachable = pair.index.has_collection(pair.collection)
    except Exception as exc:  # noqa: BLE001 - the index is down: not ready, say why
        return JSONResponse(status_code=503, content={"ready": False, "detail": f"index unreachable: {exc}"})
    body = {"ready": reachable, "model_version": pair.version, "collection": pair.collection}
    if not reachable:
        body["detail"] = f"collection {pair.collection!r} is gone from {pair.index.uri}"
    elif follow.error:
        body.update(ready=False, detail=f"serving record changed but cannot be followed: {follow.error}")
    return JSONResponse(status_code=200 if body["ready"] else 503, content=body)


def metrics(request: Request) -> Any:
    return PlainTextResponse(
        prometheus.generate_latest(request.app.state.metrics.registry),
        media_type=prometheus.CONTENT_TYPE_LATEST,
    )


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    """A 422 whose detail names each bad field (``phases.0: ...``) in one line."""
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        problems.append(f"{where}: {err.get('msg', 'invalid')}")
    return JSONResponse(status_code=422, content={"detail": "; ".join(problems)})


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    follow = app.state.follower
    try:
        follow.refresh()
    except Exception as exc:  # noqa: BLE001 - not ready yet: /readyz says why, the watcher keeps trying
        log.warning("not ready: %s", exc)
    follow.watch(app.state.watch_interval_s)
    yield
    follow.close()


def create_app(
    record_path: str | os.PathLike[str],
    *,
    state_path: str | os.PathLike[str] | None = None,
    uri: str | None = None,
    watch_interval_s: float = 0.25,
    follower: Any = None,
    verify: Any = None,
    lineage_repo: str | os.PathLike[str] | None = None,
) -> Any:
    """The FastAPI app serving the record at ``record_path`` (``uri``, ``verify``: see
    :class:`~components.serving.pair.PairFollower`; ``lineage_repo``: the Feast repo answering captions of
    shards not cached yet)."""
    from components.serving.captions import ShardCaptions, lineage_captions
    from components.serving.pair import PairFollower
    from components.serving.thumbnails import ShardThumbnails

    app = FastAPI(title="compatflow search", lifespan=_lifespan)
    app.add_middleware(BodyLimit)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_api_route("/search", search, methods=["POST"])
    for path, route in (("/healthz", healthz), ("/readyz", readyz), ("/metrics", metrics)):
        app.add_api_route(path, route, methods=["GET"])
    state = app.state
    state.metrics = _Metrics(Path(state_path) if state_path else None)
    state.follower = follower or PairFollower(
        record_path, uri=uri, on_swap=state.metrics.on_swap, verify=verify
    )
    state.watch_interval_s = watch_interval_s
    root = Path(record_path).parent  # the workspace: gallery rows name its shards relative to it
    fallback = lineage_captions(str(lineage_repo)) if lineage_repo else None
    state.captions = ShardCaptions(fallback=fallback, root=root)
    state.thumbnails = ShardThumbnails(root=root)
    return app
