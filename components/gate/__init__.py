"""Release gate: decide ``pass`` or ``block`` for a candidate from its compatibility report.

The gate fails closed: anything it cannot read, parse or find blocks with a reason naming the file and field.
A pass needs every check to pass:

* ``ecc_margin``: per required direction and K, ``M(new query, old gallery) - M(old query, old gallery) >
  min_margin`` (percentage points), recomputed from the retrieval matrix; a reported margin or verdict that
  disagrees blocks as ``report_inconsistent`` (a report cannot vouch for itself).
* ``ecc_interval``: the lower bound of that margin's bootstrap confidence interval is above zero.
* ``eval_set_too_small``: the evaluation set has at least the policy's images and captions.
* ``retention_floor``: ``new/new R@K >= floor x reference R@K``, the reference being the independent new
  model's new/new when the report has one (policy ``reference: auto``), else old/old.
* ``drift_too_severe``: the worst drift severity is at most the policy's maximum.
* ``validation_blocked``: data validation did not block the phase.
"""

from components.gate.decision import GateDecision, block_decision, decide, run_gate
from components.gate.policy import DEFAULT_POLICY_PATH, SEVERITIES, GatePolicy, PolicyError, load_gate_policy

__all__ = [
    "DEFAULT_POLICY_PATH",
    "SEVERITIES",
    "GateDecision",
    "GatePolicy",
    "PolicyError",
    "block_decision",
    "decide",
    "load_gate_policy",
    "run_gate",
]
