"""The pipeline's steps and what they run on, in layers: KFP ops (:mod:`components.kfp_ops`), step functions
(:mod:`components.steps`), engines (:mod:`components.rollout`, :mod:`components.gate`,
:mod:`components.report`), the query service (:mod:`components.serving`, :mod:`components.search`), service
adapters (registry, index, lineage, drift, validation, continual training, evaluation) and the workspace
(paths, runs, lock, status). See README "Architecture"."""
