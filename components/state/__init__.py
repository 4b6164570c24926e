"""The workspace's own files: where every location is (:mod:`~components.state.workspace`), the layout of
a run's folder (:mod:`~components.state.run_dir`) and the lock steps and rollouts share
(:mod:`~components.state.lock`). The bottom of :mod:`components`: it imports
nothing above it."""
