"""Small configs and batches shared by the tests."""
import numpy as np

from jaxtrain.config import Config, ModelConfig, TrainConfig, DataConfig, apply_overrides


def tiny_config(*overrides, workdir="runs/test") -> Config:
    cfg = Config(
        model=ModelConfig(vocab_size=384, hidden_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, mlp_size=128, max_seq_len=64, compute_dtype="float32"),
        train=TrainConfig(steps=4, global_batch=8, seq_len=32, lr=3e-3, warmup_steps=2,
                          workdir=workdir, log_every=1),
        data=DataConfig(corpus_max_bytes=400_000),
    )
    apply_overrides(cfg, overrides)
    return cfg.validate()


def random_batch(cfg: Config, seed: int = 0, docs_per_row: int = 2) -> dict:
    """A packed batch of random tokens with `docs_per_row` documents per row."""
    rng = np.random.default_rng(seed)
    b, s = cfg.train.global_batch, cfg.train.seq_len
    tokens = rng.integers(0, 256, (b, s + 1)).astype(np.int32)
    cut = s // docs_per_row
    segment_ids = np.minimum(np.arange(s) // cut + 1, docs_per_row).astype(np.int32)
    starts = (np.arange(s) // cut) * cut
    positions = (np.arange(s) - np.minimum(starts, (docs_per_row - 1) * cut)).astype(np.int32)
    loss_mask = np.ones(s, np.float32)
    loss_mask[[cut * k - 1 for k in range(1, docs_per_row)]] = 0.0
    tile = lambda x: np.tile(x, (b, 1))  # noqa: E731
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": tile(segment_ids),
            "positions": tile(positions), "loss_mask": tile(loss_mask)}
