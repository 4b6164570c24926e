"""Training engines: continual training over a phase (Mod-X, :mod:`~components.training.continual`) and the
evaluation of a candidate against production (:mod:`~components.training.evaluate`)."""
