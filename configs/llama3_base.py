"""Llama 3 architecture constants shared by the Llama 3 recipes (not a runnable recipe size)."""
import dataclasses

from jaxtrain.config import Config, ModelConfig, RopeScaling, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                          num_kv_heads=8, mlp_size=14336, rope_theta=500000.0,
                          rope_scaling=RopeScaling(), max_seq_len=8192, norm_eps=1e-5,
                          compute_dtype="bfloat16"),
        train=TrainConfig(steps=100_000, global_batch=512, seq_len=8192, lr=3e-4,
                          warmup_steps=2000, weight_decay=0.1, grad_clip=1.0,
                          workdir="runs/llama3", log_every=1),
    )


def with_model(cfg: Config, **model_fields) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model_fields))
