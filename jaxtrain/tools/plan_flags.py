"""The planner's explicit layout (`--tensor/--stage/--virtual-stages/--context/--micro-batch/
--expert`): the recipe's layout with the flags' degrees, and what those flags invalidate
re-derived.

A recipe's virtual stages and micro-batch are chosen for its own degrees (llama70b: stage 2 x
8 virtual, micro-batch 1 x 8 microbatches). Flags that change the degrees can leave them
impossible (80 layers do not split into 4 stages x 8 virtual). Then the ones no flag set are
chosen as the planner's walk chooses them (virtual stages whose chunks keep at least
MIN_LAYERS_PER_CHUNK layers, micro-batch 1 or 2, or the recipe's microbatches), a fitting
layout with the highest expected MFU winning, and a note says what changed and why. A value
a flag set is the user's: when no choice of the others makes it valid it stays an error.
"""
from __future__ import annotations

import itertools

from jaxtrain.config import Config
from jaxtrain.ledger import Estimate, Gpu, LayoutError, estimate
from jaxtrain.ledger.layout import divisors

# what a flag's degrees can invalidate (an expert degree that no longer divides data)
REDERIVED = ("virtual_stages", "micro_batch", "expert")


def _mid(e: Estimate) -> float:
    return sum(e.expected_mfu) / 2


def flagged_estimate(cfg: Config, n_devices: int, gpu: Gpu, flags: dict, **fixed
                     ) -> tuple[Estimate, list[str]]:
    """(the estimate of the flags' layout, notes on what was re-derived). `flags`: the
    planner's --tensor/--stage/--virtual-stages/--context/--micro-batch/--expert (None: not
    given); `fixed`: fsdp, sequence_parallel, zero1 as explicit_layout takes them."""
    from jaxtrain.tools.plan import MICRO_BATCHES, MIN_LAYERS_PER_CHUNK, explicit_layout

    def costed(**chosen) -> Estimate:
        return estimate(cfg, explicit_layout(cfg, n_devices, **fixed, **{**flags, **chosen}),
                        gpu)
    try:
        return costed(), []
    except LayoutError as invalid:
        free = [k for k in REDERIVED if flags.get(k) is None]
        if not free:
            raise
        stage = flags.get("stage") or cfg.parallel.stage
        options = {
            "virtual_stages": [v for v in divisors(cfg.model.num_layers)
                               if v == 1 or cfg.model.num_layers // (stage * v)
                               >= MIN_LAYERS_PER_CHUNK],
            "micro_batch": [None, *MICRO_BATCHES],  # None: the recipe's microbatches
            "expert": divisors(cfg.model.moe.num_experts) if cfg.model.moe else [1]}
        valid = []
        for size in range(1, len(free) + 1):  # change as little of the recipe as will do
            for subset in itertools.combinations(free, size):
                for values in itertools.product(*(options[k] for k in subset)):
                    try:
                        valid.append(costed(**dict(zip(subset, values))))
                    except LayoutError:
                        continue
            if valid:
                break
        if not valid:
            raise invalid from None
        best = max(valid, key=lambda e: (e.fits, _mid(e)))
        L, p = best.layout, cfg.parallel
        changes = ", ".join(f"{k}={now} (the recipe's {was})" for k, was, now in (
            ("virtual_stages", p.virtual_stages, L.virtual_stages),
            ("microbatches", p.microbatches, L.microbatches),
            ("expert", p.expert, L.expert)) if now != was)
        return best, [f"note: {invalid}; re-derived what the flags left open: {changes}, the "
                      f"{'fitting ' if best.fits else ''}layout with the highest expected MFU "
                      f"of the {len(valid)} that change no more (set --virtual-stages / "
                      "--micro-batch / --expert to choose)"]
