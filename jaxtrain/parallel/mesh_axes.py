"""The mesh's axis names, outermost first (device order: tensor varies fastest, as Megatron's
tp-cp-dp-pp). Code outside sharding.py takes them from here (the pipeline executor, the
context attention, the kernels' shard_maps, the executors, the XLA defaults); sharding.py's
rules table, the one place that maps logical names onto mesh axes, spells them out so the
table reads as the mapping."""

MESH_AXES = ("stage", "data", "fsdp", "context", "tensor")
STAGE, DATA, FSDP, CONTEXT, TENSOR = MESH_AXES
# The data-parallel group of the weights: gradients are reduced over it once per step and
# ZeRO-1 shards over it (Megatron's CP ranks are data-parallel for the weights).
REPLICA_AXES = (DATA, CONTEXT)
