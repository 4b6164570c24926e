"""The validation policy: the bounds a data phase must meet, as a typed model from which
``schemas/validation_policy.schema.json`` is generated (``make schemas``), reaching the expectation suites as
GX suite parameters, so one suite file serves every policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from compat.data.images import MAX_PIXELS
from compat.data.importer import MAX_CAPTION_BYTES
from components.data.validation.shard_reader import MemberLimits
from components.state.documents import validated

_READ_LIMITS = {  # policy field -> the shard reader's bound (shard_reader.MemberLimits)
    "max_caption_bytes": "caption_bytes",
    "max_metadata_bytes": "metadata_bytes",
    "max_image_bytes": "image_bytes",
    "max_other_member_bytes": "other_bytes",
    "max_expansion": "max_expansion",
}
_CONFIG = ConfigDict(
    extra="forbid", frozen=True, strict=True, allow_inf_nan=False, use_attribute_docstrings=True
)
Fraction = Annotated[float, Field(ge=0, le=1)]
Positive = Annotated[int, Field(ge=1)]
Count = Annotated[int, Field(ge=0)]


class QuantileRanges(BaseModel):
    """Caption-length quantiles of the accepted samples and the range each must fall in (null: unbounded)."""

    model_config = _CONFIG
    quantiles: list[Fraction] = Field(min_length=1)
    value_ranges: list[Annotated[list[float | None], Field(min_length=2, max_length=2)]] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_range_per_quantile(self) -> QuantileRanges:
        if len(self.quantiles) != len(self.value_ranges):
            raise ValueError("caption_chars_quantile_ranges needs one value range per quantile")
        return self


class ValidationPolicy(BaseModel):
    """Bounds for `compatflow validate --policy FILE` (JSON or YAML); a field left out keeps its default. They
    reach the expectation suites in schemas/expectations/ as suite parameters of the same name."""

    model_config = ConfigDict(**_CONFIG, title="Validation policy of a data phase")
    max_quarantined_fraction: Fraction = 0.05
    """The phase is blocked when quarantined / total exceeds this."""
    min_width: Positive = 16
    max_width: Positive = 16384
    min_height: Positive = 16
    max_height: Positive = 16384
    """Images whose header declares a larger size are rejected without being decoded."""
    max_pixels: int = Field(MAX_PIXELS, ge=1, le=MAX_PIXELS)
    """Images whose header declares more pixels (width x height) are quarantined (image_pixels) undecoded; no
    reader decodes more than MAX_PIXELS: import bigger pictures with `compatflow data import --max-side`."""
    min_caption_chars: Positive = 1
    """Minimum caption length in characters (Unicode code points), for non-empty captions."""
    max_caption_chars: Positive = 1000
    min_samples: Count = 1
    """Minimum number of accepted samples in the phase."""
    max_samples: Count | None = None
    """Maximum number of accepted samples in the phase (null: unbounded)."""
    caption_chars_mean_min: float = Field(3.0, ge=0)
    caption_chars_mean_max: float = Field(500.0, ge=0)
    caption_chars_quantile_ranges: QuantileRanges = QuantileRanges(
        quantiles=[0.05, 0.5, 0.95], value_ranges=[[1.0, None], [3.0, 500.0], [None, 1000.0]]
    )
    max_problems_listed: Count = 1000
    """At most this many per-sample problems are listed in validation.json (all are in the quarantine)."""
    max_caption_tokens: int = Field(77, ge=3)
    """The text tower's context in CLIP BPE tokens, start and end included (the pipeline sets its model's): a
    longer caption is cut there, counted (captions.over_context in validation.json), not quarantined."""
    max_over_context_fraction: Fraction = 0.1
    """Phase expectation: the share of accepted captions over max_caption_tokens must not exceed this."""
    max_caption_bytes: Positive = MAX_CAPTION_BYTES
    """Largest .txt member read (checked from its tar header; a larger one is quarantined unread)."""
    max_metadata_bytes: Positive = 1 << 20
    """Largest .json member read (checked from its tar header)."""
    max_image_bytes: Positive = 32 << 20
    """Largest image member (.jpg/.jpeg/.png/.webp) read (checked from its tar header)."""
    max_other_member_bytes: Positive = 32 << 20
    """Largest member of any other extension read (checked from its tar header)."""
    max_expansion: float = Field(100.0, gt=1)
    """A compressed shard (.gz/.bz2/.xz) expanding past this many times its size (and 64 MiB) is refused."""

    @model_validator(mode="after")
    def _low_not_above_high(self) -> ValidationPolicy:
        bounds = [(f"min_{name}", f"max_{name}") for name in ("width", "height", "caption_chars", "samples")]
        for low, high in [*bounds, ("caption_chars_mean_min", "caption_chars_mean_max")]:
            if getattr(self, high) is not None and getattr(self, low) > getattr(self, high):
                raise ValueError(f"{low}={getattr(self, low)} exceeds {high}={getattr(self, high)}")
        return self

    def suite_parameters(self) -> dict[str, Any]:
        """Values for the ``$PARAMETER`` placeholders of the expectation suites."""
        judged_elsewhere = {"max_quarantined_fraction", "max_problems_listed", "max_over_context_fraction"}
        parameters = self.model_dump(mode="json", exclude=judged_elsewhere | set(_READ_LIMITS))
        return {**parameters, "min_within_context_fraction": 1.0 - self.max_over_context_fraction}

    def member_limits(self) -> MemberLimits:
        """The shard reader's bounds."""
        return MemberLimits(**{bound: getattr(self, name) for name, bound in _READ_LIMITS.items()})

    def replace(self, **changes: Any) -> ValidationPolicy:
        """A copy with ``changes``, checked (``model_copy`` would not): a bad one raises ``SchemaError``."""
        return validated(ValidationPolicy, {**self.model_dump(), **changes}, "validation policy")


def load_validation_policy(path: Path | str) -> ValidationPolicy:
    """Read a policy file (JSON, or YAML for ``.yaml``/``.yml``); fields left out keep their defaults. A bad
    field raises :class:`schemas.SchemaError` naming the file and the field."""
    path = Path(path)
    loads = yaml.safe_load if path.suffix.lower() in (".yaml", ".yml") else json.loads
    try:
        document = loads(path.read_text())
    except OSError as exc:
        raise FileNotFoundError(f"cannot read validation policy {path}: {exc.strerror or exc}") from exc
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError
        raise ValueError(f"validation policy {path} cannot be parsed: {exc}") from exc
    return validated(ValidationPolicy, document, str(path))
