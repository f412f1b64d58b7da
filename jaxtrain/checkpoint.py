"""Orbax CheckpointManager: async saves every N steps and at the end, keep K, auto-resume.

A checkpoint holds the train state (params, optimizer state, step), the data iterator's
position, the layer order of its layer-stacked leaves (layer_order.py: model order, or a
pipeline's chunk order) and a fingerprint of the state's values. The model has no stochastic
layers, so the seed in config.json is the whole RNG state. Restores go straight onto the
current mesh's shardings, whatever mesh saved them; a checkpoint written in another layer
order (another pipeline layout) is read in its own order and converted once.

Faults. Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it when every item
is written, so a save killed half-way never looks like a checkpoint: it is reported and
removed at the next start. A failed write (full disk, lost permissions) surfaces as
CheckpointSaveError, and the previous checkpoint stays (orbax deletes old steps only after a
new one is committed). Damage after the commit is caught at restore: orbax and TensorStore
reject truncated or unparsable files, the fingerprint (a wrap-around sum of the values'
bits, plain and index-weighted, per leaf; a hash of the data position) rejects files whose
bytes changed, and a step folder whose state holds another step (renamed, copied) is damage
too (restored, every later save would collide with it). The trainer then
resumes from the newest readable checkpoint and sets the damaged ones aside, or stops with
CheckpointCorruptError when none is readable; it never starts fresh over checkpoints.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import checkpoint_logs, checkpoint_vocab, compat
from jaxtrain.checkpoint_integrity import (  # noqa: F401 (the errors are this module's API)
    DATA_KEY, CheckpointCorruptError, CheckpointMismatchError, CheckpointSaveError,
    check_data_fingerprint, check_fingerprint, check_shapes, check_step, data_fingerprint,
    fingerprint, path_name as _path_name)
from jaxtrain.parallel import layer_order
from jaxtrain.config import CheckpointConfig, ConfigError
from jaxtrain.parallel.layer_order import LayerOrder
from jaxtrain.train_state import TrainState

LAYOUT_ITEM = "layout"
FINGERPRINT_ITEM = "fingerprint"
SET_ASIDE_SUFFIX = ".unreadable"


class Checkpointer:
    def __init__(self, directory: str | pathlib.Path, cfg: CheckpointConfig):
        self.directory = pathlib.Path(directory).absolute()
        # Saves a kill interrupted before orbax committed them; orbax removes them below.
        self.interrupted_saves = sorted(self.directory.glob(f"*{ocp.path.step.TMP_DIR_SUFFIX}*"))
        # A save's directories are made in save(), on this thread (a few mkdirs): made in
        # orbax's background threads, a failed mkdir (checkpoints/ lost its write permission)
        # left the threads waiting for it, and they held the process 300 s at exit (orbax's
        # coordination timeout). Its threads' own tracebacks of a failed save are dropped:
        # the failure reaches save()/wait() as an exception, reported in one line.
        checkpoint_logs.drop_orbax_save_tracebacks()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True,
            cleanup_tmp_directories=True, async_options=compat.orbax_sync_directory_options())
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "data": ocp.JsonCheckpointHandler(),
                           LAYOUT_ITEM: ocp.JsonCheckpointHandler(),
                           FINGERPRINT_ITEM: ocp.JsonCheckpointHandler()})
        self._in_flight: int | None = None  # the step an async save is writing

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: TrainState, data_state: dict,
             order: LayerOrder | None = None) -> None:
        """Save asynchronously; `order`: the layer order of state's layer-stacked leaves."""
        state = state.to_tree()
        items = {"state": ocp.args.StandardSave(state), "data": ocp.args.JsonSave(data_state),
                 FINGERPRINT_ITEM: ocp.args.JsonSave({**fingerprint(state),
                                                      DATA_KEY: data_fingerprint(data_state)})}
        if order is not None:
            items[LAYOUT_ITEM] = ocp.args.JsonSave(layer_order.to_json(order))
        with self._save_errors(self._in_flight):  # an earlier async save's failure lands here
            self.manager.wait_until_finished()
        self._in_flight = step
        with self._save_errors(step):
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def wait(self) -> None:
        """Block until the last save is committed (raises CheckpointSaveError if it failed)."""
        with self._save_errors(self._in_flight):
            self.manager.wait_until_finished()

    @contextlib.contextmanager
    def _save_errors(self, step: int | None):
        try:
            yield
        except Exception as e:
            kept = [s for s in _committed_steps(self.directory) if s != step]
            previous = (f"the latest complete checkpoint, {self.directory}/{kept[-1]}, is kept"
                        if kept else "there is no earlier checkpoint")
            fix = ("Free disk space or fix the permissions there, then rerun to resume"
                   if type(e).__name__ != "StepAlreadyExistsError" else
                   f"Move {self.directory}/{step} away (it is not this run's), then rerun")
            raise CheckpointSaveError(
                f"saving checkpoint {self.directory}/{step} failed ({_reason(e)}); {previous}. "
                f"{fix}") from e

    def restore_latest(self, abstract_state, order: LayerOrder | None = None, *, warn=print,
                       model=None):
        """(step, state, data state) of the newest checkpoint that reads back as it was saved,
        or None when there is none. Newer unreadable ones are renamed `<step>.unreadable`
        (a warning names each); when all are unreadable, CheckpointCorruptError names them."""
        unreadable: list[tuple[int, str]] = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                state, data_state = self.restore(step, abstract_state, order, model=model)
                problem = None
            except CheckpointMismatchError:
                raise  # the config changed: not damage, and no older step would fit either
            except CheckpointCorruptError as e:  # read back, but not as it was saved
                problem = str(e).removeprefix(f"{self._source(step)}: ")
            except Exception as e:  # truncated, garbage or missing files
                problem = _reason(e)
            if _any_process(problem is not None):
                unreadable.append((step, problem or "unreadable on another process"))
                continue
            for bad, why in unreadable:
                warn(f"warning: checkpoint {self.directory}/{bad} is unreadable ({why}); "
                     f"renamed it {self._set_aside(bad).name} and resumed from step {step}")
            if unreadable:
                self.manager.reload()
            return step, state, data_state
        if unreadable:
            raise CheckpointCorruptError(
                f"no checkpoint in {self.directory} can be read: "
                + "; ".join(f"step {s}: {why}" for s, why in unreadable)
                + ". Move them out of the way or use a fresh train.workdir to start from "
                "scratch")
        return None

    def _set_aside(self, step: int) -> pathlib.Path:
        target = self.directory / f"{step}{SET_ASIDE_SUFFIX}"
        n = 1
        while target.exists():
            n += 1
            target = self.directory / f"{step}{SET_ASIDE_SUFFIX}{n}"
        if jax.process_index() == 0:
            shutil.move(self.directory / str(step), target)
        _sync_processes(f"jaxtrain_set_aside_{step}")
        return target

    def restore(self, step: int, abstract_state: TrainState, order: LayerOrder | None = None,
                *, model=None):
        """(TrainState, data state) of `step`, restored onto the shardings of `abstract_state`
        (ShapeDtypeStructs), whose layer-stacked leaves are in `order` (default: as saved);
        CheckpointCorruptError when the values differ from those saved. With `model` (the
        configured ModelConfig, its real vocab) vocab tables padded for another tensor degree
        are re-padded (checkpoint_vocab.py), and a shape that differs is named by its cause."""
        abstract_state = abstract_state.to_tree()
        saved = order
        if order is not None:
            saved = read_layer_order(self.directory / str(step), order.num_layers)
            if saved.num_layers != order.num_layers:
                raise CheckpointMismatchError(
                    f"checkpoint {self.directory}/{step} holds {saved.num_layers} layers but the "
                    f"configured model has {order.num_layers}; use a fresh train.workdir")
        target = abstract_state if saved == order else _in_order(abstract_state, saved)
        saved_shapes = self._saved_shapes(step)
        if model is not None and saved_shapes is not None:
            target = checkpoint_vocab.as_saved(target, saved_shapes, model.vocab_size,
                                               _path_name)
        self._check_shapes(step, target, saved_shapes, model)
        items = {"state": ocp.args.StandardRestore(target), "data": ocp.args.JsonRestore()}
        has_fingerprint = (self.directory / str(step) / FINGERPRINT_ITEM).is_dir()
        if has_fingerprint:  # checkpoints from before fingerprints have none
            items[FINGERPRINT_ITEM] = ocp.args.JsonRestore()
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        state = restored["state"]
        source = self._source(step)
        if has_fingerprint:
            check_fingerprint(state, restored[FINGERPRINT_ITEM], source)
            check_data_fingerprint(restored["data"], restored[FINGERPRINT_ITEM], source)
        check_step(state, step, source)
        repadded = jax.tree.map(lambda a, b: a.shape != b.shape, target, abstract_state)
        if saved != order or any(jax.tree.leaves(repadded)):
            shardings = jax.tree.map(lambda a: a.sharding, abstract_state)

            def convert(s):
                s = layer_order.convert(s, saved, order)
                return checkpoint_vocab.repad(s, abstract_state, model.vocab_size, _path_name) \
                    if model is not None else s
            state = jax.jit(convert, out_shardings=shardings)(state)
        return TrainState.from_tree(state), restored["data"]

    def _source(self, step: int) -> str:
        return f"checkpoint {self.directory}/{step}"

    def _saved_shapes(self, step) -> dict | None:
        """{leaf name: shape} of the step's saved train state (None: orbax recorded none)."""
        meta = self.manager.item_metadata(step)
        saved = meta["state"] if meta is not None else None
        if saved is None:
            return None
        return {_path_name(p): tuple(a.shape)
                for p, a in jax.tree_util.tree_flatten_with_path(saved)[0]}

    def _check_shapes(self, step, abstract_state, saved_shapes, model):
        if saved_shapes is None:
            return

        def different(name, have, want):
            cause = (checkpoint_vocab.shape_cause(name, have, want, model) + ": "
                     if model is not None else "")
            return (f"{cause}the model config differs from the one that wrote it (compare "
                    "config.json), or use a fresh train.workdir")
        check_shapes(saved_shapes, abstract_state, self._source(step),
                     missing="it was written for a different model or optimizer. Use a fresh "
                     "train.workdir", different=different)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()


def check_fresh_start(directory: pathlib.Path, cfg: CheckpointConfig) -> None:
    """checkpoint.resume=false starts over from step 0; refuse when `directory` holds this run's
    checkpoints (the first save would collide with them, or mix two runs) before any compile."""
    steps = _committed_steps(directory)
    if not cfg.resume and steps:
        shown = ", ".join(map(str, steps[:5])) + (", ..." if len(steps) > 5 else "")
        raise ConfigError(
            f"checkpoint.resume=false starts over, but {directory} holds checkpoints (steps "
            f"{shown}) that it would collide with; set train.workdir to a fresh folder, or "
            "move those checkpoints away (nothing was deleted)")


def check_steps_left(directory: pathlib.Path, cfg: CheckpointConfig, steps: int) -> None:
    """Refuse, before anything is built, a resume whose newest checkpoint lies past
    `steps` (train.steps): it would do nothing and say nothing."""
    done = _committed_steps(directory)
    if cfg.resume and done and done[-1] > steps:
        raise ConfigError(
            f"train.steps={steps}, but {directory} already holds checkpoint {done[-1]}: nothing "
            f"to train. Set train.workdir to a fresh folder for a new run, or train.steps above "
            f"{done[-1]} to continue this one")


def _committed_steps(directory: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) \
        if directory.is_dir() else []


def _reason(e: BaseException) -> str:
    """One short line for an orbax / TensorStore / OS error (theirs run to kilobytes)."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    code = re.search(r"os_error_code='(\d+)'", str(e))
    if code:
        return f"{os.strerror(int(code.group(1)))} ({str(e).split(':', 1)[0]})"
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text.split(". See full TensorStore details")[0]
    return f"{type(e).__name__}: {text[:200]}"


def _any_process(flag: bool) -> bool:
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def _sync_processes(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


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
    state_dir = pathlib.Path(step_dir).absolute() / "state"  # orbax wants absolute paths
    ckptr = ocp.PyTreeCheckpointer()
    tree = compat.saved_tree_metadata(ckptr, state_dir)
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
