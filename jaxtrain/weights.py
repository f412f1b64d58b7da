"""Weights on disk and their vocab padding: safetensors files (memory-mapped, bf16 and fp8
included), our flat tensor names, and the import folder `checkpoint.init_from` reads (written
by `python -m jaxtrain.hf import`). The training path reads these; hf.py maps Hugging Face's
names onto ours.
"""
from __future__ import annotations

import dataclasses
import json
import math
import mmap
import pathlib
import struct
from typing import Sequence

import ml_dtypes
import numpy as np

from jaxtrain.config import Config, ConfigError, from_dict

PARAMS_FILE = "params.safetensors"


class HfConversionError(ConfigError):
    """A checkpoint or config that cannot be converted; the message names the key or tensor."""


def pad_vocab(params: dict, vocab_size: int) -> dict:
    """`params` with embed rows / lm_head columns zero-padded up to `vocab_size`."""
    v = np.shape(params["embed"])[0]
    if v == vocab_size:
        return params
    if v > vocab_size:
        raise HfConversionError(f"params have {v} vocab rows, more than vocab_size={vocab_size}")
    out = dict(params)
    out["embed"] = np.pad(np.asarray(params["embed"]), ((0, vocab_size - v), (0, 0)))
    if "lm_head" in params:
        out["lm_head"] = np.pad(np.asarray(params["lm_head"]), ((0, 0), (0, vocab_size - v)))
    return out


# ----------------------------------------------------------------------------- safetensors files

# numpy has no bfloat16/float8, which is what real Llama checkpoints hold, so safetensors'
# numpy loader refuses them; the format is simple enough to memory-map directly (which also
# keeps an 8B import from holding the file and the converted copy at once).
_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": ml_dtypes.bfloat16,
              "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
              "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}


def read_safetensors(path: str | pathlib.Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as read-only numpy arrays over a memory map."""
    path = pathlib.Path(path)
    with open(path, "rb") as fh:
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size else b""
    if len(buf) < 8:
        raise HfConversionError(f"{path} is not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", buf[:8])
    try:
        header = json.loads(bytes(buf[8:8 + n]))
    except ValueError:
        raise HfConversionError(f"{path} is not a safetensors file (bad header)") from None
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _ST_DTYPES:
            raise HfConversionError(
                f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        out[name] = np.frombuffer(buf, dtype=np.dtype(_ST_DTYPES[info["dtype"]]),
                                  count=math.prod(info["shape"]),
                                  offset=8 + n + start).reshape(info["shape"])
        if out[name].nbytes != end - start:
            raise HfConversionError(f"{path}: tensor {name!r} size does not match its shape")
    return out


def write_safetensors(path: pathlib.Path, tensors: dict[str, np.ndarray], fmt: str) -> None:
    from safetensors.numpy import save_file
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path),
              metadata={"format": fmt})


def read_safetensors_folder(folder: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a folder's *.safetensors, following model.safetensors.index.json (the
    Hugging Face layout) when the weights are sharded."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        weight_map = None
    if not files:
        raise HfConversionError(f"{folder} has no *.safetensors weights (.bin/.pth files are not "
                                "read: re-save with safe_serialization=True)")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        if not (folder / name).is_file():
            raise HfConversionError(f"{index} names {name}, which is not in {folder}")
        tensors.update(read_safetensors(folder / name))
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise HfConversionError(f"{index} lists tensor {missing[0]!r} but no shard holds it")
    return tensors


def write_safetensors_shards(folder: pathlib.Path, tensors: dict[str, np.ndarray],
                             max_shard_bytes: int) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors and their index when the tensors
    are larger than `max_shard_bytes` (the Hugging Face layout)."""
    shards: list[dict] = [{}]
    size = 0
    for name, w in tensors.items():
        if shards[-1] and size + w.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = w
        size += w.nbytes
    if len(shards) == 1:
        write_safetensors(folder / "model.safetensors", tensors, "pt")
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / fname, shard, "pt")
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": sum(w.nbytes for w in tensors.values())},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def refuse_overwrite(out_dir: pathlib.Path, pattern: str) -> None:
    stale = sorted(p.name for p in out_dir.glob(pattern))
    if stale:
        raise HfConversionError(f"{out_dir} already holds {', '.join(stale[:3])}; pass an empty "
                                "output folder (stale shards would be loaded alongside)")


def set_path(tree: dict, path: Sequence[str], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# ----------------------------------------------------------------------------- our params on disk

def flatten(params: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}/"))
        else:
            out[name] = np.asarray(value)
    return out


def unflatten(flat: dict[str, np.ndarray]) -> dict:
    out: dict = {}
    for name, value in flat.items():
        set_path(out, name.split("/"), value)
    return out


_RECIPE = '''"""Written by `python -m jaxtrain.hf import`: the imported model's config as a recipe."""
import json
import pathlib

from jaxtrain.config import from_dict


def get_config():
    return from_dict(json.loads((pathlib.Path(__file__).parent / "config.json").read_text()))
'''


def save_params(out_dir: str | pathlib.Path, params: dict, cfg: Config) -> None:
    """An import folder: params.safetensors, config.json (a full Config) and recipe.py."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    refuse_overwrite(out_dir, PARAMS_FILE)
    write_safetensors(out_dir / PARAMS_FILE, flatten(params), "jaxtrain")
    # Training with the folder's recipe starts from these weights.
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(
        cfg.checkpoint, init_from=str(out_dir.absolute())))
    (out_dir / "config.json").write_text(cfg.to_json())
    (out_dir / "recipe.py").write_text(_RECIPE)


def load_params(directory: str | pathlib.Path) -> tuple[dict, Config]:
    """(pure-dict params, Config) of an import folder written by `save_params`."""
    directory = pathlib.Path(directory)
    if not (directory / PARAMS_FILE).is_file():
        raise HfConversionError(f"{directory} has no {PARAMS_FILE}; write one with "
                                "`python -m jaxtrain.hf import`")
    cfg = from_dict(json.loads((directory / "config.json").read_text()))
    return unflatten(read_safetensors(directory / PARAMS_FILE)), cfg


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
