"""Hugging Face Llama checkpoints <-> jaxtrain params.

    python -m jaxtrain.hf import --hf-dir HF_DIR --out DIR
        HF_DIR (config.json + *.safetensors, sharded or not) -> DIR/params.safetensors (our pure
        dict, flat '/' keys, fp32), DIR/config.json (a full `Config`, model section from HF),
        DIR/recipe.py (usable as `train.py --config DIR/recipe.py`), and the tokenizer files.
    python -m jaxtrain.hf export --checkpoint PATH [--step N] --out HF_DIR [--dtype bfloat16]
        PATH is an import DIR, a training workdir (latest or --step checkpoint) or one of its
        checkpoints/<step> folders -> HF config.json + model.safetensors (sharded past
        --max-shard-gb), loadable by transformers.LlamaForCausalLM.from_pretrained.

Layout. HF Linear weights are [out, in]; our kernels are [in, out] with heads split, and
per-layer weights are stacked on a leading L axis. Both use rotate-half RoPE on the same
head-dim halves (HF's checkpoints already carry the q/k permutation away from Meta's
interleaved layout), so q/k are a transpose and a reshape, no permutation.

Vocab padding. Our embedding may have more rows than the real vocab (Megatron's
make-vocab-size-divisible-by; `sharding.padded_vocab_size`). Export keeps the first
`model_cfg.vocab_size` (the real vocab) rows. Import pads with zero rows/columns when asked for
a larger `model_cfg.vocab_size`; the model masks those logits, and no token ever selects them.

Needs only numpy, ml_dtypes and safetensors; orbax/jax only to read training checkpoints.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys
from typing import Any, Sequence

import ml_dtypes
import numpy as np

from jaxtrain.config import Config, ConfigError, ModelConfig, RopeScaling, from_dict
from jaxtrain.weights import (PARAMS_FILE, HfConversionError, refuse_overwrite, set_path,
                              write_safetensors, load_params, read_safetensors, save_params)


SUPPORTED_ROPE_TYPES = ("default", "llama3")
_NP_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
              "bfloat16": np.dtype(ml_dtypes.bfloat16)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# ----------------------------------------------------------------------------- config


def model_config_from_hf(hf_config: dict) -> ModelConfig:
    """A `ModelConfig` from a HF Llama `config.json` dict (transformers 4.x or 5.x layout)."""
    c = hf_config
    if c.get("model_type", "llama") != "llama":
        raise HfConversionError(f"model_type={c['model_type']!r} is not supported; only Llama "
                                "('llama') checkpoints convert")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size"):
        if key not in c:
            raise HfConversionError(f"HF config has no {key!r}; is this a Llama config.json?")
    if c.get("hidden_act", "silu") != "silu":
        raise HfConversionError(f"hidden_act={c['hidden_act']!r} is not supported; our MLP is "
                                "SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key, False):
            raise HfConversionError(f"{key}=true is not supported; our projections have no bias")

    # transformers 5 nests theta and scaling in `rope_parameters`; 4.x has `rope_theta` and
    # `rope_scaling` at the top (with `type` instead of `rope_type` in old files).
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    rope_theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise HfConversionError(f"rope_type={rope_type!r} is not supported; supported: "
                                f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    rope_scaling = None
    if rope_type == "llama3":
        try:
            rope_scaling = RopeScaling(
                factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
        except KeyError as e:
            raise HfConversionError(
                f"rope_type='llama3' needs rope parameter {e.args[0]!r}") from None

    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    head_dim = int(c.get("head_dim") or hidden // heads)
    return ModelConfig(
        vocab_size=int(c["vocab_size"]), hidden_size=hidden,
        num_layers=int(c["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=0 if head_dim * heads == hidden else head_dim,
        mlp_size=int(c["intermediate_size"]), rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_seq_len=int(c.get("max_position_embeddings", ModelConfig.max_seq_len)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)))


def hf_config_from_model(model_cfg: ModelConfig, *, dtype: str = "float32") -> dict:
    """A HF `config.json` dict. Written in the 4.x layout (top-level rope_theta/rope_scaling),
    which transformers 5 also reads."""
    m = model_cfg
    rope_scaling = None
    if m.rope_scaling is not None:
        rope_scaling = {"rope_type": "llama3", **dataclasses.asdict(m.rope_scaling)}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
        "intermediate_size": m.mlp_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.resolved_head_dim, "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_scaling": rope_scaling,
        "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": dtype,
    }


# ----------------------------------------------------------------------------- params

def _layer_specs(m: ModelConfig):
    """(HF name in layer i, our path under `blocks`, HF->ours, ours->HF, our per-layer shape)."""
    d, h, k, e, f = m.hidden_size, m.num_heads, m.num_kv_heads, m.resolved_head_dim, m.mlp_size

    def heads_out(n):  # HF [n*e, d] <-> ours [d, n, e]
        return (lambda w: w.T.reshape(d, n, e), lambda w: w.reshape(d, n * e).T, (d, n, e))
    wo = (lambda w: w.T.reshape(h, e, d), lambda w: w.reshape(h * e, d).T, (h, e, d))
    same = lambda shape: (lambda w: w, lambda w: w, shape)  # noqa: E731
    transpose = lambda shape: (lambda w: w.T, lambda w: w.T, shape)  # noqa: E731
    return [
        ("self_attn.q_proj.weight", ("attn", "wq", "kernel"), *heads_out(h)),
        ("self_attn.k_proj.weight", ("attn", "wk", "kernel"), *heads_out(k)),
        ("self_attn.v_proj.weight", ("attn", "wv", "kernel"), *heads_out(k)),
        ("self_attn.o_proj.weight", ("attn", "wo", "kernel"), *wo),
        ("mlp.gate_proj.weight", ("mlp", "w_gate", "kernel"), *transpose((d, f))),
        ("mlp.up_proj.weight", ("mlp", "w_up", "kernel"), *transpose((d, f))),
        ("mlp.down_proj.weight", ("mlp", "w_down", "kernel"), *transpose((f, d))),
        ("input_layernorm.weight", ("attn_norm", "scale"), *same((d,))),
        ("post_attention_layernorm.weight", ("mlp_norm", "scale"), *same((d,))),
    ]


def _hf_shapes(m: ModelConfig, vocab: int) -> dict[str, tuple]:
    d, h, k, e, f = m.hidden_size, m.num_heads, m.num_kv_heads, m.resolved_head_dim, m.mlp_size
    per_layer = {"self_attn.q_proj.weight": (h * e, d), "self_attn.k_proj.weight": (k * e, d),
                 "self_attn.v_proj.weight": (k * e, d), "self_attn.o_proj.weight": (d, h * e),
                 "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
                 "mlp.down_proj.weight": (d, f), "input_layernorm.weight": (d,),
                 "post_attention_layernorm.weight": (d,)}
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    for i in range(m.num_layers):
        shapes.update({f"model.layers.{i}.{n}": s for n, s in per_layer.items()})
    if not m.tie_embeddings:
        shapes["lm_head.weight"] = (vocab, d)
    return shapes


def _get(tree: dict, path: Sequence[str], what: str):
    node = tree
    for key in path:
        if not isinstance(node, dict) or key not in node:
            raise HfConversionError(f"params have no {'/'.join(path)} (needed for {what}); "
                                    "are these jaxtrain Llama params?")
        node = node[key]
    return np.asarray(node)


def params_from_hf(state_dict: dict[str, np.ndarray], model_cfg: ModelConfig) -> dict:
    """Our pure-dict params (numpy, `model_cfg.param_dtype`) from a HF Llama state dict.

    `model_cfg.vocab_size` may exceed the checkpoint's vocab: the extra embedding rows (and
    lm_head columns) are zeros. Unknown tensors are an error, so no weight is silently dropped.
    """
    m = model_cfg
    dtype = _NP_DTYPES[m.param_dtype]
    if "model.embed_tokens.weight" not in state_dict:
        raise HfConversionError("HF checkpoint has no tensor 'model.embed_tokens.weight'")
    vocab = state_dict["model.embed_tokens.weight"].shape[0]
    if vocab > m.vocab_size:
        raise HfConversionError(f"HF checkpoint has {vocab} embedding rows but model.vocab_size="
                                f"{m.vocab_size}; use a vocab_size >= {vocab}")
    expected = _hf_shapes(m, vocab)
    ignored = {n for n in state_dict if n.endswith("rotary_emb.inv_freq")}  # old files: a buffer
    if m.tie_embeddings:
        ignored.add("lm_head.weight")  # some tied checkpoints still store the shared matrix
    unexpected = sorted(set(state_dict) - set(expected) - ignored)
    if unexpected:
        more = " ..." if len(unexpected) > 5 else ""
        raise HfConversionError(f"HF checkpoint has unexpected tensor(s) "
                                f"{', '.join(unexpected[:5])}{more}; the config (e.g. "
                                "attention_bias, tie_word_embeddings, num_hidden_layers) does not "
                                "describe this checkpoint")

    def fetch(name):
        if name not in state_dict:
            raise HfConversionError(f"HF checkpoint is missing tensor {name!r} "
                                    f"(expected shape {expected[name]})")
        w = state_dict[name]
        if tuple(w.shape) != expected[name]:
            raise HfConversionError(f"HF tensor {name!r} has shape {tuple(w.shape)} but the config "
                                    f"implies {expected[name]}")
        return w

    def pad_rows(w_VD):
        out = np.zeros((m.vocab_size, w_VD.shape[1]), dtype)
        out[:vocab] = w_VD
        return out

    params: dict[str, Any] = {"embed": pad_rows(fetch("model.embed_tokens.weight")),
                              "final_norm": {"scale": fetch("model.norm.weight").astype(dtype)}}
    if not m.tie_embeddings:
        params["lm_head"] = np.ascontiguousarray(pad_rows(fetch("lm_head.weight")).T)
    for hf_name, path, to_ours, _, shape in _layer_specs(m):
        # Fill a preallocated [L, ...] array layer by layer: one copy of the weights in memory.
        stacked = np.empty((m.num_layers, *shape), dtype)
        for i in range(m.num_layers):
            stacked[i] = to_ours(fetch(f"model.layers.{i}.{hf_name}"))
        set_path(params, ("blocks", *path), stacked)
    return params


def params_to_hf(params: dict, model_cfg: ModelConfig, *, dtype: str | None = None
                 ) -> dict[str, np.ndarray]:
    """A HF Llama state dict from our pure-dict params, keeping only the first
    `model_cfg.vocab_size` (real vocab) rows of a padded embedding. `dtype`: cast to it
    (default: the params' own dtype)."""
    m = model_cfg
    cast = (lambda w: w.astype(_NP_DTYPES[dtype])) if dtype else (lambda w: w)  # noqa: E731
    embed_VD = _get(params, ("embed",), "model.embed_tokens.weight")
    if embed_VD.shape[0] < m.vocab_size or embed_VD.shape[1] != m.hidden_size:
        raise HfConversionError(f"params embed has shape {embed_VD.shape} but the config needs "
                                f"at least ({m.vocab_size}, {m.hidden_size})")
    out = {"model.embed_tokens.weight": cast(embed_VD[:m.vocab_size])}
    for hf_name, path, _, to_hf, shape in _layer_specs(m):
        stacked = _get(params, ("blocks", *path), f"model.layers.*.{hf_name}")
        if stacked.shape != (m.num_layers, *shape):
            raise HfConversionError(
                f"params blocks/{'/'.join(path)} has shape {stacked.shape} but the config needs "
                f"{(m.num_layers, *shape)}")
        for i in range(m.num_layers):
            out[f"model.layers.{i}.{hf_name}"] = cast(to_hf(stacked[i]))
    out["model.norm.weight"] = cast(_get(params, ("final_norm", "scale"), "model.norm.weight"))
    if not m.tie_embeddings:
        lm_head_DV = _get(params, ("lm_head",), "lm_head.weight")
        out["lm_head.weight"] = cast(lm_head_DV[:, :m.vocab_size].T)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def load_hf_checkpoint(hf_dir: str | pathlib.Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json dict, state dict) of a HF checkpoint folder; follows
    model.safetensors.index.json when the weights are sharded."""
    hf_dir = pathlib.Path(hf_dir)
    cfg_path = hf_dir / "config.json"
    if not cfg_path.is_file():
        raise HfConversionError(f"{hf_dir} has no config.json; pass a Hugging Face model folder")
    hf_config = json.loads(cfg_path.read_text())
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
        weight_map = None
    if not files:
        raise HfConversionError(f"{hf_dir} has no *.safetensors weights (.bin/.pth files are not "
                                "read: re-save with safe_serialization=True)")
    state_dict: dict[str, np.ndarray] = {}
    for name in files:
        if not (hf_dir / name).is_file():
            raise HfConversionError(f"{index} names {name}, which is not in {hf_dir}")
        state_dict.update(read_safetensors(hf_dir / name))
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(state_dict))
        if missing:
            raise HfConversionError(f"{index} lists tensor {missing[0]!r} but no shard holds it")
    return hf_config, state_dict


def save_hf_checkpoint(out_dir: str | pathlib.Path, params: dict, model_cfg: ModelConfig, *,
                       dtype: str = "float32", max_shard_bytes: int = 5 * 2**30) -> None:
    """Write HF config.json + model.safetensors (or model-0000i-of-0000n.safetensors and an
    index when larger than `max_shard_bytes`). `model_cfg.vocab_size` is the real vocab."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    refuse_overwrite(out_dir, "model*.safetensors*")
    tensors = params_to_hf(params, model_cfg, dtype=dtype)
    shards: list[dict] = [{}]
    size = 0
    for name, w in tensors.items():
        if shards[-1] and size + w.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = w
        size += w.nbytes
    if len(shards) == 1:
        write_safetensors(out_dir / "model.safetensors", tensors, "pt")
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(out_dir / fname, shard, "pt")
            weight_map.update({name: fname for name in shard})
        index = {"metadata": {"total_size": sum(w.nbytes for w in tensors.values())},
                 "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_config = hf_config_from_model(model_cfg, dtype=dtype)
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2))


def read_checkpoint(path: str | pathlib.Path, step: int | None = None) -> tuple[dict, Config]:
    """(numpy params, Config) from an import folder, a training workdir (its latest checkpoint,
    or `step`), or a workdir's checkpoints/<step> folder."""
    path = pathlib.Path(path)
    if (path / PARAMS_FILE).is_file():
        return load_params(path)
    if (path / "checkpoints").is_dir():
        workdir, steps_dir = path, path / "checkpoints"
        done = sorted(int(p.name) for p in steps_dir.iterdir() if p.name.isdigit())
        if step is None:
            if not done:
                raise HfConversionError(f"{steps_dir} holds no finished checkpoint")
            step = done[-1]
        elif step not in done:
            raise HfConversionError(f"{steps_dir} has no step {step}; it has {done}")
        step_dir = steps_dir / str(step)
    elif (path / "state").is_dir() and path.parent.name == "checkpoints":
        workdir, step_dir = path.parent.parent, path
    else:
        raise HfConversionError(f"--checkpoint {path}: expected an import folder (with "
                                f"{PARAMS_FILE}), a training workdir (with checkpoints/) or a "
                                "workdir's checkpoints/<step> folder")
    if not (workdir / "config.json").is_file():
        raise HfConversionError(f"{workdir} has no config.json (the trainer writes it); cannot "
                                "tell the model's shape")
    cfg = from_dict(json.loads((workdir / "config.json").read_text()))
    from jaxtrain.checkpoint import read_params
    return read_params(step_dir, cfg.model.num_layers), cfg


# ----------------------------------------------------------------------------- CLI

def import_hf(hf_dir: str | pathlib.Path, out_dir: str | pathlib.Path) -> Config:
    """HF folder -> import folder (see module docstring); returns the written Config."""
    hf_dir, out_dir = pathlib.Path(hf_dir), pathlib.Path(out_dir)
    hf_config, state_dict = load_hf_checkpoint(hf_dir)
    cfg = Config(model=model_config_from_hf(hf_config))
    params = params_from_hf(state_dict, cfg.model)
    out_dir.mkdir(parents=True, exist_ok=True)
    refuse_overwrite(out_dir, PARAMS_FILE)  # before copying anything into it
    if (hf_dir / "tokenizer.json").is_file():
        for name in TOKENIZER_FILES:
            if (hf_dir / name).is_file():
                shutil.copyfile(hf_dir / name, out_dir / name)
        cfg.data.tokenizer = str(out_dir.resolve())
    save_params(out_dir, params, cfg)
    return cfg


def export_hf(checkpoint: str | pathlib.Path, out_dir: str | pathlib.Path, *,
              step: int | None = None, dtype: str = "float32",
              max_shard_bytes: int = 5 * 2**30) -> None:
    """Our checkpoint (see `read_checkpoint`) -> HF folder, with the run's tokenizer if any."""
    params, cfg = read_checkpoint(checkpoint, step)
    save_hf_checkpoint(out_dir, params, cfg.model, dtype=dtype, max_shard_bytes=max_shard_bytes)
    tok = pathlib.Path(cfg.data.tokenizer)
    tok_dir = tok if tok.is_dir() else tok.parent
    if cfg.data.tokenizer != "byte" and (tok_dir / "tokenizer.json").is_file():
        for name in TOKENIZER_FILES:
            if (tok_dir / name).is_file():
                shutil.copyfile(tok_dir / name, pathlib.Path(out_dir) / name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtrain.hf",
                                     description="Convert Llama checkpoints to/from Hugging Face.")
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF folder -> params.safetensors + config.json + recipe.py")
    imp.add_argument("--hf-dir", required=True, help="folder with config.json and *.safetensors")
    imp.add_argument("--out", required=True, help="output folder (new or empty)")
    exp = sub.add_parser("export", help="our checkpoint -> HF config.json + model.safetensors")
    exp.add_argument("--checkpoint", required=True,
                     help="an import folder, a training workdir, or workdir/checkpoints/<step>")
    exp.add_argument("--step", type=int, default=None,
                     help="workdir checkpoint step (default: latest)")
    exp.add_argument("--out", required=True, help="output folder (new or empty)")
    exp.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    exp.add_argument("--max-shard-gb", type=float, default=5.0)
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            cfg = import_hf(args.hf_dir, args.out)
            print(f"imported {args.hf_dir} -> {args.out} ({cfg.model.num_layers} layers, vocab "
                  f"{cfg.model.vocab_size}); train with --config {args.out}/recipe.py")
        else:
            export_hf(args.checkpoint, args.out, step=args.step, dtype=args.dtype,
                      max_shard_bytes=int(args.max_shard_gb * 2**30))
            print(f"exported {args.checkpoint} -> {args.out}")
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
