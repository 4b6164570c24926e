"""Release gate: ``pass`` or ``block`` for a candidate from its compatibility report.

It fails closed: anything it cannot read, parse or find blocks with a reason naming the file and field. The
checks and their thresholds are described beside their settings in ``default_policy.yaml``.
"""

from components.gate.decision import GateDecision, block_decision, decide, run_gate
from components.gate.policy import DEFAULT_POLICY_PATH, GatePolicy, PolicyError, load_gate_policy
