"""What a run says about itself: a header (parameters, devices, layout, tokens per step), a
closing line (final loss, last checkpoint, wall time), and at a resume what a changed config
did to the learning-rate schedule (read against the workdir's previous config.json).

The parameter count is the ledger's (the real vocab, as `python -m jaxtrain.plan` prints it),
not the padded tables' (docs/design.md §8, vocab padding).
"""
from __future__ import annotations

import json
import pathlib

from jaxtrain import optim
from jaxtrain.config import Config, ConfigError, TrainConfig, from_dict
from jaxtrain.ledger.flops import param_counts
from jaxtrain.ledger.layout import Layout


def _short_count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(int(n))


def header(cfg: Config, layout: Layout, device_kind: str, processes: int, start: int) -> str:
    t = cfg.train
    total = param_counts(cfg.model).total
    where = f"resuming at step {start}" if start else "from step 0"
    hosts = f" in {processes} processes" if processes > 1 else ""
    return (f"jaxtrain: {total:,} parameters ({_short_count(total)}) on {layout.n_devices} x "
            f"{device_kind}{hosts}; layout {layout.short()}; {t.global_batch * t.seq_len:,} "
            f"tokens per step ({t.global_batch} sequences x {t.seq_len}); {where} to "
            f"train.steps={t.steps}")


def _duration(seconds: float) -> str:
    minutes, s = divmod(seconds, 60)
    hours, m = divmod(int(minutes), 60)
    return f"{hours}h{m:02d}m{s:04.1f}s" if hours else f"{m}m{s:04.1f}s" if m else f"{s:.1f} s"


def closing(step: int, cfg: Config, last_logged: dict, checkpoint: str | None,
            wall_s: float) -> str:
    loss = last_logged.get("loss")
    parts = [f"loss {loss:.4f}" if loss is not None else "no step logged"]
    if "eval_loss" in last_logged:
        parts.append(f"eval loss {last_logged['eval_loss']:.4f}")
    parts.append(f"last checkpoint {checkpoint}" if checkpoint else "no checkpoint")
    return (f"stopped at step {step} of {cfg.train.steps}: " if step < cfg.train.steps else
            f"finished at step {step}: ") + "; ".join(parts) + f"; wall time {_duration(wall_s)}"


def decay_horizon(t: TrainConfig) -> int:
    """The steps the cosine decays over (Megatron's --lr-decay-iters; train.steps by default)."""
    return t.lr_decay_steps or t.steps


def read_previous_config(workdir: pathlib.Path) -> dict | None:
    """The config.json an earlier run left in `workdir` (None: none, or unreadable)."""
    try:
        return json.loads((workdir / "config.json").read_text())
    except (OSError, ValueError):
        return None


def schedule_change(previous: dict | None, cfg: Config, start: int) -> str | None:
    """A note when the learning-rate schedule of a resumed run differs from the one its
    checkpoint was trained under (None when the same, or unknown)."""
    if previous is None or start == 0:
        return None
    try:
        old = from_dict(previous).train
    except (ConfigError, TypeError):  # another jaxtrain's config: nothing to compare
        return None
    new = cfg.train
    changed = [f"train.{k} {getattr(old, k)} -> {getattr(new, k)}"
               for k in ("lr", "min_lr_ratio", "warmup_steps") if getattr(old, k) != getattr(new, k)]
    horizon = decay_horizon(old), decay_horizon(new)
    if horizon[0] != horizon[1]:
        source = "train.lr_decay_steps" if new.lr_decay_steps else "train.steps"
        changed.append(f"decay horizon {horizon[0]} -> {horizon[1]} steps ({source})")
    if not changed:
        return None
    lr_old, lr_new = (float(optim.learning_rate(t)(start)) for t in (old, new))
    keep = (f"; to keep the checkpoint's decay set train.lr_decay_steps={horizon[0]}"
            if horizon[0] != horizon[1] and not new.lr_decay_steps else "")
    return (f"note: the learning-rate schedule differs from the one checkpoint {start} was "
            f"trained under: {', '.join(changed)}; step {start + 1} gets lr {lr_new:.3e} "
            f"(the old schedule: {lr_old:.3e}){keep}")
