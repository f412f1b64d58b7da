"""The mesh's axis names, outermost first (device order: tensor varies fastest, as Megatron's
tp-cp-dp-pp). Only this module spells them; sharding.py maps the logical names onto them, and
the pipeline executor and the context attention take their collectives' axes from here."""

MESH_AXES = ("stage", "data", "fsdp", "context", "tensor")
STAGE, DATA, FSDP, CONTEXT, TENSOR = MESH_AXES
# The data-parallel group of the weights: gradients are reduced over it once per step and
# ZeRO-1 shards over it (Megatron's CP ranks are data-parallel for the weights).
REPLICA_AXES = (DATA, CONTEXT)
