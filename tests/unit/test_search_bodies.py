"""`POST /search` answers any body with a result or a 4xx naming what is wrong, never a 5xx: the bounds are
checked before the index is asked (an index given an out-of-range integer answers with a server error)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from components.serving.limits import MAX_K, MAX_PHASES


class _Index:
    """A served pair whose index refuses, as Milvus does, an integer outside 64 bits in a filter."""

    version, collection = "1", "gallery_v1"

    def search(self, queries: list[str], k: int, filter: str | None = None, **_: Any) -> list[list[Any]]:
        for number in re.findall(r"-?\d+", filter or ""):
            if not -(2**63) <= int(number) < 2**63:
                raise OverflowError(f"{number[:20]}... does not fit a 64-bit integer")
        return [[] for _ in queries]


class _Follower:
    error = None

    def refresh(self) -> None:
        return None

    def watch(self, _interval: float) -> SimpleNamespace:
        return SimpleNamespace(close=lambda: None)

    def close(self) -> None:
        return None

    def answer(self, query: Any) -> tuple[Any, _Index]:
        pair = _Index()
        return query(pair), pair


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    """One app for the module: hypothesis runs every example of a test with the same fixtures."""
    from fastapi.testclient import TestClient

    from components.serving.app import create_app

    with TestClient(create_app("serving.json", follower=_Follower())) as test_client:
        yield test_client


def post(test_client: Any, body: str) -> tuple[int, dict[str, Any]]:
    answer = test_client.post("/search", content=body, headers={"content-type": "application/json"})
    return answer.status_code, answer.json()


def test_out_of_range_integers_are_422_naming_the_field(client: Any) -> None:
    for body, field in (
        ('{"queries": ["a"], "phases": [%s]}' % ("9" * 400), "phases.0"),
        ('{"queries": ["a"], "phases": [-1]}', "phases.0"),
        (json.dumps({"queries": ["a"], "phases": list(range(MAX_PHASES + 1))}), "phases"),
        ('{"queries": ["a"], "k": %s}' % ("9" * 400), "k"),
        (json.dumps({"queries": ["a"], "k": MAX_K + 1}), "k"),
    ):
        status, answer = post(client, body)
        assert status == 422 and answer["detail"].startswith(f"{field}: "), (body[:60], answer)
    assert post(client, '{"queries": ["a"], "phases": [0, 3], "k": 5}') == (
        200,
        {"results": [[]], "model_version": "1", "collection": "gallery_v1"},
    )


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats()
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_BODIES = st.fixed_dictionaries(
    {},
    optional={
        "queries": st.lists(st.text(max_size=30), max_size=4) | _JSON,
        "k": st.integers(min_value=-5, max_value=2 * MAX_K) | _JSON,
        "phases": st.lists(st.integers() | st.integers(min_value=0, max_value=10**400), max_size=4) | _JSON,
        "thumbnails": st.booleans() | _JSON,
        "other": _JSON,
    },
)


@given(body=_BODIES | _JSON)
def test_any_body_gets_a_result_or_a_refusal_naming_its_reason(client: Any, body: Any) -> None:
    status, answer = post(client, json.dumps(body))
    assert status in (200, 400, 422), (status, answer)
    if status != 200:
        assert isinstance(answer.get("detail"), str) and answer["detail"], answer
