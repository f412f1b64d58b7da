"""The pipeline executor jaxtrain runs (jaxtrain.parallel.pipeline), counted from its lock-step table.

A schedule (ledger.pipeline_schedule, pure Python) is simulated once into `steps` lock-step
steps; in each, every rank may run one B (first) and one F of a chunk for one microbatch.
What that means per device per train step, and where the ledger uses it:
- memory (ledger.memory): an F stashes its chunk's VJP residuals for that microbatch, what the
  remat config saves (all of a layer's activations without remat, each recomputed group's
  input under full recompute), until its B. The executor is one SPMD program, so every rank
  allocates the busiest rank's buffers: its stash slots (residual sets), inbox and cotangent
  slots and two receive buffers (one chunk input each: one microbatch's s/c x b x h
  activations in the compute dtype, / t under sequence parallelism), plus the one residual
  set the last virtual stage's B holds while it runs its chunk forward and backward at once.
  Chunks are padded to the largest (uneven first/last stages).
- FLOPs (ledger.flops): nothing is run again but what the remat config recomputes. A rank
  runs only its own F and B ops (a B applies the stashed pullback; the last virtual stage's
  F is folded into its B), so a device executes m.v chunk forwards and backwards.
- time (`Executor.bubble`): a step lasts F if any rank runs an F plus B if any runs a B;
  idle = that sum over m.v.(F + B) - 1.
- communication (ledger.comm): every step ends with one chunk-input-sized ppermute to the
  right and one to the left, idle steps included: 2 x steps sends. Layer collectives (TP, CP,
  FSDP) run in every chunk pass a rank makes: forward in each F, backward in each B (and the
  forward again in the last stage's B, whose F is folded in).
"""
from __future__ import annotations

import dataclasses
import functools

from jaxtrain.config import Config
from jaxtrain.ledger.layout import Layout
from jaxtrain.ledger.pipeline_schedule import build_schedule, step_flags

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RECEIVE_BUFFERS = 2   # the activation arriving from the left and the cotangent from the right


@dataclasses.dataclass(frozen=True)
class Executor:
    """One layout's lock-step table, per rank (every rank advances one step at a time)."""
    schedule: str
    stages: int
    virtual_stages: int
    microbatches: int
    chunk_layers: int        # layers of the largest chunk; smaller ones are padded to it
    steps: int               # table steps, idle ones included
    f_steps: int             # steps in which some rank runs an F (the last stage's are in B)
    b_steps: int             # steps in which some rank runs a B
    head_steps: int          # steps whose B is the last virtual stage's (it runs the head)
    stash_slots: tuple       # per rank: residual sets an F saved for a B still to come
    inbox_slots: tuple       # per rank: activations waiting for their F
    grad_slots: tuple        # per rank: cotangents waiting for their B

    @property
    def stash_buffer(self) -> int:
        """Stash slots every rank allocates: the busiest rank's (one SPMD program)."""
        return max(max(self.stash_slots), 1)

    @property
    def inbox_buffer(self) -> int:
        return max(max(self.inbox_slots), 1)

    @property
    def grad_buffer(self) -> int:
        return max(max(self.grad_slots), 1)

    @property
    def buffers(self) -> int:
        """Chunk-input-sized buffers per device: inbox + cotangent slots + receive buffers."""
        return self.inbox_buffer + self.grad_buffer + RECEIVE_BUFFERS

    @property
    def sends(self) -> int:
        """ppermutes per device per step: one right and one left in every table step."""
        return 2 * self.steps

    @property
    def forward_passes(self) -> int:
        """Chunk forwards a rank runs per step: one per (chunk, microbatch), recompute aside."""
        return self.microbatches * self.virtual_stages

    @property
    def backward_passes(self) -> int:
        return self.microbatches * self.virtual_stages

    def bubble(self, backward_cost: float = 2.0) -> float:
        """Lock-step idle fraction: (f_steps.F + b_steps.B) / (m.v.(F + B)) - 1 with F = 1.

        backward_cost: B over F; 2 without recompute, more with the remat config's."""
        busy = self.microbatches * self.virtual_stages * (1.0 + backward_cost)
        return (self.f_steps + self.b_steps * backward_cost) / busy - 1.0


@functools.lru_cache(maxsize=256)
def _table(kind: str, p: int, m: int, v: int) -> tuple:
    """(steps, f_steps, b_steps, head_steps, stash, inbox, cotangent slots) of the training
    table."""
    table = build_schedule(kind, p, m, v).table
    flags = step_flags(table)
    return (table.num_steps, int(flags["any_f"].sum()), int(flags["any_b"].sum()),
            int((table.columns["b_chunk"][:, p - 1] == v - 1).sum()), table.stash_slots,
            table.inbox_slots, table.grad_slots)


def executor(layout: Layout, stage_layers: tuple[int, ...]) -> Executor | None:
    """The executor's table for `layout` (None without pipeline stages); cached per schedule.

    Virtual stages run the interleaved schedule, whatever `layout.schedule` says (it is the
    only one that runs them; the trainer refuses the others with v > 1)."""
    p, v, m = layout.stage, layout.virtual_stages, layout.microbatches
    if p == 1:
        return None
    kind = "interleaved_1f1b" if v > 1 else layout.schedule
    steps, f_steps, b_steps, head_steps, stash, inbox, grad = _table(kind, p, m, v)
    return Executor(schedule=kind, stages=p, virtual_stages=v, microbatches=m,
                    chunk_layers=max(stage_layers) // v, steps=steps, f_steps=f_steps,
                    b_steps=b_steps, head_steps=head_steps, stash_slots=tuple(stash),
                    inbox_slots=tuple(inbox), grad_slots=tuple(grad))


def chunk_input_bytes(cfg: Config, layout: Layout, seq_len: int) -> float:
    """One microbatch's activations on one device, in the compute dtype: what an inbox slot
    holds and what one send moves (sequence parallelism keeps them split over tensor)."""
    sbh = seq_len / layout.context * layout.micro_batch * cfg.model.hidden_size
    split = layout.tensor if layout.sequence_parallel else 1
    return sbh * DTYPE_BYTES[cfg.model.compute_dtype] / split
