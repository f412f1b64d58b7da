"""Small configs, batches and parameters shared by the tests, and a run's metrics."""
import json
import pathlib

import jax
import numpy as np
from flax import nnx

from jaxtrain.config import Config, ModelConfig, TrainConfig, DataConfig, apply_overrides
from jaxtrain.data import synthetic_batch as random_batch

__all__ = ["tiny_config", "random_batch", "random_params", "metric_records", "logged_losses",
           "bpe_tokenizer"]


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


def random_params(setup):
    """Norm scales 1, other weights N(0, 0.1²) in the shapes of `setup`'s state (numpy: far
    quicker than compiling the init)."""
    rng = np.random.default_rng(0)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: np.ones(x.shape, x.dtype) if "scale" in jax.tree_util.keystr(path)
        else (0.1 * rng.standard_normal(x.shape)).astype(x.dtype),
        nnx.to_pure_dict(setup.abstract_state))


def metric_records(workdir: pathlib.Path) -> list[dict]:
    """A run's metrics.jsonl records ([] before it has any)."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def logged_losses(workdir: pathlib.Path) -> dict[int, float]:
    """step -> loss of every logged step of a run."""
    return {r["step"]: r["loss"] for r in metric_records(workdir) if "loss" in r}


def bpe_tokenizer(path: pathlib.Path, docs, vocab_size: int = 384) -> pathlib.Path:
    """A byte-level BPE tokenizer.json trained on `docs` (with <s>, </s> and <pad>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(path))
    return path
