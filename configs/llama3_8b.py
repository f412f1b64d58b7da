"""Llama 3.1 8B: 32 layers, hidden 4096, 32 heads / 8 KV heads, MLP 14336."""
import llama3_base


def get_config():
    cfg = llama3_base.get_config()  # the base recipe is the 8B shape
    cfg.parallel.tensor = 8
    cfg.parallel.microbatches = 1
    cfg.remat.granularity = "selective"
    cfg.train.workdir = "runs/llama3_8b"
    return cfg
