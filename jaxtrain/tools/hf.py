"""Hugging Face Llama, Mixtral and DeepSeek-V3 checkpoints <-> jaxtrain params.

    python -m jaxtrain.hf import --hf-dir HF_DIR --out DIR
        HF_DIR (config.json + *.safetensors, sharded or not) -> DIR/params.safetensors (our pure
        dict, flat '/' keys, fp32), DIR/config.json (a full `Config`, model section from HF),
        DIR/recipe.py (usable as `train.py --config DIR/recipe.py`), and the tokenizer files.
    python -m jaxtrain.hf export --checkpoint PATH [--step N] --out HF_DIR [--dtype bfloat16]
        PATH is an import DIR, a training workdir (latest or --step checkpoint) or one of its
        checkpoints/<step> folders -> HF config.json + model.safetensors (sharded past
        --max-shard-gb), loadable by transformers.LlamaForCausalLM (with model.moe
        MixtralForCausalLM, with model.mla DeepseekV3ForCausalLM).from_pretrained.

Mixtral. Every layer is MoE: the router `block_sparse_moe.gate` [E, D] is our
`blocks/moe/router` [D, E]; expert j's w1 / w3 / w2 are rows j of our stacked `w_gate`,
`w_up` ([E, D, F]) and `w_down` ([E, F, D]), transposed like the dense projections. HF's
router (softmax over all experts, top-k, renormalised) is our default (pre_softmax=false).
Its `router_aux_loss_coef` weighs one loss over all layers' tokens taken together, k times
Megatron's per-layer normalisation; it maps to aux_loss_coeff = coef·k / layers (the same
term when every layer routes alike) and back on export. Router variants transformers' Mixtral
does not run (jitter noise, sigmoid scores, no top-k renormalisation, shared experts) are
refused, as are models HF's Mixtral cannot express on export (dense layers, shared experts,
pre_softmax).

DeepSeek-V3 (a model with model.mla): hf_deepseek.py's map, with its RoPE column order.

Layout. HF Linear weights are [out, in]; our kernels are [in, out] with heads split, and
per-layer weights are stacked on a leading L axis (hf_spec.py). Llama's and Mixtral's
checkpoints and ours use rotate-half RoPE on the same head-dim halves (HF's checkpoints
already carry the q/k permutation away from Meta's interleaved layout), so q/k are a
transpose and a reshape, no permutation.

Vocab padding. Our embedding may have more rows than the real vocab (Megatron's
make-vocab-size-divisible-by; `config.padded_vocab`). Export keeps the first
`model_cfg.vocab_size` (the real vocab) rows. Import pads with zero rows/columns when asked for
a larger `model_cfg.vocab_size`; the model masks those logits, and no token ever selects them.

Needs only numpy, ml_dtypes and safetensors; orbax/jax only to read training checkpoints.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
from typing import Any, Sequence

import ml_dtypes
import numpy as np

from jaxtrain.config import Config, ConfigError, ModelConfig
from jaxtrain.tools import hf_deepseek
from jaxtrain.tools.hf_config import check_exportable, hf_config_from_model, model_config_from_hf
from jaxtrain.tools.hf_spec import Spec, heads_in, heads_out, layer_slots, same, transpose
from jaxtrain.weights import (PARAMS_FILE, HfConversionError, read_checkpoint,
                              read_safetensors_folder, refuse_overwrite, save_params, set_path,
                              write_safetensors_shards)


_NP_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
              "bfloat16": np.dtype(ml_dtypes.bfloat16)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# ----------------------------------------------------------------------------- params

def _layer_specs(m: ModelConfig, moe: bool, hf_config: dict | None = None) -> list[Spec]:
    """The HF tensors of one decoder layer (an MoE layer when `moe`): DeepSeek-V3's for a
    model with MLA (hf_deepseek.py), else Llama's or Mixtral's."""
    if m.mla is not None:
        return hf_deepseek.layer_specs(m, moe, (hf_config or {}).get("rope_interleave", True))
    d, h, k, e = m.hidden_size, m.num_heads, m.num_kv_heads, m.resolved_head_dim
    specs = [
        Spec("self_attn.q_proj.weight", ("attn", "wq", "kernel"), *heads_out(d, h, e)),
        Spec("self_attn.k_proj.weight", ("attn", "wk", "kernel"), *heads_out(d, k, e)),
        Spec("self_attn.v_proj.weight", ("attn", "wv", "kernel"), *heads_out(d, k, e)),
        Spec("self_attn.o_proj.weight", ("attn", "wo", "kernel"), *heads_in(h, e, d)),
        Spec("input_layernorm.weight", ("attn_norm", "scale"), *same((d,))),
        Spec("post_attention_layernorm.weight", ("mlp_norm", "scale"), *same((d,))),
    ]
    if not moe:
        f = m.mlp_size
        return specs + [
            Spec("mlp.gate_proj.weight", ("mlp", "w_gate", "kernel"), *transpose((f, d))),
            Spec("mlp.up_proj.weight", ("mlp", "w_up", "kernel"), *transpose((f, d))),
            Spec("mlp.down_proj.weight", ("mlp", "w_down", "kernel"), *transpose((d, f)))]
    f = m.expert_mlp_size
    specs.append(Spec("block_sparse_moe.gate.weight", ("moe", "router"),
                      *transpose((m.moe.num_experts, d))))
    for j in range(m.moe.num_experts):
        for hf_w, ours, shape in (("w1", "w_gate", (f, d)), ("w3", "w_up", (f, d)),
                                  ("w2", "w_down", (d, f))):
            specs.append(Spec(f"block_sparse_moe.experts.{j}.{hf_w}.weight", ("moe", ours),
                              *transpose(shape), expert=j))
    return specs


def _hf_shapes(m: ModelConfig, vocab: int, hf_config: dict | None = None) -> dict[str, tuple]:
    shapes = {"model.embed_tokens.weight": (vocab, m.hidden_size),
              "model.norm.weight": (m.hidden_size,)}
    specs = {moe: _layer_specs(m, moe, hf_config) for moe in set(m.moe_layers)}
    for i, moe in enumerate(m.moe_layers):
        shapes.update({f"model.layers.{i}.{s.hf_name}": s.hf_shape for s in specs[moe]})
    if not m.tie_embeddings:
        shapes["lm_head.weight"] = (vocab, m.hidden_size)
    return shapes


def _get(tree: dict, path: Sequence[str], what: str):
    node = tree
    for key in path:
        if not isinstance(node, dict) or key not in node:
            raise HfConversionError(f"params have no {'/'.join(path)} (needed for {what}); "
                                    "are these jaxtrain params of this model config?")
        node = node[key]
    return np.asarray(node)


def params_from_hf(state_dict: dict[str, np.ndarray], model_cfg: ModelConfig,
                   hf_config: dict | None = None) -> dict:
    """Our pure-dict params (numpy, `model_cfg.param_dtype`) from a HF Llama, Mixtral or
    DeepSeek-V3 state dict; `hf_config` (its config.json) tells DeepSeek-V3's rope layout
    (rope_interleave, default true) and MTP layers (num_nextn_predict_layers, skipped).

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
    expected = _hf_shapes(m, vocab, hf_config)
    ignored = {n for n in state_dict if n.endswith("rotary_emb.inv_freq")}  # old files: a buffer
    if m.tie_embeddings:
        ignored.add("lm_head.weight")  # some tied checkpoints still store the shared matrix
    if m.mla is not None:
        ignored |= hf_deepseek.mtp_tensors(
            state_dict, m, int((hf_config or {}).get("num_nextn_predict_layers") or 0))
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
    slots = layer_slots(m)
    depth = {stack: sum(s == stack for s, _, _ in slots) for stack, _, _ in slots}
    specs = {moe: _layer_specs(m, moe, hf_config) for moe in set(m.moe_layers)}
    stacks: dict = {}
    for i, (stack, row, moe) in enumerate(slots):
        for spec in specs[moe]:
            # Fill a preallocated [L, ...] array layer by layer: one copy of the weights.
            key = (stack, *spec.path)
            if key not in stacks:
                ours = np.float32 if spec.path[-1] == hf_deepseek.BIAS else dtype  # fp32 leaf
                stacks[key] = np.empty((depth[stack], *spec.layer_shape(m)), ours)
            target = stacks[key][row] if spec.expert is None else stacks[key][row, spec.expert]
            target[...] = spec.to_ours(fetch(f"model.layers.{i}.{spec.hf_name}"))
    for path, stacked in stacks.items():
        set_path(params, path, stacked)
    return params


def params_to_hf(params: dict, model_cfg: ModelConfig, *, dtype: str | None = None
                 ) -> dict[str, np.ndarray]:
    """A HF Llama, Mixtral or DeepSeek-V3 state dict from our pure-dict params, keeping only
    the first `model_cfg.vocab_size` (real vocab) rows of a padded embedding. `dtype`: cast to
    it (default: the params' own dtype; the DeepSeek router and its bias stay fp32)."""
    m = model_cfg
    cast = (lambda w: w.astype(_NP_DTYPES[dtype])) if dtype else (lambda w: w)  # noqa: E731
    embed_VD = _get(params, ("embed",), "model.embed_tokens.weight")
    if embed_VD.shape[0] < m.vocab_size or embed_VD.shape[1] != m.hidden_size:
        raise HfConversionError(f"params embed has shape {embed_VD.shape} but the config needs "
                                f"at least ({m.vocab_size}, {m.hidden_size})")
    out = {"model.embed_tokens.weight": cast(embed_VD[:m.vocab_size])}
    check_exportable(m)
    slots = layer_slots(m)
    depth = {stack: sum(s == stack for s, _, _ in slots) for stack, _, _ in slots}
    specs = {moe: _layer_specs(m, moe) for moe in set(m.moe_layers)}
    for i, (stack, row, moe) in enumerate(slots):
        for spec in specs[moe]:
            stacked = _get(params, (stack, *spec.path), f"model.layers.{i}.{spec.hf_name}")
            shape = (depth[stack], *spec.layer_shape(m))
            if stacked.shape != shape:
                raise HfConversionError(f"params {stack}/{'/'.join(spec.path)} has shape "
                                        f"{stacked.shape} but the config needs {shape}")
            w = stacked[row] if spec.expert is None else stacked[row, spec.expert]
            w = spec.to_hf(w)
            out[f"model.layers.{i}.{spec.hf_name}"] = w.astype(np.float32) if spec.fp32 else cast(w)
    out.update(hf_deepseek.zero_bias(m))
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
    return json.loads(cfg_path.read_text()), read_safetensors_folder(hf_dir)


def save_hf_checkpoint(out_dir: str | pathlib.Path, params: dict, model_cfg: ModelConfig, *,
                       dtype: str = "float32", max_shard_bytes: int = 5 * 2**30) -> None:
    """Write HF config.json + model.safetensors (or model-0000i-of-0000n.safetensors and an
    index when larger than `max_shard_bytes`). `model_cfg.vocab_size` is the real vocab."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    refuse_overwrite(out_dir, "model*.safetensors*")
    write_safetensors_shards(out_dir, params_to_hf(params, model_cfg, dtype=dtype),
                             max_shard_bytes)
    hf_config = hf_config_from_model(model_cfg, dtype=dtype)
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2))


# ----------------------------------------------------------------------------- CLI

def import_hf(hf_dir: str | pathlib.Path, out_dir: str | pathlib.Path) -> Config:
    """HF folder -> import folder (see module docstring); returns the written Config."""
    hf_dir, out_dir = pathlib.Path(hf_dir), pathlib.Path(out_dir)
    hf_config, state_dict = load_hf_checkpoint(hf_dir)
    cfg = Config(model=model_config_from_hf(hf_config))
    params = params_from_hf(state_dict, cfg.model, hf_config)
    out_dir.mkdir(parents=True, exist_ok=True)
    refuse_overwrite(out_dir, PARAMS_FILE)  # before copying anything into it
    if _copy_tokenizer(hf_dir, out_dir):
        cfg.data.tokenizer = str(out_dir.resolve())
    save_params(out_dir, params, cfg)
    return cfg


def export_hf(checkpoint: str | pathlib.Path, out_dir: str | pathlib.Path, *,
              step: int | None = None, dtype: str = "float32",
              max_shard_bytes: int = 5 * 2**30) -> None:
    """Our checkpoint (see `read_checkpoint`) -> HF folder, with the run's tokenizer if any.
    Multi-token prediction modules (params["mtp"], model.mtp) are dropped, and said so: they
    are a training objective, not part of the model a HF checkpoint loads."""
    params, cfg = read_checkpoint(checkpoint, step)
    if params.pop("mtp", None) is not None:
        print(f"export: dropping the {cfg.model.mtp_depths} multi-token prediction module(s)",
              file=sys.stderr)
    save_hf_checkpoint(out_dir, params, cfg.model, dtype=dtype, max_shard_bytes=max_shard_bytes)
    tok = pathlib.Path(cfg.data.tokenizer)
    if cfg.data.tokenizer != "byte":
        _copy_tokenizer(tok if tok.is_dir() else tok.parent, pathlib.Path(out_dir))


def _copy_tokenizer(src: pathlib.Path, dst: pathlib.Path) -> bool:
    """Copy a Hugging Face tokenizer's files from src to dst, if src holds one."""
    if not (src / "tokenizer.json").is_file():
        return False
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtrain.hf",
                                     description="Convert Llama, Mixtral and DeepSeek-V3 "
                                     "checkpoints to/from Hugging Face.")
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
