"""The host side of a torch.profiler trace: which op launched each GPU kernel, and what that says.

A kernel names its launch by `correlation` (the cudaLaunchKernel / cudaMemcpyAsync runtime
event carries the same id); the launch sits inside the CPU ops that were running on its host
thread, innermost last. From that stack:

- **recompute**: the launch is under an autograd backward node (`autograd::engine::
  evaluate_function: XBackward0`), and below the node's own op some op recorded a `Sequence
  number` — ops record one when they build autograd graph, which forward ops do and the ops a
  backward function runs (grad mode off) do not — and that op's name and input shapes are those
  of an op of the forward pass. That is torch.utils.checkpoint's replay, reentrant
  (`CheckpointFunctionBackward`) or not (the replay runs inside the first node that unpacks a
  saved tensor). A backward GEMM is never recompute however slow it runs: its op records no
  sequence number, and its shapes are the transposed problem's.
- **collective**: the `record_param_comms` op around the launch, or the last one before it
  under the same parent op (torch records it beside `nccl:all_reduce`, not around it): its
  collective name, process group and ranks. It names NCCL kernels only (jaxtrain.tools.
  mfu_timeline), so a GEMM launched after a collective is never taken for one.

`markers` is False when the trace has no backward nodes (no CPU activity, or no autograd), so
recompute cannot be measured from it.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

from jaxtrain.tools import profile_trace as pt

BACKWARD_NODE = "autograd::engine::evaluate_function: "
COMMS_OP = "record_param_comms"
_HOST_OP_CATS = ("cpu_op", "user_annotation", "python_function")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver", "runtime")


@dataclasses.dataclass
class Launch:
    time: float                 # µs, host clock
    backward: bool              # under an autograd backward node
    recompute: bool             # forward work replayed in the backward (module docstring)
    comms: dict | None          # the record_param_comms op's args, None when none


@dataclasses.dataclass
class HostSide:
    launches: dict[str, Launch]   # correlation id -> its launch
    markers: bool                 # the trace has autograd backward nodes


def host_side(spans: list[pt.Span]) -> HostSide:
    """The launches of one torch trace file (spans of one source)."""
    by_thread = defaultdict(list)
    for s in spans:
        if s.cat in _HOST_OP_CATS or (s.cat in _LAUNCH_CATS and _corr(s) is not None):
            by_thread[(s.pid, s.tid)].append(s)
    stacks = {}     # correlation -> (launch span, enclosing ops outermost first, last comms op)
    forward = set()
    markers = False
    for ops in by_thread.values():
        ops.sort(key=lambda s: (s.start, -s.dur))
        stack: list[pt.Span] = []
        last_comms = (None, None)   # (its parent op, the record_param_comms op)
        for s in ops:
            while stack and stack[-1].end <= s.start:
                stack.pop()
            if s.cat in _HOST_OP_CATS:
                if s.name.startswith(BACKWARD_NODE):
                    markers = True
                elif s.name == COMMS_OP:
                    last_comms = (stack[-1] if stack else None, s)
                elif not _under_backward(stack):
                    forward.add(_signature(s))   # (reentrant checkpoint's forward: no grad)
                stack.append(s)
            else:
                parent, comms = last_comms
                sibling = comms if parent is None or any(o is parent for o in stack) else None
                stacks[str(_corr(s))] = (s, tuple(stack), sibling)
    launches = {}
    for corr, (s, stack, last_comms) in stacks.items():
        comms = next((o for o in reversed(stack) if o.name == COMMS_OP), last_comms)
        replayed = _replayed(stack)
        launches[corr] = Launch(time=s.start, backward=_under_backward(stack),
                                recompute=replayed is not None and _signature(replayed) in forward,
                                comms=dict(comms.args) if comms is not None else None)
    return HostSide(launches, markers)


def _corr(s: pt.Span):
    return s.args.get("correlation", s.args.get("correlation_id"))


def _under_backward(stack) -> bool:
    return any(o.name.startswith(BACKWARD_NODE) for o in stack)


def _replayed(stack) -> pt.Span | None:
    """The outermost grad-recording op below the innermost backward node, None when none."""
    node = max((i for i, o in enumerate(stack) if o.name.startswith(BACKWARD_NODE)),
               default=None)
    if node is None:
        return None
    below = list(stack[node + 1:])
    if below and below[0].name == stack[node].name.removeprefix(BACKWARD_NODE):
        below = below[1:]   # the node's own op (it records the forward op's sequence number)
    return next((o for o in below if "Sequence number" in o.args), None)


def _signature(s: pt.Span) -> tuple:
    return s.name, repr(s.args.get("Input Dims"))
