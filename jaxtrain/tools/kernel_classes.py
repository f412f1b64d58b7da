"""What a device kernel is, by what it is rather than by words its name happens to contain.

Classes: `gemm`, `attention` (a fused attention kernel: its own line under kernel efficiency),
`non_gemm` (everything else that computes, attention's helper kernels included), `comm` (a
collective), `p2p` (pipeline send/recv), `memcpy` / `memset` (`h2d` for host-to-device copies).
The rules are tried in order and the first match wins, so a family whose names contain another
family's words comes first: Inductor's pointwise kernels may be named after the `addmm` they
follow, FlashAttention-3 kernels are `cutlass::device_kernel<flash::...>`, FlashAttention-2's
`flash_bwd_convert_dq_kernel` is a helper. NCCL runs an all-to-all as `ncclDevKernel_SendRecv`,
so a collective's kind comes from torch's `record_param_comms` name when the trace has one.
`Families` keeps which names each family matched, for the breakdown's JSON.
"""
from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

COMPUTE = ("gemm", "attention", "non_gemm")

# (family, class, pattern), first match wins
_RULES = [(family, cls, re.compile(pattern, re.I)) for family, cls, pattern in (
    ("NCCL", "comm", r"^(void\s+)?nccl\w*(kernel|dev)"),
    ("memset", "memset", r"^memset\b|^\s*\[?memset"),
    ("memcpy host-to-device", "h2d", r"memcpy\s*(htod|h2d)\b|^memcpyh2d"),
    ("memcpy", "memcpy", r"^\s*(memcpy|\[memcpy)|^memcpy[dh]2[dh]"),
    ("Inductor pointwise/reduction", "non_gemm", r"^triton_(poi|red|per|for)_"),
    ("FlashAttention helper", "non_gemm",
     r"flash\w*?(dot_do_o|convert_d|clear_dkv|combine|preprocess|postprocess|prepare_)"),
    ("FlashAttention-3", "attention", r"flash::\w*(sm90|flashattn)|flashattn\w*sm9|flash3"),
    ("FlashAttention-2", "attention", r"(^|\W)(pytorch_)?flash(::|_)(fwd|bwd)\w*kernel"),
    ("memory-efficient attention (CUTLASS fmha)", "attention", r"fmha_cutlass|attentionkernel"),
    ("cuDNN attention", "attention", r"cudnn\w*(sdpa|fmha|flash|mha|attn)|sm\d+_flash_[fb]prop"
                                     r"|fmha"),
    ("Inductor flex attention", "attention", r"^triton_tem_\w*flex_attention"),
    ("Pallas flash attention (jaxtrain)", "attention", r"jaxtrain_flash_(fwd|bwd)"),
    ("Triton/Pallas/Mosaic attention", "attention",
     r"(^|_)(attn|attention|mha)_?(fwd|bwd|forward|backward|kernel)|mosaic\w*(attn|attention)"),
    ("Inductor GEMM template", "gemm", r"^triton_tem_\w*(mm|matmul|gemm|conv)"),
    ("XLA Triton GEMM", "gemm", r"triton_gemm|gemm_fusion|__triton_gemm"),
    ("nvjet (cuBLAS)", "gemm", r"nvjet"),
    ("cuBLAS/cuBLASLt", "gemm", r"cublas|xmma_gemm|sm\d+_xmma|(ampere|volta|turing|hopper)_\w*"
                                r"gemm|gemmk1|gemv|splitkreduce"),
    ("CUTLASS GEMM", "gemm", r"cutlass\w*(gemm|tensorop|wgmma|matmul|kernel)"),
    ("Triton GEMM", "gemm", r"^triton\w*(matmul|gemm|_mm_)"),
    ("other GEMM", "gemm", r"gemm|matmul|wgmma|(^|[_.])dot([_.\d]|$)"),
)]

# NCCL kernel words and torch's record_param_comms names -> the collective's kind
_NCCL_KIND_RE = re.compile(r"(AllReduce|AllGather|ReduceScatter|AllToAll|Broadcast|Reduce|"
                           r"SendRecv|Send|Recv)", re.I)
_COMMS_KIND = {"allreduce": "all-reduce", "all_reduce": "all-reduce", "allgather": "all-gather",
               "all_gather": "all-gather", "_allgather_base": "all-gather",
               "all_gather_into_tensor": "all-gather", "reduce_scatter": "reduce-scatter",
               "_reduce_scatter_base": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter",
               "alltoall": "all-to-all", "all_to_all": "all-to-all", "all_to_allv": "all-to-all",
               "alltoall_base": "all-to-all", "broadcast": "broadcast", "reduce": "reduce",
               "send": "send/recv", "recv": "send/recv", "recvanysource": "send/recv",
               "batch_isend_irecv": "send/recv", "gather": "gather", "scatter": "scatter",
               "barrier": "barrier"}
_NCCL_KIND = {"allreduce": "all-reduce", "allgather": "all-gather",
              "reducescatter": "reduce-scatter", "alltoall": "all-to-all",
              "broadcast": "broadcast", "reduce": "reduce", "sendrecv": "send/recv",
              "send": "send/recv", "recv": "send/recv"}


@dataclasses.dataclass(frozen=True)
class Kind:
    cls: str           # gemm | attention | non_gemm | comm | p2p | memcpy | memset | h2d
    family: str
    collective: str = ""   # comm/p2p: all-reduce, all-to-all, send/recv, ...


def classify(name: str, collective: str = "") -> Kind:
    """The class of a kernel named `name`; `collective` is torch's record_param_comms name of
    the op that launched it ("" when none)."""
    if collective:
        kind = collective_kind(collective)
        if kind:
            return Kind("p2p" if kind == "send/recv" else "comm", "NCCL", kind)
    for family, cls, pattern in _RULES:
        if pattern.search(name):
            if cls != "comm":
                return Kind(cls, family)
            m = _NCCL_KIND_RE.search(name.split("(")[0].removeprefix("void "))
            kind = _NCCL_KIND.get(m.group(1).lower(), "") if m else ""
            # SendRecv without record_param_comms: pipeline send/recv (the common case)
            return Kind("p2p" if kind == "send/recv" else "comm", family, kind or "collective")
    return Kind("non_gemm", "other kernels")


def collective_kind(name: str) -> str:
    """The kind ("all-reduce", "all-to-all", "send/recv", ...) of a record_param_comms name,
    "" when it names none (a coalesced group, a wait)."""
    key = name.strip().lower().removeprefix("nccl:").removeprefix("c10d::").rstrip("_")
    return _COMMS_KIND.get(key.removesuffix("_coalesced"), "")


class Families:
    """Which kernel names each family matched: kernels, seconds, up to three example names."""

    def __init__(self):
        self._rows = defaultdict(lambda: {"class": "", "kernels": 0, "time_s": 0.0,
                                          "examples": []})

    def add(self, kind: Kind, name: str, seconds: float) -> None:
        row = self._rows[kind.family]
        row["class"] = kind.cls
        row["kernels"] += 1
        row["time_s"] += seconds
        short = name.split("(")[0][:120]
        if short not in row["examples"] and len(row["examples"]) < 3:
            row["examples"].append(short)

    def table(self) -> dict:
        return dict(sorted(self._rows.items(), key=lambda kv: -kv[1]["time_s"]))
