"""The CPU default: a ~1M-parameter byte-level Llama that trains on the embedded corpus in minutes."""
from jaxtrain.config import Config, ModelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(vocab_size=384, hidden_size=128, num_layers=4, num_heads=4,
                          num_kv_heads=2, mlp_size=384, max_seq_len=512,
                          compute_dtype="float32"),  # CPUs have no fast bf16 matmul
        train=TrainConfig(steps=150, global_batch=16, seq_len=128, lr=3e-3, warmup_steps=15,
                          workdir="runs/tiny", log_every=10, eval_every=50),
    )
