"""Small configs, batches and parameters shared by the tests, and a run's metrics."""
import json
import pathlib

import jax
import numpy as np
from flax import nnx

from jaxtrain.config import Config, ModelConfig, TrainConfig, DataConfig, apply_overrides
from jaxtrain.data import synthetic_batch as random_batch

__all__ = ["tiny_config", "TINY_MOE", "tiny_moe_config", "random_batch", "random_params", "metric_records", "logged_losses",
           "check_breakdown_sums", "decisive_hf_weights", "train_on_one_device", "random_model_params",
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


# The smallest MoE model that shows expert parallelism: 8 experts (expert degrees 2, 4, 8
# divide them), top-2, a small expert MLP, the z-loss on; the load-balancing loss off, as it
# is a per-replica statistic (Megatron's): with it a data-parallel layout is not the one
# device's computation.
TINY_MOE = ("--model.moe.num_experts=8", "--model.moe.top_k=2", "--model.moe.mlp_size=32",
            "--model.moe.aux_loss_coeff=0", "--model.moe.z_loss_coeff=1e-2")


def tiny_moe_config(*overrides, workdir="runs/test") -> Config:
    """tiny_config with every layer an MoE layer (TINY_MOE), then `overrides`."""
    return tiny_config(*TINY_MOE, *overrides, workdir=workdir)


def random_params(setup):
    """Norm scales 1, other weights N(0, 0.1²) in the shapes of `setup`'s state (numpy: far
    quicker than compiling the init)."""
    rng = np.random.default_rng(0)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: np.ones(x.shape, x.dtype) if "scale" in jax.tree_util.keystr(path)
        else (0.1 * rng.standard_normal(x.shape)).astype(x.dtype),
        nnx.to_pure_dict(setup.abstract_state))


def random_model_params(cfg: ModelConfig, seed=0):
    """Random params of a Llama of `cfg` (shapes from an abstract model; eager NNX init is
    slow): norms 1 + N(0, 0.2²) (not all ones), the embedding N(0, 1), the rest N(0, 1/D)."""
    from jaxtrain.model import llama
    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(
        lambda: llama.Llama(cfg, rngs=nnx.Rngs(0)))))
    rng = np.random.default_rng(seed)

    def draw(path, s):
        if jax.tree_util.keystr(path).endswith("['scale']"):
            return (1.0 + 0.2 * rng.standard_normal(s.shape)).astype(np.float32)
        std = 1.0 if jax.tree_util.keystr(path) == "['embed']" else cfg.hidden_size ** -0.5
        return (std * rng.standard_normal(s.shape)).astype(np.float32)
    return jax.tree_util.tree_map_with_path(draw, shapes)


def train_on_one_device(config: str, args, workdir) -> str:
    """`python train.py --config CONFIG ARGS --parallel.data=1` on one (fake CPU) device with
    `workdir`, from the repository root; its stdout (the run must succeed)."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "XLA_FLAGS": os.environ["XLA_FLAGS"].replace(
        "--xla_force_host_platform_device_count=8", "--xla_force_host_platform_device_count=1")}
    out = subprocess.run([sys.executable, "train.py", "--config", config, *args,
                          "--parallel.data=1", f"--train.workdir={workdir}"],
                         cwd=pathlib.Path(__file__).resolve().parents[1], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def metric_records(workdir: pathlib.Path) -> list[dict]:
    """A run's metrics.jsonl records ([] before it has any)."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def logged_losses(workdir: pathlib.Path) -> dict[int, float]:
    """step -> loss of every logged step of a run."""
    return {r["step"]: r["loss"] for r in metric_records(workdir) if "loss" in r}


def check_breakdown_sums(bd):
    """Every device's T_ideal + seven terms (a term not measured counts 0) is its T_step."""
    import pytest
    from jaxtrain.tools.mfu_report import TERMS
    for s in bd.steps:
        for d, v in s.per_device.items():
            assert bd.ideal + sum(v[t] or 0.0 for t in TERMS) == pytest.approx(
                v["t_step"], abs=1e-12), d


def decisive_hf_weights(model):
    """A transformers model's weights redrawn so a mapping error shows: HF's init (std 0.02,
    unit norms) gives near-zero logits and near-uniform routing. Norms 1 + N(0, 0.2²), the
    embedding N(0, 1), every other weight N(0, 1/fan-in) (HF stores [out, in]: the last dim)."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


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


def one_device_grad_step_matmul_flops(cfg: Config) -> float:
    """Every matmul FLOP XLA:CPU compiles for `cfg`'s gradient step on one device (what a
    ledger's model FLOPs are held to)."""
    from jaxtrain import step
    from jaxtrain.executors import setup as setup_lib
    from jaxtrain.parallel import sharding
    from jaxtrain.tools import hlo
    from jaxtrain.tools.compile_step import CPU_COMPILER_OPTIONS, abstract_batch
    mesh = sharding.make_mesh(cfg.parallel, jax.devices()[:1])
    setup = setup_lib.build(cfg, mesh)
    state = setup.abstract_train_state
    compiled = step.make_grad_step(setup).lower(
        state.params, abstract_batch(cfg, mesh), state.fp8_meta).compile(
        compiler_options=CPU_COMPILER_OPTIONS)
    return hlo.matmul_flops(compiled)


def model_leaf_count(cfg: ModelConfig) -> int:
    """How many parameters the model's leaves hold (what the ledger's count must equal)."""
    from jaxtrain.model import llama
    shapes = nnx.state(nnx.eval_shape(lambda: llama.Llama(cfg, rngs=nnx.Rngs(0))))
    return sum(x.size for x in jax.tree.leaves(shapes))
