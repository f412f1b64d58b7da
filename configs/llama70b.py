"""Llama 3.1 70B: 80 layers, hidden 8192, 64 heads / 8 KV heads, MLP 28672, seq 8192, batch 512.

Layout for 1024 H100s: TP 8 with sequence parallelism inside a node, PP 2 interleaved with 10
virtual stages (bubble 1.25%), data 64 with the distributed optimizer (ZeRO-1), no recompute.
The ledger (`python -m jaxtrain.plan --config configs/llama70b.py --devices 1024 --gpu h100`)
rates it 30-47% MFU at 35.8 of 72 GiB, within a point of its pick (TP 4, data 128, 4
microbatches: 31-48% at 64.7 GiB); this one keeps twice the memory headroom and half the
data-parallel traffic. Chosen by the ledger, not yet measured on GPUs.
"""
import llama3_base


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
