"""A compatibility report and the validation and drift summaries the gate reads, as a run writes them."""

from __future__ import annotations


def _pair(r1: float, r5: float, r10: float) -> dict[str, float]:
    return {"R@1": r1, "R@5": r5, "R@10": r10}


VALIDATION_OK = {
    "total": 1000,
    "passed": 990,
    "quarantined": 10,
    "by_reason": {"blank_caption": 10},
    "blocked": False,
    "blocked_reasons": [],
}


DRIFT_OK = {
    "verdicts": {
        "caption_length": {"drift": False, "score": 0.1, "severity": "none"},
        "image_embedding": {"drift": True, "score": 0.3, "severity": "low"},
    },
    "severity": "low",
    "html_report": "drift.html",
}


def make_report() -> dict:
    """A report that clears the default policy in both directions."""
    retrieval = {
        "t2i": {
            "old/old": _pair(30.0, 60.0, 70.0),
            "new/old": _pair(34.0, 64.0, 74.0),
            "new/new": _pair(40.0, 70.0, 80.0),
            "old/new": _pair(20.0, 40.0, 50.0),
        },
        "i2t": {
            "old/old": _pair(35.0, 65.0, 75.0),
            "new/old": _pair(38.0, 68.0, 78.0),
            "new/new": _pair(45.0, 75.0, 85.0),
        },
    }
    margins, ecc = {}, {}
    for d, pairs in retrieval.items():
        margins[d], ecc[d] = {}, {}
        for m in ("R@1", "R@5", "R@10"):
            margin = pairs["new/old"][m] - pairs["old/old"][m]
            margins[d][m] = {
                "margin": margin,
                "ci_low": margin - 1.5,
                "ci_high": margin + 1.5,
                "confidence": 0.95,
                "n_bootstrap": 1000,
            }
            ecc[d][m] = margin > 0
    return {
        "schema_version": 1,
        "method": "bct",
        "scenario": "continual",
        "data_phase": 2,
        "retrieval": retrieval,
        "independent_new_new": {"t2i": _pair(41.0, 71.0, 81.0), "i2t": _pair(46.0, 76.0, 86.0)},
        "eval_sizes": {"images": 1000, "captions": 5000, "domains": ["d0", "d1"]},
        "margins": margins,
        "ecc": ecc,
        "ecc_passed": True,
    }
