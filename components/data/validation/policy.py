"""The validation policy: the bounds a data phase must meet (``schemas/validation_policy.schema.json``),
reaching the expectation suites as GX suite parameters, so one suite file serves every policy."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from compat.data.importer import MAX_CAPTION_BYTES
from components.data.validation.shard_reader import MemberLimits
from schemas import validate


def _default_quantile_ranges() -> dict[str, list]:
    return {"quantiles": [0.05, 0.5, 0.95], "value_ranges": [[1, None], [3, 500], [None, 1000]]}


_READ_LIMITS = {  # policy field -> the shard reader's bound (shard_reader.MemberLimits)
    "max_caption_bytes": "caption_bytes",
    "max_metadata_bytes": "metadata_bytes",
    "max_image_bytes": "image_bytes",
    "max_other_member_bytes": "other_bytes",
    "max_expansion": "max_expansion",
}


@dataclass(frozen=True)
class ValidationPolicy:
    """Per-sample bounds, per-phase bounds and the blocking threshold of the validation stage."""

    max_quarantined_fraction: float = 0.05
    min_width: int = 16
    max_width: int = 16384
    min_height: int = 16
    max_height: int = 16384
    max_pixels: int = 40_000_000  # width x height from the header, before decoding (MAX_PIXELS at most)
    min_caption_chars: int = 1
    max_caption_chars: int = 1000
    min_samples: int = 1
    max_samples: int | None = None
    caption_chars_mean_min: float = 3.0
    caption_chars_mean_max: float = 500.0
    caption_chars_quantile_ranges: dict[str, list] = field(default_factory=_default_quantile_ranges)
    max_problems_listed: int = 1000
    max_caption_tokens: int = 77  # the text tower's context: CLIP BPE tokens, start and end included
    max_over_context_fraction: float = 0.1  # share of captions cut at the context that still passes
    max_caption_bytes: int = MAX_CAPTION_BYTES  # read only when the tar header declares at most this
    max_metadata_bytes: int = 1 << 20
    max_image_bytes: int = 32 << 20
    max_other_member_bytes: int = 32 << 20
    max_expansion: float = 100.0  # a compressed shard may decompress to this many times its size

    def __post_init__(self) -> None:
        validate(self.to_dict(), "validation_policy", source="validation policy")
        for low, high in (
            ("min_width", "max_width"),
            ("min_height", "max_height"),
            ("min_caption_chars", "max_caption_chars"),
            ("min_samples", "max_samples"),
            ("caption_chars_mean_min", "caption_chars_mean_max"),
        ):
            if getattr(self, high) is not None and getattr(self, low) > getattr(self, high):
                raise ValueError(
                    f"validation policy: {low}={getattr(self, low)} exceeds {high}={getattr(self, high)}"
                )
        ranges = self.caption_chars_quantile_ranges
        if len(ranges["quantiles"]) != len(ranges["value_ranges"]):
            raise ValueError(
                "validation policy: caption_chars_quantile_ranges needs one value range per quantile"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def suite_parameters(self) -> dict[str, Any]:
        """Values for the ``$PARAMETER`` placeholders of the expectation suites."""
        judged_elsewhere = ("max_quarantined_fraction", "max_problems_listed", "max_over_context_fraction")
        skip = (*judged_elsewhere, *_READ_LIMITS)
        parameters = {k: v for k, v in self.to_dict().items() if k not in skip}
        parameters["min_within_context_fraction"] = 1.0 - self.max_over_context_fraction
        return parameters

    def member_limits(self) -> MemberLimits:
        """The shard reader's bounds."""
        return MemberLimits(**{bound: getattr(self, name) for name, bound in _READ_LIMITS.items()})

    def replace(self, **changes: Any) -> ValidationPolicy:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, document: dict[str, Any], source: str = "validation policy") -> ValidationPolicy:
        """Build a policy from a (partial) mapping; unknown or ill-typed fields raise ``SchemaError``."""
        validate(document, "validation_policy", source=source)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in document.items() if k in known})


def load_validation_policy(path: Path | str) -> ValidationPolicy:
    """Read a policy file (JSON, or YAML for ``.yaml``/``.yml``); fields left out keep their defaults."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise FileNotFoundError(f"cannot read validation policy {path}: {exc.strerror or exc}") from exc
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            document = yaml.safe_load(text)
        else:
            document = json.loads(text)
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError
        raise ValueError(f"validation policy {path} cannot be parsed: {exc}") from exc
    if not isinstance(document, dict):
        raise ValueError(
            f"validation policy {path} must hold a mapping of fields, got {type(document).__name__}"
        )
    return ValidationPolicy.from_dict(document, source=str(path))
