"""Data engines: a phase's shards validated into accepted and quarantined samples
(:mod:`~components.data.validation`, Great Expectations) and its drift against the reference
(:mod:`~components.data.drift`, Evidently)."""
