"""The parallel room: where things live on the mesh and how the layers are run. The one owner
of the logical -> mesh mapping (sharding.py: the rules table and shardings), the kernels'
shard_maps (sharded_kernels.py), the notebook's parameter table (sharding_report.py), remat
policies, the layer order, context-parallel attention and the pipeline machinery (the public
API, the lock-step executor, the stash) for any model. The Llama on the pipeline is
jaxtrain/executors/pipeline.py's; the schedules' tables are the ledger's (pipeline_schedule)."""
