"""Llama 3.1 405B: 126 layers, hidden 16384, 128 heads / 8 KV heads, MLP 53248.

Layout for 1024 H100s: TP 8 with sequence parallelism, PP 8 with 1F1B and lighter first and
last stages (15 + 6 x 16 + 15 layers: time for the embedding and the head), data 16 (ZeRO-1),
64 microbatches of one sequence, full recompute of every layer (each F stashes its 16 layers'
inputs). The ledger (`python -m jaxtrain.plan --config configs/llama405b.py --devices 1024
--gpu h100`) rates it 32-48% MFU at 68.8 of 72 GiB, its only fitting layout: without recompute
the stash alone needs 127 GiB, and on 512 H100s (two sequences per microbatch) the step
compiles to 81 GiB per device. Not yet run on GPUs.
"""
from . import llama70b
from . import llama3_base


def get_config():
    cfg = llama3_base.with_model(llama70b.get_config(), hidden_size=16384, num_layers=126,
                                 num_heads=128, num_kv_heads=8, mlp_size=53248)
    cfg.parallel.stage = 8
    cfg.parallel.virtual_stages = 1
    cfg.parallel.schedule = "1f1b"
    cfg.parallel.first_stage_layers = 15  # 15 + 6*16 + 15 = 126: lighter ends for embed/head
    cfg.parallel.last_stage_layers = 15
    cfg.parallel.microbatches = 64
    cfg.remat.granularity = "full"
    cfg.remat.method = "uniform"
    cfg.remat.num_layers = 1
    cfg.train.global_batch = 1024
    cfg.train.workdir = "runs/llama405b"
    return cfg
