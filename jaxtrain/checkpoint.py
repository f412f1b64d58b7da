"""Orbax CheckpointManager: async saves every N steps and at the end, keep K, auto-resume.

A checkpoint holds the train state (params, optimizer state, step) and the data iterator's
position. The model has no stochastic layers, so the seed in config.json is the whole RNG
state. Restores go straight onto the current mesh's shardings, whatever mesh saved them.
"""
from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp

from jaxtrain.config import CheckpointConfig, ConfigError


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
                           "data": ocp.JsonCheckpointHandler()})
        self.cfg = cfg

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=True)

    def restore(self, step: int, abstract_state):
        """Restore `step` onto the shardings of `abstract_state` (ShapeDtypeStructs)."""
        self._check_shapes(step, abstract_state)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return restored["state"], restored["data"]

    def _check_shapes(self, step, abstract_state):
        meta = self.manager.item_metadata(step)
        saved = meta["state"] if meta is not None else None
        if saved is None:
            return
        saved_shapes = {_path_name(p): tuple(m.shape)
                        for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]}
        wanted = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
        wanted.sort(key=lambda pw: not _path_name(pw[0]).startswith("params"))  # params first
        for path, want in wanted:
            name = _path_name(path)
            have = saved_shapes.get(name)
            if have is None:
                raise CheckpointMismatchError(
                    f"checkpoint {self.directory}/{step} has no entry {name}; it was written for "
                    "a different model or optimizer. Use a fresh train.workdir or "
                    "checkpoint.resume=false")
            if have != tuple(want.shape):
                raise CheckpointMismatchError(
                    f"checkpoint {self.directory}/{step}: {name} has shape {have} but the "
                    f"configured model needs {tuple(want.shape)}; the model config differs from "
                    "the one that wrote it (compare config.json), or use a fresh train.workdir")

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
