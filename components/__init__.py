"""The pipeline's steps and what they run on. Its folders are its layers, top to bottom (README,
"Architecture"; held by the import contracts in pyproject.toml):

- :mod:`components.kfp_ops`: the KFP ops, one thin component per step; nothing imports them;
- :mod:`components.steps`: the step functions, one per pipeline step;
- :mod:`components.report`: the on-call report of a run;
- :mod:`components.rollout` and :mod:`components.runs`: the gallery rollout, and run planning and bookkeeping;
- :mod:`components.deployment`: the typed deployment every step receives;
- engines by concept: :mod:`components.serving` (the query service and search), :mod:`components.gate`,
  :mod:`components.training` (continual training, evaluation), :mod:`components.data` (validation, drift);
- :mod:`components.adapters`: one module per outside service (Milvus, Feast, MLflow);
- :mod:`components.state`: the workspace's locations, a run folder's layout and the workspace's lock.

:mod:`components.registry` only keeps the ``loader_module`` name older MLmodel files give."""
