"""Megatron's recompute options as jax.checkpoint policies over the scanned layer stack.

    granularity=none                       save everything
    granularity=selective modules=[...]    recompute those submodules, save the other tagged
                                           activations (Megatron --recompute-granularity selective)
    granularity=full method=uniform N      layers in chunks of N; only each chunk's input is kept
    granularity=full method=block N        the first N layers (of each stage) fully recomputed,
                                           the rest save everything
    offload=true                           the selected activations go to pinned host memory
                                           instead of being recomputed
    policy=NAME | save:a,b                 escape hatch: a jax.checkpoint_policies entry or a list
                                           of tags to save

`layer_runner(cfg)` returns the `run_layers(block_fn, x, stacked_state)` that the model's layer
scan uses (model.Ops.run_layers).
"""
from __future__ import annotations

import difflib
from typing import Callable

import jax

from jaxtrain.config import ConfigError, RematConfig
from jaxtrain.model import REMAT_TAGS

# Megatron's --recompute-modules names (and our finer tags) -> the tags they stop saving.
MODULES: dict[str, tuple[str, ...]] = {
    "core_attn": ("core_attn",),
    "mlp": ("mlp_in", "mlp_act", "mlp_out"),
    "layernorm": ("attn_norm", "mlp_norm"),
    **{tag: (tag,) for tag in REMAT_TAGS if tag != "layer_input"},
}


class RematConfigError(ConfigError):
    pass


def validate(r: RematConfig, layers_per_stage: int) -> None:
    if r.policy and r.policy != "auto":
        policy_from_name(r.policy)  # raises on an unknown name
        return
    if r.granularity == "full":
        if r.num_layers < 1:
            raise RematConfigError("remat.granularity=full needs remat.num_layers >= 1 (with "
                                   "method=uniform: layers per recomputed chunk; with "
                                   "method=block: how many layers per stage to recompute)")
        if r.method == "uniform" and layers_per_stage % r.num_layers:
            raise RematConfigError(
                f"remat.method=uniform: remat.num_layers={r.num_layers} must divide the "
                f"{layers_per_stage} layers per stage")
        if r.method == "block" and r.num_layers > layers_per_stage:
            raise RematConfigError(
                f"remat.method=block: remat.num_layers={r.num_layers} exceeds the "
                f"{layers_per_stage} layers per stage")
    elif r.num_layers:
        raise RematConfigError(f"remat.num_layers={r.num_layers} is only meaningful with "
                               "remat.granularity=full; unset it (Megatron rejects it too)")
    if r.granularity == "selective":
        if not r.modules:
            raise RematConfigError("remat.granularity=selective needs remat.modules, e.g. core_attn")
        for mod in r.modules:
            if mod not in MODULES:
                close = difflib.get_close_matches(mod, list(MODULES), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise RematConfigError(f"remat.modules: unknown module {mod!r}{hint}; allowed: "
                                       f"{', '.join(MODULES)}")
    if r.offload:
        if r.granularity != "selective":
            raise RematConfigError("remat.offload=true moves the selected modules' activations "
                                   "to host memory: it needs remat.granularity=selective")
        if jax.default_backend() == "cpu":
            raise RematConfigError("remat.offload=true needs a GPU or TPU (pinned host memory); "
                                   "the CPU backend has no device/host split. Use offload=false")


def policy_from_name(name: str):
    if name.startswith("save:"):
        tags = [t for t in name[len("save:"):].split(",") if t]
        unknown = [t for t in tags if t not in REMAT_TAGS]
        if unknown:
            raise RematConfigError(f"remat.policy={name}: unknown tags {unknown}; tags: "
                                   f"{', '.join(REMAT_TAGS)}")
        return jax.checkpoint_policies.save_only_these_names(*tags)
    known = [n for n in dir(jax.checkpoint_policies) if not n.startswith("_")]
    if name not in known:
        close = difflib.get_close_matches(name, known, n=2)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise RematConfigError(f"remat.policy={name!r} is not a jax.checkpoint_policies entry{hint}; "
                               "use one of those names or save:tag1,tag2")
    policy = getattr(jax.checkpoint_policies, name)
    return policy if name.startswith(("everything", "nothing", "dots", "checkpoint_dots")) else policy()


def selective_policy(r: RematConfig):
    recompute = sorted({tag for mod in r.modules for tag in MODULES[mod]})
    keep = [t for t in REMAT_TAGS if t not in recompute]
    if r.offload:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=keep, names_which_can_be_offloaded=recompute,
            offload_src="device", offload_dst="pinned_host")
    return jax.checkpoint_policies.save_only_these_names(*keep)


def _scan(fn, x, stacked):
    x, _ = jax.lax.scan(lambda c, s: (fn(s, c), None), x, stacked)
    return x


def _take(stacked, start, stop):
    return jax.tree.map(lambda a: a[start:stop], stacked)


def _full(block_fn):
    return jax.checkpoint(block_fn, policy=jax.checkpoint_policies.nothing_saveable)


def layer_runner(r: RematConfig) -> Callable:
    """`run_layers(block_fn, x_BSD, stacked_state) -> x_BSD` for this remat config."""
    if r.policy and r.policy != "auto":
        policy = policy_from_name(r.policy)
        return lambda fn, x, st: _scan(jax.checkpoint(fn, policy=policy), x, st)
    if r.granularity == "none":
        return _scan
    if r.granularity == "selective":
        policy = selective_policy(r)
        return lambda fn, x, st: _scan(jax.checkpoint(fn, policy=policy), x, st)
    n = r.num_layers
    if r.method == "uniform":
        def run_uniform(fn, x, stacked):
            grouped = jax.tree.map(lambda a: a.reshape(a.shape[0] // n, n, *a.shape[1:]), stacked)
            return _scan(_full(lambda group, c: _scan(fn, c, group)), x, grouped)
        return run_uniform

    def run_block(fn, x, stacked):
        total = jax.tree.leaves(stacked)[0].shape[0]
        x = _scan(_full(fn), x, _take(stacked, 0, n)) if n else x
        return _scan(fn, x, _take(stacked, n, total)) if n < total else x
    return run_block
