"""Orbax CheckpointManager: async saves every N steps and at the end, keep K, auto-resume.

A checkpoint holds the train state (params, optimizer state, step), the data iterator's
position and the layer order of its layer-stacked leaves (layer_order.py: model order, or a
pipeline's chunk order). The model has no stochastic layers, so the seed in config.json is the
whole RNG state. Restores go straight onto the current mesh's shardings, whatever mesh saved
them; a checkpoint written in another layer order (another pipeline layout) is read in its own
order and converted once.
"""
from __future__ import annotations

import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import layer_order
from jaxtrain.config import CheckpointConfig, ConfigError
from jaxtrain.layer_order import LayerOrder

LAYOUT_ITEM = "layout"


class CheckpointMismatchError(ConfigError):
    """A checkpoint that does not fit the configured model; names the parameter."""


class Checkpointer:
    def __init__(self, directory: str | pathlib.Path, cfg: CheckpointConfig):
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True)
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "data": ocp.JsonCheckpointHandler(),
                           LAYOUT_ITEM: ocp.JsonCheckpointHandler()})

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict, order: LayerOrder | None = None) -> None:
        """Save asynchronously; `order`: the layer order of state's layer-stacked leaves."""
        items = {"state": ocp.args.StandardSave(state), "data": ocp.args.JsonSave(data_state)}
        if order is not None:
            items[LAYOUT_ITEM] = ocp.args.JsonSave(layer_order.to_json(order))
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, step: int, abstract_state, order: LayerOrder | None = None):
        """Restore `step` onto the shardings of `abstract_state` (ShapeDtypeStructs), whose
        layer-stacked leaves are in `order` (default: as saved)."""
        saved = order
        if order is not None:
            saved = read_layer_order(self.directory / str(step), order.num_layers)
            if saved.num_layers != order.num_layers:
                raise CheckpointMismatchError(
                    f"checkpoint {self.directory}/{step} holds {saved.num_layers} layers but the "
                    f"configured model has {order.num_layers}; use a fresh train.workdir")
        target = abstract_state if saved == order else _in_order(abstract_state, saved)
        self._check_shapes(step, target)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
        state = restored["state"]
        if saved != order:
            shardings = jax.tree.map(lambda a: a.sharding, abstract_state)
            state = jax.jit(lambda s: layer_order.convert(s, saved, order),
                            out_shardings=shardings)(state)
        return state, restored["data"]

    def _check_shapes(self, step, abstract_state):
        meta = self.manager.item_metadata(step)
        saved = meta["state"] if meta is not None else None
        if saved is None:
            return
        check_shapes(saved, abstract_state, f"checkpoint {self.directory}/{step}",
                     missing="it was written for a different model or optimizer. Use a fresh "
                     "train.workdir or checkpoint.resume=false",
                     different="the model config differs from the one that wrote it (compare "
                     "config.json), or use a fresh train.workdir")

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def check_shapes(have, want, source: str, *, missing: str, different: str) -> None:
    """Raise CheckpointMismatchError naming the first leaf of `want` (params first) that `have`
    lacks or holds in another shape; both are pytrees of things with a .shape."""
    have_shapes = {_path_name(p): tuple(a.shape)
                   for p, a in jax.tree_util.tree_flatten_with_path(have)[0]}
    wanted = jax.tree_util.tree_flatten_with_path(want)[0]
    wanted.sort(key=lambda pw: not _path_name(pw[0]).startswith("params"))
    for path, w in wanted:
        name = _path_name(path)
        if name not in have_shapes:
            raise CheckpointMismatchError(f"{source} has no entry {name}; {missing}")
        if have_shapes[name] != tuple(w.shape):
            raise CheckpointMismatchError(
                f"{source}: {name} has shape {have_shapes[name]} but the configured model needs "
                f"{tuple(w.shape)}; {different}")


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def read_layer_order(step_dir: str | pathlib.Path, num_layers: int) -> LayerOrder:
    """The layer order a checkpoint step folder was written in (model order when it recorded
    none: checkpoints from before the pipeline stored layers in chunk order)."""
    item = pathlib.Path(step_dir) / LAYOUT_ITEM
    if not item.is_dir():
        return LayerOrder.natural(num_layers)
    d = ocp.JsonCheckpointHandler().restore(item, ocp.args.JsonRestore())
    return layer_order.from_json(d, num_layers)


def read_saved_params(step_dir: str | pathlib.Path) -> dict:
    """Only the params of a checkpoint step folder, as host numpy arrays (any device count),
    in the layer order they were saved in."""
    state_dir = pathlib.Path(step_dir) / "state"
    ckptr = ocp.PyTreeCheckpointer()
    meta = ckptr.metadata(state_dir)
    tree = getattr(getattr(meta, "item_metadata", None), "tree", meta)
    if "params" not in tree:
        raise CheckpointMismatchError(f"{state_dir} holds no params; is it a jaxtrain train "
                                      "state?")
    params_meta = tree["params"]
    item = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params_meta)
    restore_args = jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray), params_meta)
    out = ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(
        item={"params": item}, restore_args={"params": restore_args}, partial_restore=True))
    return out["params"]


def read_params(step_dir: str | pathlib.Path, num_layers: int) -> dict:
    """A checkpoint step's params in model order (a pipelined run saves chunk order)."""
    return layer_order.convert(read_saved_params(step_dir), read_layer_order(step_dir, num_layers),
                               LayerOrder.natural(num_layers))


def _in_order(abstract_state, order: LayerOrder):
    """abstract_state with its layer-stacked leaves resized to `order`'s rows; their layers dim
    unsharded (another pipeline layout's rows need not split over this mesh's stages)."""
    def resize(a):
        sh = a.sharding
        if isinstance(sh, NamedSharding):
            sh = NamedSharding(sh.mesh, P(None, *tuple(sh.spec)[1:]))
        return jax.ShapeDtypeStruct((len(order.rows), *a.shape[1:]), a.dtype, sharding=sh)
    return layer_order.map_blocks(resize, abstract_state)
