"""Megatron's recompute options as jax.checkpoint policies over the scanned layer stack.

    granularity=none                       save everything (no jax.checkpoint at all)
    granularity=selective modules=[...]    recompute those submodules, save the other tagged
                                           activations (Megatron --recompute-granularity selective)
    granularity=full method=uniform N      layers in chunks of N; only each chunk's input is kept
    granularity=full method=block N        the first N layers (of each pipeline chunk) fully
                                           recomputed, the rest save everything
    offload=true                           (selective) the selected modules' activations go to
                                           pinned host memory instead of being recomputed
    policy=NAME | NAME:a,b | save:a,b      escape hatch: a jax.checkpoint_policies entry, a
                                           name-list factory with its tags, or the tags to save
    policy=auto memory_budget_gb=G         resolved before the step is built by
                                           jaxtrain.tools.remat_sweep.choose_policy

`layer_runner(r)` returns the `run_layers(block_fn, x, stacked_state)` that the model's layer
scan uses (model.Ops.run_layers); `validate(r, layers_per_chunk)` checks a config the way
Megatron's argument checks do.

What selective saves. A checkpointed layer under `save_only_these_names(keep)` stores exactly
the tagged values in `keep` that the backward pass needs and recomputes everything untagged
from them: RoPE, the residual after attention, norm statistics, silu(gate) (elementwise, no
matmul FLOPs) and the attention core's internals — scores and softmax probabilities (and, in
a flash kernel, its logsumexp).

Megatron's `--recompute-modules core_attn` re-runs QK^T, softmax and PV in the backward, but
the core's output (the context) stays in memory as the saved input of the out projection. So
`core_attn` here drops no tag: the context (tag `core_attn`) is kept, and XLA then needs to
recompute only QK^T and softmax for the attention backward — half of Megatron's recompute for
the same memory. `core_attn_out` also drops the context (PV recomputed too: one [B, S, H·E]
tensor per layer less, twice the attention recompute). Because the core's internals carry no
tag, every selective policy recomputes them, with or without `core_attn` in the list: unlike
Megatron, `modules=[mlp]` does not keep the s×s probabilities (they would need a tag inside
jaxtrain.model.attention). `mlp` drops gate/up/act: gate and up are recomputed, the down projection
is not (its output feeds nothing the backward needs). `layernorm` drops both norm outputs.

MoE layers (Megatron's MoE modules, model/moe.py's tags): `moe_act` drops the experts' SwiGLU
(recomputed from the saved gate and up, no matmul); `moe` the whole routed part, router
choices, gate/up, SwiGLU and expert outputs (all three expert GEMMs and, under expert
parallelism, the dispatch re-run in the backward: the combine's weight gradient needs the
expert outputs); `shared_experts` the shared experts' gate/up and SwiGLU (gate and up re-run).
The router's GEMM re-runs under every selective policy (its logits are untagged, like the
attention core's insides). The dense MLP's tags do not touch the shared experts (theirs are
shared_*).

MLA (model/mla.py): `mla_up_proj` (Megatron's name) drops the up-projected q, k and v: the
backward re-runs the q and KV up-projections from the saved latents (tag qkv_proj there).
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxtrain import compat
from jaxtrain.config import ConfigError, RematConfig
from jaxtrain.ledger.experts import MODULE_TAGS as MOE_MODULES
from jaxtrain.model import llama, mla, moe
from jaxtrain.model.llama import scan_layers

# Every tag a layer's activations carry: the dense block's, the MoE layer's, MLA's.
REMAT_TAGS = llama.REMAT_TAGS + moe.REMAT_TAGS + mla.REMAT_TAGS

# remat.modules -> the tags it stops saving: Megatron's --recompute-modules names first (its
# MoE ones: moe_act, moe, shared_experts), then our finer tags (see the module docstring for
# why core_attn drops none).
MODULES: dict[str, tuple[str, ...]] = {
    "core_attn": (),
    "mlp": ("mlp_in", "mlp_act", "mlp_out"),
    "layernorm": ("attn_norm", "mlp_norm"),
    "core_attn_out": ("core_attn",),
    **MOE_MODULES,
    **{tag: (tag,) for tag in REMAT_TAGS
       if tag not in ("layer_input", "core_attn") and tag not in MOE_MODULES},
}

# jax.checkpoint_policies entries that build a policy from a list of names (policy=NAME:a,b).
_NAME_FACTORIES = ("save_only_these_names", "save_any_names_but_these",
                   "save_anything_except_these_names")
# Entries that need arguments other than names: not expressible as a string here.
_OTHER_FACTORIES = ("save_and_offload_only_these_names", "offload_dot_with_no_batch_dims",
                    "save_from_both_policies")

OFFLOAD_SRC, OFFLOAD_DST = "device", "pinned_host"


class RematConfigError(ConfigError):
    """A remat.* combination that cannot run; the message names the keys to change."""


# ----------------------------------------------------------------------------- validation

def validate(r: RematConfig, layers_per_chunk: int | Sequence[int]) -> None:
    """Raise RematConfigError for combinations Megatron rejects or that cannot run here.

    layers_per_chunk: layers each pipeline chunk (stage, or virtual stage when interleaved)
    scans; a sequence when chunks differ (uneven first/last stages).
    """
    chunks = (layers_per_chunk,) if isinstance(layers_per_chunk, int) else tuple(layers_per_chunk)
    _check_modules(r)
    if r.policy == "auto":
        raise RematConfigError(
            "remat.policy=auto must be resolved before the step is built: call "
            "jaxtrain.tools.remat_sweep.choose_policy(cfg, mesh) (train.py does) or name a policy")
    if r.policy:
        if r.granularity != "none" or r.num_layers or r.offload:
            raise RematConfigError(
                f"remat.policy={r.policy} replaces granularity/num_layers/offload; set "
                "remat.granularity=none, remat.num_layers=0 and remat.offload=false with it")
        policy_from_name(r.policy)  # raises on an unknown name or tag
        return
    if r.granularity == "full":
        if r.num_layers < 1:
            raise RematConfigError(
                "remat.granularity=full needs remat.method and remat.num_layers >= 1 "
                "(method=uniform: layers per recomputed chunk, 1 = every layer; method=block: "
                "how many layers of each pipeline stage to recompute)")
        if r.method == "uniform":
            bad = sorted({c for c in chunks if c % r.num_layers})
            if bad:
                raise RematConfigError(
                    f"remat.method=uniform: remat.num_layers={r.num_layers} does not divide the "
                    f"{_fmt_chunks(bad)} layers per stage; use a divisor of "
                    f"{_fmt_chunks(bad)}")
        elif r.num_layers > min(chunks):
            raise RematConfigError(
                f"remat.method=block: remat.num_layers={r.num_layers} exceeds the {min(chunks)} "
                f"layers per stage; use at most {min(chunks)} (all of them = uniform with 1)")
        if r.offload:
            raise RematConfigError(
                "remat.offload=true offloads the selected modules' activations: it needs "
                "remat.granularity=selective (full recompute keeps only layer inputs)")
        return
    # Megatron rejects both with selective; with none they would be silently ignored.
    also = " (Megatron rejects it too)" if r.granularity == "selective" else ""
    if r.num_layers:
        raise RematConfigError(
            f"remat.num_layers={r.num_layers} is only used with remat.granularity=full; unset "
            f"it with remat.granularity={r.granularity}{also}")
    if r.method != "uniform":
        raise RematConfigError(
            f"remat.method={r.method} is only used with remat.granularity=full; remove it "
            f"with remat.granularity={r.granularity}{also}")
    if r.granularity == "none":
        if r.offload:
            raise RematConfigError("remat.offload=true needs remat.granularity=selective and "
                                   "remat.modules naming what to offload")
        return
    if not r.modules:
        raise RematConfigError("remat.granularity=selective needs remat.modules, e.g. "
                               f"core_attn; allowed: {', '.join(MODULES)}")
    if r.offload:
        if not recomputed_tags(r):
            raise RematConfigError(
                f"remat.offload=true with remat.modules={','.join(r.modules)}: nothing tagged to "
                "offload (the attention core's internals are untagged); list tagged modules, "
                "e.g. mlp or core_attn_out")
        check_offload_supported()


def _check_modules(r: RematConfig) -> None:
    """remat.modules names known modules whatever the granularity, and a list other than the
    default is refused where nothing reads it (granularity none or full, or a policy): a
    misspelt or inapplicable list never trains silently as something else."""
    for mod in r.modules:
        if mod not in MODULES:
            raise RematConfigError(f"remat.modules: unknown module {mod!r}{_hint(mod, MODULES)}"
                                   f"; allowed: {', '.join(MODULES)}")
    if r.modules != RematConfig().modules and (r.policy or r.granularity != "selective"):
        used = f"remat.policy={r.policy}" if r.policy else f"remat.granularity={r.granularity}"
        raise RematConfigError(
            f"remat.modules={','.join(r.modules)} is only used with remat.granularity=selective "
            f"and no remat.policy; with {used} nothing reads it: set "
            "remat.granularity=selective or drop remat.modules")


def _fmt_chunks(chunks) -> str:
    return "/".join(map(str, chunks))


def _hint(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_offload_supported(device=None) -> None:
    """Raise unless `device` (default: the first device) can reach pinned host memory."""
    device = device or jax.devices()[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # backends without memory spaces
        kinds = set()
    if OFFLOAD_DST not in kinds:
        raise RematConfigError(
            f"remat.offload=true needs '{OFFLOAD_DST}' memory, which the {device.platform} "
            f"device {device} does not expose (memories: {sorted(kinds) or 'none'}); set "
            "remat.offload=false to recompute instead")


# ----------------------------------------------------------------------------- policies

def _check_tags(what: str, tags: Sequence[str]) -> None:
    unknown = [t for t in tags if t not in REMAT_TAGS]
    if unknown:
        raise RematConfigError(f"{what}: unknown tags {unknown}; tags: {', '.join(REMAT_TAGS)}")
    if not tags:
        raise RematConfigError(f"{what}: name at least one tag; tags: {', '.join(REMAT_TAGS)}")


def policy_from_name(name: str):
    """A jax.checkpoint policy from remat.policy's spelling.

    `NAME` (a ready policy such as dots_saveable or nothing_saveable), `NAME:a,b` (a
    name-list factory such as save_only_these_names or save_anything_except_these_names,
    with our tags) or `save:a,b` (short for save_only_these_names:a,b).
    """
    base, sep, rest = name.partition(":")
    tags = [t.strip() for t in rest.split(",") if t.strip()]
    if base == "save":
        base = "save_only_these_names"
    known = sorted(n for n in dir(jax.checkpoint_policies) if not n.startswith("_"))
    if base not in known:
        raise RematConfigError(
            f"remat.policy={name!r}: {base!r} is not a jax.checkpoint_policies entry"
            f"{_hint(base, known)}; use one of {', '.join(known)} or save:tag1,tag2")
    if base in _OTHER_FACTORIES:
        raise RematConfigError(
            f"remat.policy={base} needs arguments a string cannot carry; use "
            "remat.granularity=selective remat.offload=true for host offload")
    factory = getattr(jax.checkpoint_policies, base)
    if base in _NAME_FACTORIES:
        if not sep:
            raise RematConfigError(f"remat.policy={base} builds a policy from tags: write "
                                   f"remat.policy={base}:tag1,tag2")
        _check_tags(f"remat.policy={name}", tags)
        return factory(*tags)
    if sep:
        raise RematConfigError(f"remat.policy={name!r}: {base} takes no tag list; write "
                               f"remat.policy={base}")
    return factory


def recomputed_tags(r: RematConfig) -> list[str]:
    """The tags a selective config stops saving (recomputes, or offloads when r.offload)."""
    return sorted({tag for mod in r.modules for tag in MODULES[mod]})


def selective_policy(r: RematConfig):
    """Save every tag but the selected modules'; offload those instead when r.offload."""
    recompute = recomputed_tags(r)
    keep = [t for t in REMAT_TAGS if t not in recompute]
    if r.offload:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=keep, names_which_can_be_offloaded=recompute,
            offload_src=OFFLOAD_SRC, offload_dst=OFFLOAD_DST)
    return jax.checkpoint_policies.save_only_these_names(*keep)


# ----------------------------------------------------------------------------- layer runners

def _checkpoint(fn, policy):
    # Every checkpoint here wraps a scan body (or is fenced, below), so XLA cannot CSE the
    # recompute with the forward pass; the barriers prevent_cse adds would only hinder fusion
    # (jax.checkpoint's docstring recommends prevent_cse=False inside scan).
    return jax.checkpoint(fn, policy=policy, prevent_cse=False)


def opaque_zeros(x, keep: int = 0):
    """Zeros shaped like x's first `keep` dims that XLA cannot prove are zero: computed from
    x, so whatever takes them waits for x (a fence that changes no value; NaN in x gives 0)."""
    z = jnp.minimum(jnp.abs(x), 0).min(axis=tuple(range(keep, x.ndim)))
    return jnp.where(jnp.isnan(z), 0, z)


def _fenced(ckpt_fn):
    """`ckpt_fn(s, x)` whose backward cannot recompute before the cotangent has arrived.

    A scan of length one compiles to a one-trip loop that XLA inlines; the recompute then
    depends only on saved values and the scheduler is free to run it in the forward pass,
    which keeps its activations alive all step and undoes the remat (measured on CPU: block
    with num_layers=1 used more memory than none). Adding an opaque zero derived from the
    cotangent to the saved activations makes the recompute wait for the backward pass
    (optimization_barrier would not do: XLA removes barriers before scheduling).
    """
    @jax.custom_vjp
    def run(s, carry):
        return ckpt_fn(s, carry)

    def fwd(s, carry):
        return jax.vjp(ckpt_fn, s, carry)

    def bwd(vjp, ct):
        # The carry is x_BSD, (x_BSD, MoeStats) or (x_BSD, accumulator): x's cotangent is
        # its first leaf with a [B, S] lead (the stats' are scalars; x comes first).
        ct_BSD = next(a for a in jax.tree.leaves(ct) if a.ndim >= 2)
        zero_BS = opaque_zeros(ct_BSD, keep=2)

        def fence(r):
            # Saved activations lead with [B, S]; parameters do not and are left alone.
            if not (jnp.issubdtype(r.dtype, jnp.floating) and r.shape[:2] == ct_BSD.shape[:2]):
                return r
            return r + zero_BS.reshape(zero_BS.shape + (1,) * (r.ndim - 2)).astype(r.dtype)
        return compat.map_vjp_residuals(fence, vjp)(ct)

    run.defvjp(fwd, bwd)
    return run


def _scan_checkpointed(fn, policy, x, stacked):
    """scan(checkpoint(fn)) over the leading dim of `stacked`, fenced when it has length 1."""
    if jax.tree.leaves(stacked)[0].shape[0] == 1:
        return _fenced(_checkpoint(fn, policy))(jax.tree.map(lambda a: a[0], stacked), x)
    return scan_layers(_checkpoint(fn, policy), x, stacked)


def _take(stacked, start, stop):
    return jax.tree.map(lambda a: a[start:stop], stacked)


def single_layer_runner(r: RematConfig) -> Callable:
    """`run(block_fn, x_BSD, layer_state) -> x_BSD` for one layer apart from the stack (the
    multi-token prediction modules' blocks) under the stack's policy: a layer of a stack of
    one (full recompute checkpoints it whole: a uniform group of one layer)."""
    if not r.policy and r.granularity == "full":
        r = dataclasses.replace(r, method="uniform", num_layers=1)
    run = layer_runner(r)
    return lambda fn, x, state: run(fn, x, jax.tree.map(lambda a: a[None], state))


def layer_runner(r: RematConfig) -> Callable:
    """`run_layers(block_fn, x_BSD, stacked_state) -> x_BSD` for this remat config.

    `block_fn(layer_state, x) -> x` is one layer; `stacked_state` has a leading layers dim
    (one pipeline chunk's layers when the pipeline calls this per chunk).
    """
    if r.policy == "auto":
        raise RematConfigError("remat.policy=auto must be resolved by "
                               "jaxtrain.tools.remat_sweep.choose_policy before building the model")
    nothing = jax.checkpoint_policies.nothing_saveable
    if r.policy:
        policy = policy_from_name(r.policy)
        return lambda fn, x, st: _scan_checkpointed(fn, policy, x, st)
    if r.granularity == "none":
        return scan_layers
    if r.granularity == "selective":
        policy = selective_policy(r)
        return lambda fn, x, st: _scan_checkpointed(fn, policy, x, st)
    n = r.num_layers
    if r.method == "uniform" and n == 1:
        # One layer per checkpoint: the layer itself is the scan body. (A scan of one inside
        # each checkpoint kept the recompute's FSDP weight gathers apart from the backward's:
        # 17 all-gathers per layer instead of block's 12.)
        return lambda fn, x, stacked: _scan_checkpointed(fn, nothing, x, stacked)
    if r.method == "uniform":
        def run_uniform(fn, x, stacked):
            # [L, ...] -> [L/n, n, ...]: the outer scan checkpoints a group of n layers, so only
            # every n-th layer input is stored and the backward recomputes a group at a time.
            grouped = jax.tree.map(lambda a: a.reshape(a.shape[0] // n, n, *a.shape[1:]), stacked)
            return _scan_checkpointed(lambda group, c: scan_layers(fn, c, group), nothing, x,
                                      grouped)
        return run_uniform

    def run_block(fn, x, stacked):
        # Two scans over slices of the stack (XLA copies the slices: one extra copy of the
        # chunk's layer parameters, small next to the activations block saves).
        total = jax.tree.leaves(stacked)[0].shape[0]
        x = _scan_checkpointed(fn, nothing, x, _take(stacked, 0, n))
        return scan_layers(fn, x, _take(stacked, n, total)) if n < total else x
    return run_block


def span_runner(r: RematConfig):
    """`(start, stop) -> run_layers` for a layer range of the stack.

    Every range gets the configured runner, except that block:N keeps meaning "the first N
    layers are fully recomputed": each range recomputes its share of those N layers.
    """
    if r.policy or not (r.granularity == "full" and r.method == "block"):
        runner = layer_runner(r)
        return lambda start, stop: runner

    def for_span(start, stop):
        n = min(max(r.num_layers - start, 0), stop - start)
        if n == 0:
            return layer_runner(RematConfig())
        return layer_runner(dataclasses.replace(r, num_layers=n))
    return for_span


def label(r: RematConfig) -> str:
    """The shell-friendly name of a remat config (what `parse` reads back): none,
    selective:core_attn,mlp, offload:core_attn, uniform:N, block:N, or the policy string."""
    if r.policy:
        return r.policy
    if r.granularity == "selective":
        return ("offload:" if r.offload else "selective:") + ",".join(r.modules)
    if r.granularity == "full":
        return f"{r.method}:{r.num_layers}"
    return "none"


def parse(text: str) -> RematConfig:
    """A RematConfig from `label`'s spelling; anything else is taken as remat.policy."""
    text = text.strip()
    head, sep, rest = text.partition(":")
    if text == "none":
        return RematConfig()
    if text == "full":
        return RematConfig(granularity="full", method="uniform", num_layers=1)
    if head in ("selective", "offload"):
        modules = tuple(m.strip() for m in rest.split(",") if m.strip())
        return RematConfig(granularity="selective", modules=modules or ("core_attn",),
                           offload=head == "offload")
    if head in ("uniform", "block"):
        if not rest.strip().isdigit():
            raise RematConfigError(f"remat policy {text!r}: write {head}:N with N layers")
        return RematConfig(granularity="full", method=head, num_layers=int(rest))
    return RematConfig(policy=text)
