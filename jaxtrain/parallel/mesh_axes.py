"""The mesh's axis names, outermost first (device order: tensor varies fastest, as Megatron's
tp-cp-dp-pp). Code outside sharding.py takes them from here (the pipeline executor, the
context attention, the kernels' shard_maps, the executors, the XLA defaults); sharding.py's
rules table, the one place that maps logical names onto mesh axes, spells them out so the
table reads as the mapping."""

MESH_AXES = ("stage", "data", "expert", "fsdp", "context", "tensor")
STAGE, DATA, EXPERT, FSDP, CONTEXT, TENSOR = MESH_AXES
# The data-parallel group of the weights: gradients are reduced over it once per step and
# ZeRO-1 shards over it (Megatron's CP ranks are data-parallel for the weights). `expert` is
# carved out of parallel.data (Megatron's expert-model-parallel ranks are data-parallel
# ranks): the rows of the batch split over data x expert, every weight but the experts' is
# replicated over both, the experts' are split over `expert` and data-parallel over the rest.
# Under MoE parallel folding (parallel.expert_tensor=1) the experts split over expert x tensor
# and the mesh's `expert` is parallel.expert / tensor (sharding.FOLDED_RULES).
REPLICA_AXES = (DATA, EXPERT, CONTEXT)
# The ranks that hold a batch's rows (its first dim), outermost first.
ROW_AXES = (DATA, EXPERT, FSDP)
