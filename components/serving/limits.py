"""The bounds of a search, the same in the library, the CLI and the HTTP service. A query of more than a
few thousand characters says nothing more to a 77-token text tower, so it is refused rather than cut."""

from __future__ import annotations

from collections.abc import Sequence

MAX_K = 1000  # hits per query
MAX_QUERIES = 256  # query texts per request
MAX_QUERY_CHARS = 2048  # characters per query text
MAX_PHASES = 1000  # data phases a search may name
MAX_PHASE = 2**63 - 1  # a data phase number: the index stores it as a 64-bit integer
MAX_BODY_BYTES = 1 << 20  # bytes of a POST /search body (413 beyond)
# A body over MAX_BODY_BYTES is drained before the 413 (see app.BodyLimit) up to these bounds.
MAX_DRAIN_BYTES = 256 << 20
DRAIN_SECONDS = 10.0
DRAIN_IDLE_SECONDS = 1.0
BODY_READ_SECONDS = 30.0  # a body not arrived this long after the request began is a 408


class QueryBoundError(ValueError):
    """A search asked for more than a bound allows; the message names the field and the bound."""


def check_search(texts: Sequence[str], k: int) -> None:
    """Raise :class:`QueryBoundError` naming ``k`` or ``queries`` when a search exceeds a bound."""
    if not 1 <= k <= MAX_K:
        raise QueryBoundError(f"k must be between 1 and {MAX_K}, got {k}")
    if len(texts) > MAX_QUERIES:
        raise QueryBoundError(f"queries: {len(texts)} texts, at most {MAX_QUERIES} per search")
    long = [i for i, text in enumerate(texts) if len(text) > MAX_QUERY_CHARS]
    if long:
        raise QueryBoundError(
            f"queries{long[:5]}: over {MAX_QUERY_CHARS} characters (the text tower reads 77 tokens)"
        )
