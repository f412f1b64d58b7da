"""The rules a config must pass before anything runs (docs/design.md §4)."""
from __future__ import annotations

import math
import re
import shlex
from typing import TYPE_CHECKING

from jaxtrain.config.errors import ConfigError

if TYPE_CHECKING:  # sections.py imports this module (Config.validate): types only here
    from jaxtrain.config.sections import (Config, DataConfig, Fp8Config, ModelConfig,
                                          MlaConfig, MoeConfig, ParallelConfig)

# The rules a config must pass before anything runs. `validate` (Config.validate) applies those
# that need no devices; jaxtrain.config_check.check(cfg, n_devices) applies them too, then the
# rest. A rule that also holds for the resolved layout (the -1 filled) or for a candidate
# layout of the planner is one function here, with the error class of its caller.

DEGREES = ("data", "fsdp", "tensor", "context", "stage")
# Which attention cores (model.attention) run each parallel.context_strategy.
CONTEXT_STRATEGIES = {"all_gather": ("auto", "xla", "pallas", "mosaic", "cudnn"),
                      "ring": ("auto", "xla", "pallas", "mosaic")}
FP8_ALIGN = 16  # FP8 GEMMs need K and N multiples of 16 (cuBLASLt, Transformer Engine)
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")   # model.moe.score_function


def padded_vocab(vocab_size: int, tensor: int) -> int:
    """Megatron's make-vocab-size-divisible-by (128·t): the vocab the model, the data's
    tokenizer check and the ledger all use."""
    multiple = 128 * tensor
    return -(-vocab_size // multiple) * multiple


def _check(ok: bool, msg: str, error: type[ConfigError] = ConfigError) -> None:
    if not ok:
        raise error(msg)


def parse_mixture(text: str) -> list[tuple[str, str]]:
    """`data.mixture` "0.3 A 0.7 B" (spaces or commas) -> [("0.3", "A"), ("0.7", "B")]: the
    weights as written (exact decimals), each checked to be a number >= 0, their sum > 0. A
    directory with spaces or commas is quoted as in a shell: "0.3 'my data/web' 0.7 B"."""
    lexer = shlex.shlex(text, posix=True)
    lexer.whitespace += ","
    lexer.whitespace_split = True
    try:
        items = list(lexer)
    except ValueError as e:  # an unclosed quote
        raise ConfigError(f"data.mixture={text!r}: {e}; close the quotes around a directory "
                          "with spaces, e.g. \"0.3 'my data/web' 0.7 data/code\"") from None
    if not items or len(items) % 2:
        raise ConfigError(f"data.mixture={text!r}: expected weight/directory pairs, e.g. "
                          "'0.3 /data/web 0.7 /data/code'")
    pairs = list(zip(items[0::2], items[1::2]))
    total = 0.0
    for weight, path in pairs:
        try:
            w = float(weight)
        except ValueError:
            raise ConfigError(f"data.mixture: {weight!r} (before {path}) is not a number; "
                              "write weight/directory pairs, e.g. '0.3 /data/web 0.7 "
                              "/data/code'") from None
        _check(w >= 0 and w != float("inf"),
               f"data.mixture: the weight {weight} of {path} must be a finite number >= 0")
        total += w
    _check(total > 0, f"data.mixture={text!r}: the weights sum to {total:g}; give at least "
           "one directory a positive weight")
    return pairs


def validate_data(d: DataConfig, error: type[ConfigError] = ConfigError) -> None:
    """data.*'s rules (the data package applies them too, with its DataError)."""
    if d.mixture:
        _check(d.source == "prepared", f"data.mixture needs data.source=prepared (it is "
               f"{d.source}); mixtures blend prepared directories", error)
        _check(not d.path, "set data.path (one prepared directory) or data.mixture (several), "
               "not both", error)
        parse_mixture(d.mixture)
    elif d.source == "prepared":
        _check(bool(d.path), "data.source=prepared needs data.path (a directory written by "
               "`python -m jaxtrain.data prepare`) or data.mixture", error)
    else:
        _check(d.source == "corpus" or d.path,
               f"data.source={d.source} needs data.path (a file or folder)", error)


def check_gqa(m: ModelConfig, error: type[ConfigError] = ConfigError) -> None:
    """Grouped-query attention: every KV head serves the same number of query heads."""
    _check(m.num_heads % m.num_kv_heads == 0, f"model.num_heads={m.num_heads} is not divisible "
           f"by model.num_kv_heads={m.num_kv_heads}; grouped-query attention needs whole "
           "groups: pick a divisor of num_heads", error)


def check_fill(p: ParallelConfig, error: type[ConfigError] = ConfigError) -> None:
    """At most one mesh degree is -1: it fills the devices the others leave."""
    fill = [f"parallel.{a}" for a in DEGREES if getattr(p, a) == -1]
    _check(len(fill) <= 1, f"only one of parallel.{'/'.join(DEGREES)} may be -1 (it fills the "
           f"devices the others leave), but {' and '.join(fill)} are; give all but one a "
           "degree", error)


def check_batch_split(global_batch: int, data: int, fsdp: int, microbatches: int,
                      filled: str = "", error: type[ConfigError] = ConfigError) -> None:
    """train.global_batch = data x fsdp x micro-batch x microbatches (docs/design.md §4); a
    degree of -1 (not resolved yet) is left out, `filled` names the one resolved from -1."""
    factors = {a: v for a, v in (("data", data), ("fsdp", fsdp)) if v > 1}
    factors["microbatches"] = microbatches
    n = math.prod(factors.values())
    named = " x ".join(f"parallel.{a}={v}" + (" (the fill)" if a == filled else "")
                       for a, v in factors.items())
    _check(global_batch % n == 0, f"train.global_batch={global_batch} is not divisible by "
           f"{named}{f' = {n}' if len(factors) > 1 else ''}; change train.global_batch, "
           "parallel.microbatches or the layout", error)


def check_context_split(seq_len: int, context: int, load_balance: bool,
                        error: type[ConfigError] = ConfigError) -> None:
    """The sequence splits over `context` ranks: into 2·context chunks under causal load
    balancing (the data pipeline gives rank r chunks r and 2c-1-r, jaxtrain/data/context.py)."""
    s, c = seq_len, context
    if c == 1:
        return
    if not load_balance:
        _check(s % c == 0, f"train.seq_len={s} is not divisible by parallel.context={c}; use a "
               f"multiple of {c}", error)
        return
    _check(c % 2 == 0, f"parallel.context={c} is odd: causal load balancing (parallel."
           "context_load_balance=true) is supported for even degrees only (as in MaxText); use "
           "an even parallel.context or set parallel.context_load_balance=false", error)
    _check(s % (2 * c) == 0, f"train.seq_len={s} does not split into 2 x parallel.context={c} "
           f"= {2 * c} chunks (causal load balancing gives rank r chunks r and {2 * c - 1}-r); "
           f"use a seq_len divisible by {2 * c} or set parallel.context_load_balance=false",
           error)


def check_context_core(strategy: str, attention: str,
                       error: type[ConfigError] = ConfigError) -> None:
    """`strategy` (parallel.context_strategy) runs the `attention` core."""
    _check(strategy in CONTEXT_STRATEGIES, f"parallel.context_strategy={strategy!r} is "
           f"unknown; choose one of {', '.join(CONTEXT_STRATEGIES)}", error)
    _check(attention in CONTEXT_STRATEGIES[strategy],
           f"parallel.context_strategy={strategy} is not supported by model.attention="
           f"{attention}; " + "; ".join(f"{k} runs on {', '.join(a for a in v if a != 'auto')}"
                                        for k, v in CONTEXT_STRATEGIES.items())
           + ": change one of them", error)


def check_fp8(f: Fp8Config) -> None:
    """The fp8 section's own rules (fp8.recipe_of applies them to configs built without
    validate())."""
    for key, allowed, how in (("recipe", ("delayed", "current"), "delayed or current"),
                              ("format", ("hybrid", "e4m3"),
                               "hybrid (E4M3 forward, E5M2 gradients) or e4m3"),
                              ("amax_compute_algo", ("max", "most_recent"), "max or most_recent")):
        _check(getattr(f, key) in allowed,
               f"fp8.{key}={getattr(f, key)!r} is unknown; choose {how}")
    _check(f.amax_history_len >= 1, f"fp8.amax_history_len={f.amax_history_len} must be >= 1")
    _check(f.margin >= 0, f"fp8.margin={f.margin} must be >= 0")
    _check(f.recipe != "current" or f.margin == 0,
           f"fp8.margin={f.margin} with fp8.recipe=current: Transformer Engine's current "
           "scaling has no margin (each tensor is scaled to its own amax); set fp8.margin=0 or "
           "use fp8.recipe=delayed")


def _check_router(e: MoeConfig) -> None:
    """The router's groups, scale and balancing bias (model/router.py)."""
    _check(e.n_group >= 1 and e.topk_group >= 1, f"model.moe.n_group={e.n_group} and "
           f"topk_group={e.topk_group} must be >= 1 (1 and 1: no group-limited routing)")
    _check(e.topk_group <= e.n_group, f"model.moe.topk_group={e.topk_group} > n_group="
           f"{e.n_group}: a token cannot keep more groups than there are; set topk_group <= "
           "n_group")
    _check(e.num_experts % e.n_group == 0, f"model.moe.n_group={e.n_group} does not divide "
           f"num_experts={e.num_experts}; choose n_group among the divisors of num_experts")
    per_group = e.num_experts // e.n_group
    _check(e.top_k <= e.topk_group * per_group, f"model.moe.top_k={e.top_k} > topk_group="
           f"{e.topk_group} x {per_group} experts per group: the kept groups hold too few "
           "experts; raise topk_group or lower top_k")
    _check(e.routed_scaling_factor > 0, f"model.moe.routed_scaling_factor="
           f"{e.routed_scaling_factor} must be > 0 (1.0: the weights as the router gives them)")
    _check(not e.expert_bias or e.score_function == "sigmoid", "model.moe.expert_bias=true "
           "with score_function=softmax: the balancing bias is the sigmoid router's "
           "(Megatron's too); set model.moe.score_function=sigmoid or expert_bias=false")
    _check(e.bias_update_rate >= 0, f"model.moe.bias_update_rate={e.bias_update_rate} must "
           "be >= 0 (DeepSeek-V3: 1e-3)")


def check_mla(m: ModelConfig, fp8_enabled: bool = False,
              error: type[ConfigError] = ConfigError) -> None:
    """model.mla's own rules (the attention cores' head-size limits are model/attention.py's)."""
    a: MlaConfig = m.mla
    if a is None:
        return
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        _check(getattr(a, key) > 0, f"model.mla.{key}={getattr(a, key)} must be positive",
               error)
    _check(a.q_lora_rank >= 0, f"model.mla.q_lora_rank={a.q_lora_rank} must be >= 0 (0: a "
           "plain q projection)", error)
    _check(a.qk_rope_head_dim % 2 == 0, f"model.mla.qk_rope_head_dim={a.qk_rope_head_dim} "
           "must be even (RoPE rotates pairs)", error)
    _check(m.num_kv_heads == m.num_heads, f"model.mla with model.num_kv_heads={m.num_kv_heads}"
           f" != model.num_heads={m.num_heads}: latent attention up-projects a key and value "
           f"per head; set model.num_kv_heads={m.num_heads}", error)
    _check(not m.head_dim or m.head_dim == a.qk_head_dim, f"model.head_dim={m.head_dim} with "
           f"model.mla: the q/k head size is qk_nope_head_dim + qk_rope_head_dim = "
           f"{a.qk_head_dim}; set model.head_dim=0 (or {a.qk_head_dim})", error)
    _check(a.yarn_factor >= 1, f"model.mla.yarn_factor={a.yarn_factor} must be >= 1 (1: no "
           "YaRN; DeepSeek-V3: 40)", error)
    _check(a.mscale_all_dim >= 0 and a.yarn_mscale >= 0, f"model.mla.mscale_all_dim="
           f"{a.mscale_all_dim} and yarn_mscale={a.yarn_mscale} must be >= 0 (0: unset)", error)
    if a.yarn:
        _check(a.yarn_original_max_position > 0, f"model.mla.yarn_factor={a.yarn_factor} needs "
               f"model.mla.yarn_original_max_position, the context the rope was trained at "
               f"(HF original_max_position_embeddings; DeepSeek-V3: 4096); it is "
               f"{a.yarn_original_max_position}", error)
        _check(a.yarn_beta_fast > a.yarn_beta_slow > 0, f"model.mla.yarn_beta_fast="
               f"{a.yarn_beta_fast} and yarn_beta_slow={a.yarn_beta_slow}: YaRN's ramp needs "
               "beta_fast > beta_slow > 0 (DeepSeek-V3: 32 and 1)", error)
        _check(m.rope_scaling is None, "model.rope_scaling (Llama 3.1's) with model.mla."
               "yarn_factor > 1: both rescale the rope frequencies; unset one of them", error)
    _check(not fp8_enabled, "fp8.enabled=true with model.mla: the latent projections have no "
           "FP8 path yet; turn fp8 off for MLA models", error)


def mtp_schedule(text: str) -> tuple[tuple[int, float], ...]:
    """model.mtp.schedule's "STEP:FACTOR,..." as (step, factor) pairs, steps increasing."""
    pairs = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        step, sep, factor = item.partition(":")
        try:
            pairs.append((int(step), float(factor)))
        except ValueError:
            sep = ""
        _check(bool(sep), f"model.mtp.schedule={text!r}: {item!r} is not STEP:FACTOR (e.g. "
               "'20000:0.1': from step 20000 on the factor is 0.1)")
    steps = [s for s, _ in pairs]
    _check(all(s > 0 for s in steps) and steps == sorted(set(steps)), f"model.mtp.schedule="
           f"{text!r}: the steps must be positive and increasing")
    _check(all(f >= 0 for _, f in pairs), f"model.mtp.schedule={text!r}: factors must be >= 0")
    return tuple(pairs)


def check_mtp(cfg: Config) -> None:
    """model.mtp's device-free rules (the resolved stage and context degrees are config_check's)."""
    t = cfg.model.mtp
    if t is None:
        return
    _check(t.num_layers >= 0, f"model.mtp.num_layers={t.num_layers} must be >= 0 (0: off)")
    _check(t.loss_scaling_factor >= 0, f"model.mtp.loss_scaling_factor={t.loss_scaling_factor}"
           " must be >= 0 (DeepSeek-V3: 0.3)")
    mtp_schedule(t.schedule)
    if t.num_layers == 0:
        return
    _check(not cfg.fp8.enabled, "fp8.enabled=true with model.mtp.num_layers>0: the MTP "
           "modules have no FP8 path yet; set fp8.enabled=false or model.mtp.num_layers=0")
    _check(not cfg.checkpoint.init_from, "checkpoint.init_from with model.mtp.num_layers>0: "
           "imported weights hold no MTP modules; set model.mtp.num_layers=0")


def check_moe(m: ModelConfig, fp8_enabled: bool = False) -> None:
    """model.moe's own rules (the expert degree's are config_check's)."""
    e: MoeConfig = m.moe
    if e is None:
        return
    _check(e.num_experts >= 1, f"model.moe.num_experts={e.num_experts} must be >= 1")
    _check(1 <= e.top_k <= e.num_experts, f"model.moe.top_k={e.top_k} is outside [1, "
           f"model.moe.num_experts={e.num_experts}]; route each token to 1..{e.num_experts} "
           "experts")
    _check(e.score_function in MOE_SCORE_FUNCTIONS, f"model.moe.score_function="
           f"{e.score_function!r} is unknown; choose {' or '.join(MOE_SCORE_FUNCTIONS)}")
    _check(e.top_k > 1 or e.pre_softmax, "model.moe.top_k=1 with pre_softmax=false: a softmax "
           "over one logit is always 1, so the router would get no gradient from the tokens; "
           "set model.moe.pre_softmax=true (as Megatron requires)")
    for key in ("mlp_size", "shared_experts", "shared_mlp_size", "first_k_dense"):
        _check(getattr(e, key) >= 0, f"model.moe.{key}={getattr(e, key)} must be >= 0")
    _check(e.layer_freq >= 1, f"model.moe.layer_freq={e.layer_freq} must be >= 1 (1: every "
           "layer is MoE)")
    _check(any(m.moe_layers), f"model.moe.first_k_dense={e.first_k_dense} and layer_freq="
           f"{e.layer_freq} leave no MoE layer among model.num_layers={m.num_layers}; lower "
           "them or unset model.moe")
    _check_router(e)
    for key in ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff"):
        _check(getattr(e, key) >= 0, f"model.moe.{key}={getattr(e, key)} must be >= 0")
    _check(e.dispatch in ("dropless", "capacity"), f"model.moe.dispatch={e.dispatch!r} is "
           "unknown; choose dropless or capacity")
    _check(e.drop_policy in ("probs", "position"), f"model.moe.drop_policy={e.drop_policy!r} "
           "is unknown; choose probs (drop the lowest router probabilities) or position (the "
           "latest tokens)")
    _check(e.capacity_factor > 0, f"model.moe.capacity_factor={e.capacity_factor} must be > 0 "
           "(1.0: each expert takes its even share of the tokens)")
    _check(not e.pad_to_capacity or e.dispatch == "capacity", "model.moe.pad_to_capacity=true "
           "needs model.moe.dispatch=capacity (dropless has no capacity to pad to)")
    _check(not (fp8_enabled and e.pad_to_capacity), "fp8.enabled=true with "
           "model.moe.pad_to_capacity=true: the padded [experts, capacity] buffers have no FP8 "
           "path (FP8 runs the grouped GEMM); set model.moe.pad_to_capacity=false")


def folds(tensor: int, expert_tensor: int) -> bool:
    """Whether the experts fold over the tensor ranks (MoE parallel folding: expert_tensor=1
    with tensor > 1): each expert whole on one rank, the tensor ranks more expert ranks."""
    return expert_tensor == 1 and tensor > 1


def expert_from_data(expert: int, tensor: int, expert_tensor: int) -> int:
    """How many of the `expert` ranks are carved out of the data-parallel ones: all of them,
    or under folding expert / tensor (the tensor ranks are the rest): the mesh's `expert`."""
    return expert // tensor if folds(tensor, expert_tensor) else expert


def check_expert_split(m: ModelConfig, expert: int, data: int, tensor: int, expert_tensor: int,
                       error: type[ConfigError] = ConfigError, key: str = "parallel.") -> None:
    """An expert degree against the model and, once resolved (> 0), the data and tensor
    degrees it is carved out of: the config's rule and the planner's, one function (`key`:
    how the degrees are named, "parallel." for the config, "" for the planner's layouts)."""
    def divisors(n):
        return [x for x in range(1, n + 1) if n % x == 0]
    _check(expert >= 1, f"{key}expert={expert} must be >= 1 (1: no expert parallelism)", error)
    _check(expert_tensor in (0, 1) or expert_tensor == tensor, f"{key}expert_tensor="
           f"{expert_tensor}: the experts' tensor degree is 0 (as {key}tensor) or 1 (MoE "
           "parallel folding); set one of those", error)
    if expert == 1:
        return
    _check(m.moe is not None and any(m.moe_layers), f"{key}expert={expert} with no MoE layer "
           f"(model.moe unset or every layer dense): expert parallelism shards model.moe's "
           f"experts; set model.moe or {key}expert=1", error)
    _check(m.moe.num_experts % expert == 0, f"model.moe.num_experts={m.moe.num_experts} is "
           f"not divisible by {key}expert={expert}; each expert rank holds an equal share of "
           f"the experts: choose an expert degree among {divisors(m.moe.num_experts)}", error)
    fold = folds(tensor, expert_tensor)
    _check(not fold or expert % tensor == 0, f"{key}expert={expert} with {key}expert_tensor=1 "
           f"counts the {tensor} tensor ranks as expert ranks; make {key}expert a multiple of "
           f"{key}tensor={tensor}", error)
    carved = expert_from_data(expert, tensor, expert_tensor)
    if fold:
        _check(data <= 0 or data % carved == 0, f"{key}expert={expert} with {key}expert_tensor=1"
               f" carves expert/tensor={carved} ranks out of {key}data={data}, which it does not "
               f"divide; make {key}data a multiple of {carved}", error)
    hint = (f"; or fold the {tensor} tensor ranks in ({key}expert_tensor=1)"
            if tensor > 1 and expert % tensor == 0 and data > 0 and data % (expert // tensor) == 0
            else "")
    _check(data <= 0 or data % carved == 0, f"expert={expert} does not divide data={data} (the "
           f"expert ranks are carved out of the data-parallel ones, Megatron's expert-model-"
           f"parallel); choose among {divisors(data) if data > 0 else []}{hint}", error)


def check_expert(m: ModelConfig, p: ParallelConfig, data: int = 0, tensor: int = 0,
                 fp8_enabled: bool = False) -> None:
    """parallel.expert against the model and, once resolved (`data`, `tensor` > 0), the
    degrees it is carved out of; then the program's own limits, which the planner's layouts
    need not meet: no padded capacity under expert ranks, no FP8 experts folded."""
    tensor = tensor or p.tensor
    check_expert_split(m, p.expert, data, tensor, p.expert_tensor)
    if p.expert == 1:
        return
    _check(not m.moe.pad_to_capacity, f"model.moe.pad_to_capacity=true with parallel.expert="
           f"{p.expert}: the expert-parallel dispatch sends the kept rows (the same output, no "
           "padding); set model.moe.pad_to_capacity=false")
    if folds(tensor, p.expert_tensor):
        _check(not fp8_enabled, "fp8.enabled=true with parallel.expert_tensor=1: the experts' "
               "per-expert FP8 metas are not split over the folded ranks; set fp8.enabled="
               "false or parallel.expert_tensor=0")


def validate(cfg: Config) -> None:
    """The rules that need no devices (config_check.check(cfg, n_devices) adds the rest)."""
    m, p, t, f = cfg.model, cfg.parallel, cfg.train, cfg.fp8
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "mlp_size",
                 "max_seq_len"):
        _check(getattr(m, name) > 0, f"model.{name}={getattr(m, name)} must be positive")
    check_gqa(m)
    check_moe(m, cfg.fp8.enabled)
    check_mla(m, cfg.fp8.enabled)
    check_mtp(cfg)
    check_expert(m, p, p.data, fp8_enabled=f.enabled)
    _check(m.head_dim > 0 or m.hidden_size % m.num_heads == 0,
           f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}; "
           "set model.head_dim explicitly")
    _check(m.mla is not None or m.resolved_head_dim % 2 == 0,
           f"head dim {m.resolved_head_dim} must be even for RoPE")
    _check(t.seq_len <= m.max_seq_len,
           f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
           "lower train.seq_len or raise model.max_seq_len")
    _check(t.seq_len > 0 and t.global_batch > 0 and t.steps >= 0,
           "train.seq_len, train.global_batch must be positive and train.steps non-negative")
    for name in DEGREES:
        v = getattr(p, name)
        _check(v == -1 or v >= 1, f"parallel.{name}={v}: use a positive degree or -1 (fill)")
    check_fill(p)
    _check(p.microbatches >= 1, f"parallel.microbatches={p.microbatches} must be >= 1")
    _check(p.virtual_stages >= 1, f"parallel.virtual_stages={p.virtual_stages} must be >= 1")
    if p.context != 1:
        check_context_core(p.context_strategy, m.attention)
        _check(p.context != -1 or not p.context_load_balance, "parallel.context=-1 with "
               "parallel.context_load_balance=true: the data pipeline reorders each sequence "
               "for a fixed degree; give parallel.context a number or set "
               "parallel.context_load_balance=false")
        if p.context > 1:
            check_context_split(t.seq_len, p.context, p.context_load_balance)
    _check(not p.sequence_parallel or p.tensor != 1,
           "parallel.sequence_parallel=true needs parallel.tensor > 1 (it shards the sequence "
           "over the tensor axis); set parallel.tensor or turn sequence_parallel off")
    if p.collective_matmul:
        check_collective_matmul(p, f.enabled, t.seq_len)
    check_batch_split(t.global_batch, p.data, p.fsdp, p.microbatches)  # a -1 is left out
    _check(0 <= cfg.data.eval_fraction < 1, "data.eval_fraction must be in [0, 1)")
    _check(t.log_every >= 1, "train.log_every must be >= 1")
    _check(t.lr_decay_steps >= 0, f"train.lr_decay_steps={t.lr_decay_steps} must be >= 0 (0: "
           "decay over train.steps)")
    _check(t.profile_steps >= 0 and t.profile_start >= 0,
           "train.profile_start and train.profile_steps must be >= 0")
    _check(not t.profile_steps or t.profile_start + t.profile_steps <= t.steps,
           f"train.profile_start={t.profile_start} "
           f"+ train.profile_steps={t.profile_steps} ends after train.steps={t.steps}: the profile "
           "would never finish; lower them or raise train.steps")
    parse_duration(t.max_runtime, "train.max_runtime")  # a malformed one raises here
    _check(cfg.checkpoint.keep >= 1, "checkpoint.keep must be >= 1")
    _check(cfg.checkpoint.every >= 0, "checkpoint.every must be >= 0 (0: only at the end)")
    validate_data(cfg.data)
    check_fp8(f)
    _check(f.bf16_first_layers >= 0 and f.bf16_last_layers >= 0,
           "fp8.bf16_first_layers and fp8.bf16_last_layers must be >= 0")
    _check(m.moe is None or not f.enabled or not (f.bf16_first_layers or f.bf16_last_layers),
           f"fp8.bf16_first_layers={f.bf16_first_layers} and fp8.bf16_last_layers="
           f"{f.bf16_last_layers} with model.moe: an MoE model runs every layer in FP8; set "
           "both to 0")
    _check(f.bf16_first_layers + f.bf16_last_layers <= m.num_layers,
           f"fp8.bf16_first_layers={f.bf16_first_layers} + fp8.bf16_last_layers="
           f"{f.bf16_last_layers} exceeds model.num_layers={m.num_layers}; lower them")
    _check(cfg.remat.num_layers >= 0, "remat.num_layers must be >= 0")


_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, key: str) -> float:
    """Seconds in `text`: "" (0: never), seconds ("3600"), units ("90m", "1h30m", "2d") or
    SLURM's --time forms with a colon or a dash (MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)."""
    text = text.strip().lower()
    if not text:
        return 0.0
    bad = ConfigError(f"{key}={text!r} is not a duration; write seconds (3600), with units (90m, "
                      "23.5h, 1h30m) or as SLURM's [D-]HH:MM:SS")
    try:
        if re.fullmatch(r"\d+(\.\d*)?", text):
            return float(text)
        if re.fullmatch(r"(\d+(\.\d*)?[smhd])+", text):
            return sum(float(n) * _UNIT_S[u] for n, _, u in
                       re.findall(r"(\d+(\.\d*)?)([smhd])", text))
        days, _, clock = text.rpartition("-") if "-" in text else ("0", "", text)
        parts = [int(x) for x in clock.split(":")]
        if "-" in text:  # D-HH[:MM[:SS]]
            if len(parts) > 3:
                raise bad
            parts += [0] * (3 - len(parts))
        elif len(parts) == 2:  # MM:SS
            parts = [0, *parts]
        elif len(parts) != 3:
            raise bad
        h, m, sec = parts
        return float(int(days) * 86400 + h * 3600 + m * 60 + sec)
    except ValueError:
        raise bad from None


def check_collective_matmul(p, fp8: bool, seq_len: int) -> None:
    """parallel.collective_matmul applies: sequence parallelism on (tensor > 1), no context
    parallelism, no FP8, a sequence that splits over tensor."""
    _check(p.sequence_parallel, "parallel.collective_matmul=true decomposes sequence "
           "parallelism's gathers and scatters: set parallel.sequence_parallel=true (and "
           "parallel.tensor > 1) or turn collective_matmul off")
    _check(p.context == 1, "parallel.collective_matmul=true with parallel.context > 1: the "
           "ring runs over tensor only; set parallel.context=1 or turn collective_matmul off")
    _check(not fp8, "parallel.collective_matmul=true with fp8.enabled=true: FP8's scaling needs "
           "the whole tensor's amax, which a ring step does not see; turn one of them off")
    _check(p.tensor < 1 or seq_len % p.tensor == 0,
           f"parallel.collective_matmul=true: train.seq_len={seq_len} does not split over "
           f"parallel.tensor={p.tensor}; use a multiple of it")
