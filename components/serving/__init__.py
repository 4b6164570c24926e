"""The query service: answers searches as the serving record says, swapping the (query model, collection)
pair atomically when a rollout or a rollback changes the record. Nothing is imported here, so that
:mod:`~components.serving.limits` checks a command's arguments before numpy loads."""
