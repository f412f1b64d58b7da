"""Llama 3.1 8B at 128K tokens: context parallelism for long-context training on 1-2 nodes.

Derived from llama3_8b.py (the same model; RoPE's Llama 3.1 scaling is what 128K needs).
Layout: tensor 2 with sequence parallelism, context 4 (ring attention, causal load
balancing), data fills the rest (1 on 8 GPUs, 2 on 16) with the distributed optimizer over
data x context, full recompute; 64 sequences of 131072 tokens per step (8.4 M tokens) in 32
microbatches. `python -m jaxtrain.plan --config configs/llama3_8b_128k.py --devices 8 --gpu
h100` rates it 38-53% MFU at 65 of 72 GiB per device (micro-batch 2), on 16 devices 38-53% at
49 GiB (micro-batch 1; the planner's own pick there, tensor 4 x context 4 without recompute,
rates 47-67%). Without context parallelism only pipelines fit one node. Chosen by the
ledger, not yet measured on GPUs; `python train.py --config configs/llama3_8b_128k.py
--dry-run --target h100 --devices 8` compiles it for H100s (BENCHMARKS.md).
"""
from . import llama3_8b


def get_config():
    cfg = llama3_8b.get_config()
    cfg.model.max_seq_len = 131072
    cfg.train.seq_len = 131072
    cfg.train.global_batch = 64
    cfg.parallel.tensor = 2
    cfg.parallel.sequence_parallel = True
    cfg.parallel.context = 4
    cfg.parallel.context_strategy = "ring"
    cfg.parallel.data = -1
    cfg.parallel.zero1 = True
    cfg.parallel.microbatches = 32
    cfg.remat.granularity = "full"
    cfg.remat.method = "uniform"
    cfg.remat.num_layers = 1
    cfg.train.workdir = "runs/llama3_8b_128k"
    return cfg
