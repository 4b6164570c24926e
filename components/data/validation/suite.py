"""Great Expectations (1.x) suites over a DataFrame of per-sample facts: ``schemas/expectations/samples.json``
(unexpected rows become quarantine reasons) and ``phase.json`` (aggregates over the accepted samples), policy
bounds entering as suite parameters. GX is imported inside the functions (the import costs about 5 s)."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from components.data.validation.checks import Reason
from schemas import SCHEMA_DIR

logger = logging.getLogger(__name__)

EXPECTATIONS_DIR = SCHEMA_DIR / "expectations"
ROW_ID = "row"
FACT_COLUMNS: dict[str, str] = {  # column -> dtype (Int64: an integer that may be missing)
    **dict.fromkeys((ROW_ID, "shard_index", "sample_index", "members"), "int64"),
    **dict.fromkeys(("image_bytes", "width", "height", "caption_chars", "caption_tokens"), "Int64"),
    **dict.fromkeys(("shard", "key", "image_member", "caption_member", "caption"), "object"),
    **dict.fromkeys(("metadata_member", "metadata_key"), "object"),
}
_PLACEHOLDER = re.compile(r"\{(\w+)\}")
_GX_LOGGERS = ("great_expectations", "great_expectations.data_context.types.base")


@dataclass
class SuiteRun:
    """What one suite found: a record per expectation, and the reasons per unexpected row id."""

    records: list[dict[str, Any]] = field(default_factory=list)
    row_reasons: dict[int, list[Reason]] = field(default_factory=dict)


def facts_frame(rows: list[dict[str, Any]]):
    """The per-sample facts as a pandas DataFrame with stable (nullable) dtypes, also when empty."""
    import pandas as pd

    return pd.DataFrame(rows, columns=list(FACT_COLUMNS)).astype(FACT_COLUMNS)


def suite_path(name: str) -> Path:
    return EXPECTATIONS_DIR / f"{name}.json"


@contextmanager
def _quiet_gx_logging() -> Iterator[None]:
    """GX's warnings and errors only (it logs dozens of INFO lines on import and context creation; one of its
    modules sets its own level to INFO on import, so levels are raised again after the import)."""
    loggers = [logging.getLogger(name) for name in _GX_LOGGERS]
    previous = [log.level for log in loggers]
    loggers[0].setLevel(max(previous[0], logging.WARNING))
    try:
        import great_expectations  # noqa: F401

        for log in loggers:
            log.setLevel(max(log.level, logging.WARNING))
        yield
    finally:
        for log, level in zip(loggers, previous, strict=True):
            log.setLevel(level)


@_quiet_gx_logging()
def run_suite(name: str, frame, parameters: dict[str, Any]) -> SuiteRun:
    """Every result of suite ``name`` on ``frame``; unexpected rows of an expectation with a ``meta.reason``
    become :class:`Reason` s, the meta message filled from the row's facts and ``parameters``."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    _register_custom_expectations()
    path = suite_path(name)
    try:
        suite = gx.ExpectationSuite(**json.loads(path.read_text()))
    except Exception as exc:
        raise ValueError(f"expectation suite {path} cannot be loaded: {exc}") from exc
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    suite = context.suites.add(suite)
    batch = (
        context.data_sources.add_pandas(f"{name}_facts")
        .add_dataframe_asset(name)
        .add_batch_definition_whole_dataframe("whole_frame")
    )
    definition = context.validation_definitions.add(
        gx.ValidationDefinition(name=f"{name}_run", data=batch, suite=suite)
    )
    result = definition.run(
        batch_parameters={"dataframe": frame},
        expectation_parameters=parameters,
        result_format={"result_format": "COMPLETE", "unexpected_index_column_names": [ROW_ID]},
    )
    run = SuiteRun()
    by_row = frame.set_index(ROW_ID, drop=False) if len(frame) else frame
    locations = cache(lambda: _key_locations(frame))  # only a duplicate_key message needs them
    for item in result.results:
        record, rows = _record(name, item)
        run.records.append(record)
        reason = record["reason"]
        if not reason or not rows:
            continue
        template = (item.expectation_config.meta or {}).get("message", reason)
        for row in rows:
            message = _message(template, by_row.loc[row].to_dict(), parameters, locations)
            reasons = run.row_reasons.setdefault(row, [])
            if Reason(reason, message) not in reasons:
                reasons.append(Reason(reason, message))
    return run


def _record(suite: str, item) -> tuple[dict[str, Any], list[int]]:
    """A JSON-ready record of one expectation result, and its unexpected row ids."""
    config = item.expectation_config
    result = item.result or {}
    exception = _exception_text(item.exception_info)
    kwargs = {k: v for k, v in (config.kwargs or {}).items() if k not in ("result_format", "batch_id")}
    rows = [int(entry[ROW_ID]) for entry in result.get("unexpected_index_list") or []]
    count = result.get("unexpected_count")
    if count is not None and len(rows) != count and (config.meta or {}).get("reason"):
        exception = exception or f"{count} unexpected values but {len(rows)} unexpected rows reported"
    record = {
        "suite": suite,
        "type": config.type,
        "column": kwargs.get("column")
        or (f"{kwargs['column_A']},{kwargs['column_B']}" if "column_A" in kwargs else None),
        "kwargs": jsonable(kwargs),
        "reason": (config.meta or {}).get("reason"),
        "success": bool(item.success) and exception is None,
        "observed_value": jsonable(result.get("observed_value")),
        "element_count": result.get("element_count"),
        "unexpected_count": count,
        "unexpected_percent": jsonable(result.get("unexpected_percent")),
        "exception": exception,
    }
    return record, rows


def _exception_text(info: dict | None) -> str | None:
    """GX reports exceptions either flat or keyed by metric; any raised one is returned as text."""
    if not info:
        return None
    entries = [info] if "raised_exception" in info else [v for v in info.values() if isinstance(v, dict)]
    messages = [str(e.get("exception_message") or "exception") for e in entries if e.get("raised_exception")]
    return "; ".join(messages) or None


def _key_locations(frame) -> dict[str, list[str]]:
    """``shard#sample_index`` of every occurrence of each key that occurs more than once."""
    dup = frame[frame["key"].duplicated(keep=False)]
    found: dict[str, list[str]] = {}
    for shard, index, key in zip(dup["shard"], dup["sample_index"], dup["key"], strict=True):
        found.setdefault(key, []).append(f"{shard}#{index}")
    return found


def _message(template: str, facts: dict[str, Any], parameters: dict[str, Any], locations: Any) -> str:
    """A reason's message: each ``{name}`` of ``template`` filled from the row's facts, the suite parameters,
    or (``key_count``, ``key_locations``) where the row's key occurs."""

    def fill(match: re.Match) -> str:
        name = match.group(1)
        if name in ("key_count", "key_locations"):
            found = locations().get(facts["key"], [])
            if name == "key_count":
                return str(len(found))
            return ", ".join(found[:5]) + (f", ... {len(found) - 5} more" if len(found) > 5 else "")
        value = facts.get(name, parameters.get(name, match.group(0)))
        return "null" if value is None or _is_missing(value) else str(value)

    return _PLACEHOLDER.sub(fill, template)


def _is_missing(value: Any) -> bool:
    import pandas as pd

    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def jsonable(value: Any) -> Any:
    """Plain JSON values: numpy scalars unwrapped, NaN and infinities as null, tuples as lists."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (str, bytes)):
        try:
            value = value.item()
        except (TypeError, ValueError):
            return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return None if _is_missing(value) else str(value)


@lru_cache(maxsize=1)
def _register_custom_expectations() -> type:
    """Register ``expect_column_quantile_values_in_ranges`` (``phase.json``): the built-in quantile
    expectation with plain-bool results, since under NumPy 2 its ``numpy.bool_`` breaks GX 1.24's store."""
    import great_expectations.expectations as gxe

    class ExpectColumnQuantileValuesInRanges(gxe.ExpectColumnQuantileValuesToBeBetween):
        """Expect the column quantiles to fall in the given ranges (plain-bool results)."""

        def _validate(self, metrics, runtime_configuration=None, execution_engine=None):
            outcome = super()._validate(metrics, runtime_configuration, execution_engine)
            outcome["success"] = bool(outcome["success"])
            details = outcome["result"].get("details", {})
            details["success_details"] = [bool(v) for v in details.get("success_details", [])]
            return outcome

    return ExpectColumnQuantileValuesInRanges
