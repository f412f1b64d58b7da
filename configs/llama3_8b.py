"""Llama 3.1 8B: 32 layers, hidden 4096, 32 heads / 8 KV heads, MLP 14336.

Layout for one 8-GPU H100 node, the planner's pick (`python -m jaxtrain.plan --config
configs/llama3_8b.py --devices 8 --gpu h100`): TP 2 with sequence parallelism, data 4 with the
distributed optimizer, micro-batch 1 x 128 accumulation steps, no recompute.
"""
from . import llama3_base


def get_config():
    cfg = llama3_base.get_config()  # the base recipe is the 8B shape
    cfg.parallel.tensor = 2
    cfg.parallel.sequence_parallel = True
    cfg.parallel.data = -1
    cfg.parallel.zero1 = True
    cfg.parallel.microbatches = 128
    cfg.train.workdir = "runs/llama3_8b"
    return cfg
