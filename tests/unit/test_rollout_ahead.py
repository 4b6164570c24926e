"""Batches prepared ahead of the writes (components.rollout.ahead): order, the look-ahead past a stage's end,
plan changes, failures."""

from __future__ import annotations

import threading
import time

import pytest

from components.rollout.ahead import BatchesAhead


class Recorder:
    """prepare/encode that record which thread ran them and which batches they saw."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.prepared: list[tuple[int, int]] = []
        self.encoded: list[tuple[int, int]] = []
        self.threads: dict[str, set[int]] = {"prepare": set(), "encode": set()}
        self.fail_at = fail_at
        self.lock = threading.Lock()

    def prepare(self, batch: tuple[int, int]) -> tuple[int, int]:
        self.threads["prepare"].add(threading.get_ident())
        self.prepared.append(batch)
        return batch

    def encode(self, batch: tuple[int, int]) -> list[int]:
        self.threads["encode"].add(threading.get_ident())
        if batch[0] == self.fail_at:
            raise RuntimeError(f"encoder failed on {batch}")
        with self.lock:
            self.encoded.append(batch)
        return list(range(*batch))

    def wait_encoded(self, n: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.encoded) < n and time.monotonic() < deadline:
            time.sleep(0.005)


STAGE1 = [(0, 4), (4, 8)]
STAGE2 = [(8, 12), (12, 16), (16, 20), (20, 24)]


def test_batches_come_in_plan_order_prepared_here_and_encoded_on_the_worker() -> None:
    rec = Recorder()
    with BatchesAhead(rec.prepare, rec.encode, depth=2) as ahead:
        ahead.plan(STAGE1 + STAGE2)
        got = [ahead.next() for _ in range(6)]
        with pytest.raises(IndexError):
            ahead.next()
    assert [b for b, _ in got] == STAGE1 + STAGE2
    assert [rows for _, rows in got] == [list(range(*b)) for b in STAGE1 + STAGE2]
    assert rec.threads["prepare"] == {threading.get_ident()}
    assert len(rec.threads["encode"]) == 1 and threading.get_ident() not in rec.threads["encode"]


def test_the_next_stage_is_encoded_while_this_one_is_flushed_and_probed() -> None:
    """After the last batch of stage 1 is taken, ``depth`` batches of stage 2 are encoded without any
    further call, and no more than that."""
    rec = Recorder()
    with BatchesAhead(rec.prepare, rec.encode, depth=2) as ahead:
        ahead.plan(STAGE1 + STAGE2)
        for _ in STAGE1:
            ahead.next()
        rec.wait_encoded(4)  # stage 1's two batches and stage 2's first two
        time.sleep(0.05)
        assert rec.encoded == STAGE1 + STAGE2[:2]
        # stage 2 starts: the same plan again, from its cursor: nothing is prepared twice
        ahead.plan(STAGE2)
        assert [ahead.next()[0] for _ in STAGE2] == STAGE2
    assert rec.prepared == STAGE1 + STAGE2


def test_a_plan_that_does_not_continue_drops_what_was_prepared() -> None:
    rec = Recorder()
    with BatchesAhead(rec.prepare, rec.encode, depth=2) as ahead:
        ahead.plan(STAGE1 + STAGE2)
        ahead.next()
        ahead.plan([(0, 4), (4, 8)])  # e.g. a restored stage that runs again
        assert [ahead.next()[0] for _ in range(2)] == [(0, 4), (4, 8)]
    assert rec.prepared.count((0, 4)) == 2


def test_an_encoder_failure_surfaces_at_its_batch() -> None:
    rec = Recorder(fail_at=4)
    with BatchesAhead(rec.prepare, rec.encode, depth=3) as ahead:
        ahead.plan(STAGE1 + STAGE2)
        assert ahead.next()[0] == (0, 4)
        with pytest.raises(RuntimeError, match=r"encoder failed on \(4, 8\)"):
            ahead.next()


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="depth must be >= 1"):
        BatchesAhead(lambda b: b, lambda b: b, depth=0)
