"""Llama 3.1 405B: 126 layers, hidden 16384, 128 heads / 8 KV heads, MLP 53248."""
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
