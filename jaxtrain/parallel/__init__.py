"""The parallel room: the one owner of mesh axes (sharding.py: the rules table, shardings,
kernel specs), remat policies, the layer order, context-parallel attention and the pipeline
(schedules, executor, stash, the Llama on it)."""
