"""The query service: answers searches over HTTP as the serving record says, swapping the (query model,
collection) pair atomically when a rollout or a rollback changes the record.

Modules: :mod:`~components.serving.pair` (the immutable pair and the follower that swaps it),
:mod:`~components.serving.captions` (captions of hits from their gallery shards) and
:mod:`~components.serving.app` (the FastAPI app and its metrics; imported only by the service). Nothing is
imported here, so that :mod:`~components.serving.limits` checks a command's arguments before numpy loads.
"""
