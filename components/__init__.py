"""Pipeline stages: each module implements one step on top of ``compat`` and the MLOps
libraries (Great Expectations, Evidently, MLflow, Feast, Milvus) and exposes it as a
KFP v2 component in ``components.kfp_ops``."""
