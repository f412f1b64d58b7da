"""Llama 3.1 70B: 80 layers, hidden 8192, 64 heads / 8 KV heads, MLP 28672, seq 8192, batch 512.

Layout for 1024 H100s: TP 8 with sequence parallelism inside a node, PP 2 interleaved with 8
virtual stages of 5 layers (bubble 1.6%), data 64 with the distributed optimizer (ZeRO-1), 8
microbatches of one sequence, no recompute. The ledger's pick (`python -m jaxtrain.plan
--config configs/llama70b.py --devices 1024 --gpu h100`): 37-61% MFU at 58.5 of 72 GiB, of
which 23.6 GiB are the pipeline's stashed activations (each F keeps its chunk's residuals for
its B, Megatron's schedule without recompute: rank 0 holds 16 chunk-microbatches). Full
recompute would need 1.7 GiB of them but runs every layer's forward again (30-49%). Chosen by
the ledger and checked on the GPU compiler (tests/test_gpu_compile.py), not yet run on GPUs.
"""
from . import llama3_base


def get_config():
    cfg = llama3_base.with_model(llama3_base.get_config(), hidden_size=8192, num_layers=80,
                                 num_heads=64, num_kv_heads=8, mlp_size=28672)
    cfg.parallel.tensor = 8
    cfg.parallel.sequence_parallel = True
    cfg.parallel.stage = 2
    cfg.parallel.virtual_stages = 8
    cfg.parallel.schedule = "interleaved_1f1b"
    cfg.parallel.data = -1
    cfg.parallel.zero1 = True
    cfg.parallel.microbatches = 8
    cfg.remat.granularity = "none"
    cfg.train.workdir = "runs/llama70b"
    return cfg
