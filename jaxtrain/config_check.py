"""`check(cfg, n_devices)`: every rule a config must pass to run on n devices, before anything
is built or compiled. executors/setup.build calls it (so the trainer, `--inspect-sharding`, the
dry run's and the remat sweep's compiles do), and the dry run on the config it scales to the
devices.

Each rule lives once; check applies them all, in this order:
- `config.validate` (also Config.validate, at load): what needs no devices — positive sizes
  and degrees, GQA groups, the head dim, seq_len vs max_seq_len, at most one -1 degree,
  sequence parallelism needs tensor, model.mtp (its schedule; not with FP8 or init_from),
  the context strategy vs the attention core and the sequence vs a fixed context degree, the
  batch vs the fixed data-parallel degrees and microbatches, the data source, durations, checkpoint keys, the fp8 section. A rule that
  also holds elsewhere is a function there, called with the caller's error class: check_gqa
  (attention.select, for model configs built without validate), check_fill,
  check_batch_split and check_context_split (the ledger, on the resolved layout),
  check_context_core (the context-parallel attention, on the core it is given), check_fp8
  (fp8.recipe_of).
- `ledger.layout` (layout_from_config / validate_layout, LayoutError): the layout resolved on
  the devices, and the planner's candidates — degrees vs devices, the batch vs the resolved
  data-parallel degrees, heads / KV heads / MLP vs tensor, the sequence vs context and
  tensor (sequence parallelism), layers vs stages (uneven first/last stages), virtual stages
  (interleaving's microbatches: pipeline_schedule.validate's rule), multi-token prediction
  only without stages and context parallelism.
- `xla_flags.parse`: train.xla_flags.
- `parallel.remat.validate`: remat combinations, per pipeline chunk. It reads jax's policy
  table and the device's memories (offload), so remat.py keeps it and check imports it when it
  runs; importing this module loads no jax.
- here: FP8 against the layout (every FP8 GEMM, whole and per tensor shard, a multiple of
  FP8_ALIGN; the FP8/bf16 layer ranges vs uniform remat groups); parallel.expert against the
  resolved data degree it is carved out of (check_expert; its device-free rules, the expert
  count and the need for an MoE layer, also run in validate).

What needs the mesh's devices or arrays stays where it is: ring attention under stages on
XLA:CPU (context_attention.check_backend, in setup.build), cudnn and the Pallas kernel's shapes
(attention.select), and the array contracts of the attention cores, kernels and pipeline
executor. Not in check yet: pipeline_schedule.validate's "virtual stages need
schedule=interleaved_1f1b" fails when the pipelined step is traced (the ledger and the dry
run take virtual stages as interleaved whatever parallel.schedule says).
"""
from __future__ import annotations

from jaxtrain import xla_flags
from jaxtrain.config import FP8_ALIGN, Config, ConfigError, check_expert, validate
from jaxtrain.ledger.flops import projection_sizes
from jaxtrain.ledger.layout import (Layout, layers_per_chunk, layout_from_config,
                                    mixed_pipeline_problem)


class Fp8LayoutError(ConfigError):
    """FP8 settings that do not fit the model or the layout; names the layer and the keys."""


def check(cfg: Config, n_devices: int) -> Layout:
    """Raise a ConfigError naming the keys to change unless `cfg` runs on `n_devices`
    devices; the layout it runs as."""
    validate(cfg)
    layout = layout_from_config(cfg, n_devices)
    check_expert(cfg.model, cfg.parallel, layout.data, layout.tensor, cfg.fp8.enabled)
    problem = mixed_pipeline_problem(cfg, layout.stage)
    if problem:
        raise ConfigError(f"parallel.{problem}")
    xla_flags.parse(cfg.train.xla_flags)
    from jaxtrain.parallel import remat
    remat.validate(cfg.remat, layers_per_chunk(cfg, layout.stage, layout.virtual_stages))
    check_fp8_layout(cfg, layout.tensor)
    return layout


def check_fp8_layout(cfg: Config, tensor: int) -> None:
    """Every FP8 projection's GEMM sizes, whole and per tensor-parallel shard, are multiples of
    FP8_ALIGN, and the FP8/bf16 layer ranges fit the remat grouping."""
    f, m = cfg.fp8, cfg.model
    if not f.enabled:
        return
    first, last = f.bf16_first_layers, m.num_layers - f.bf16_last_layers
    if first >= last:
        return  # every layer is kept in bf16: no FP8 GEMM runs
    where = f"layers {first}..{last - 1}"
    for name, (k, n, sharded) in projection_sizes(m).items():
        for label, size in (("K (contracting)", k), ("N (output)", n)):
            if size % FP8_ALIGN:
                raise Fp8LayoutError(
                    f"fp8.enabled: {name} ({where}) has {label} size {size}, not a multiple of "
                    f"{FP8_ALIGN} (FP8 GEMM alignment); change the model dims or set "
                    "fp8.enabled=false")
        size = n if sharded == "N" else k
        kv = name in ("blocks/attn/wk", "blocks/attn/wv")
        if tensor > 1 and not (kv and m.num_kv_heads % tensor):  # kv heads replicate if indivisible
            local = size // tensor
            if local % FP8_ALIGN:
                raise Fp8LayoutError(
                    f"fp8.enabled: {name} ({where}) is split over parallel.tensor={tensor} into "
                    f"{sharded} = {size}/{tensor} = {local} per shard, not a multiple of "
                    f"{FP8_ALIGN} (FP8 GEMM alignment); lower parallel.tensor or change the "
                    "model dims")
    r = cfg.remat
    if not r.policy and r.granularity == "full" and r.method == "uniform":
        from jaxtrain.model.fp8 import Fp8Converter   # the ranges the layer stack runs as
        spans = [(a, b) for a, b, _ in Fp8Converter.of(f).layer_spans(m.num_layers)]
        if any((b - a) % r.num_layers for a, b in spans):
            raise Fp8LayoutError(
                f"remat.method=uniform remat.num_layers={r.num_layers} must divide the length "
                "of each layer range the stack runs as: layers "
                f"{', '.join(f'{a}..{b - 1}' for a, b in spans)} (from fp8.bf16_first_layers="
                f"{f.bf16_first_layers}, fp8.bf16_last_layers={f.bf16_last_layers}); change "
                "remat.num_layers or those")
