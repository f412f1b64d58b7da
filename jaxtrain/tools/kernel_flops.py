"""The matmul FLOPs of a compiled op as a step executes them: GEMMs and dots (hlo.py), the
attention kernels whose matmuls no dot shows, counted as the dense attention's, and the MoE
grouped GEMM kernels (kernels/grouped_matmul), counted by the routed rows they multiply."""
from __future__ import annotations

import re

from jaxtrain.tools import hlo, hlo_module

# Attention kernels (custom calls whose matmuls no dot shows): the project's flash kernels
# (Pallas Triton and Mosaic GPU by the kernel name in their attributes) and cuDNN's fused
# attention by target, each -> its matmuls in the dense algorithm's count (forward QK^T and PV;
# backward dV, dP, dQ, dK: the dK/dV kernel two, the dQ kernel two), each 2·B·Sq·Sk·H·D
# over the full square as the ledger's *_full_attn counts: what the kernels skip (the causal
# half) and recompute (S, P in both backward kernels) is left out.
_ATTENTION_KERNELS = (
    (re.compile(r'custom_call_target="(?:__gpu\$xla\.gpu\.triton|mosaic_gpu(?:_v2)?)".*'
                r'jaxtrain_(?:mosaic_)?flash_(?:fwd|bwd_dkv|bwd_dq)\b'), 2),
    (re.compile(r'custom_call_target="__cudnn\$fmha\w*Backward'), 4),
    (re.compile(r'custom_call_target="__cudnn\$fmha'), 2))
_FLOAT_4D_RE = re.compile(r"\b(?:bf16|f16|f32|f8\w*)\[(\d+),(\d+),(\d+),(\d+)\]")


def attention_kernel_flops_of(instr, comp, head_dims: tuple[int, int] | None = None) -> int:
    """The dense-equivalent matmul FLOPs of an attention kernel call (0 for anything else).
    Its results (out, dK, dV, dQ) and 4-D float operands (q, k, v, dO), in any of the
    kernels' layouts, hold B first, a head size last (third in a transposed k or v), a head
    count and a sequence length (the larger of the two): the kernel spans Sq x Sk (one length when they are equal) over the most
    heads any of them has (q's). `head_dims`: the query/key and value head sizes (QK^T
    contracts the first, PV and the backward's dV/dP the second: MLA's differ), else both the
    first result's last dim."""
    if instr.opcode != "custom-call":
        return 0
    matmuls = next((n for pattern, n in _ATTENTION_KERNELS if pattern.search(instr.attrs)), 0)
    if not matmuls:
        return 0
    shapes = [sh if sh else comp.by_name[o].shape if o in comp.by_name else ""
              for o, sh in zip(instr.operands, instr.operand_shapes)]
    tensors = [tuple(map(int, m.groups())) for m in _FLOAT_4D_RE.finditer(instr.shape)]
    tensors += [tuple(map(int, m.groups())) for sh in shapes
                for m in [_FLOAT_4D_RE.match(sh.lstrip("("))] if m]
    if not tensors or not _FLOAT_4D_RE.search(instr.shape):
        raise hlo_module.HloParseError(f"attention kernel %{instr.name} in {comp.name}: no [B, S, heads, "
                            "D] result or operands to size it by")
    b, d = tensors[0][0], tensors[0][-1]
    dq, dv = head_dims or (d, d)
    if not any(dims[i] in (dq, dv) for dims in tensors for i in (3, 2)):
        dq = dv = d   # zero-padded head sizes (flash_attention._pad): the kernel multiplies those
    seqs, heads = set(), 1
    for dims in tensors:
        # the head size last ([B, S, heads, D], [B, heads, S, D]) or third (a transposed
        # [B, heads, D, S] k or v)
        at = next((i for i in (3, 2) if dims[i] in (dq, dv)), None)
        if at is None:
            continue
        rest = [x for i, x in enumerate(dims[1:], 1) if i != at]
        seqs.add(max(rest))
        heads = max(heads, min(rest))
    sq, sk = min(seqs), max(seqs)
    # each kernel's matmuls pair up one contracting the q/k head size, one the value's
    return matmuls * b * sq * sk * heads * (dq + dv)


# The grouped GEMM kernels (Mosaic GPU, by the kernel name in their op_name): rows x group
# (forward, dX: result [M, N], lhs [M, K]) and per group (dW: result [G, K, N], lhs [M, K]
# and dY [M, N]); either multiplies each of its M buffer rows that is in a group once.
_GROUPED_RE = re.compile(r'custom_call_target="mosaic_gpu(?:_v2)?".*'
                         r'jaxtrain_grouped_(rows|per_group)\b')
_FLOAT_RE = re.compile(r"\b(?:bf16|f16|f32)\[([\d,]+)\]")


def grouped_gemm_flops_of(instr, rows_share: float = 1.0) -> float:
    """Matmul FLOPs of a grouped GEMM kernel call (0 for anything else): 2·M·K·N over its
    buffer's M rows times `rows_share`, the share of them in a group (the kernels skip row
    tiles in none). The share is data-dependent; the dry run passes the balanced load's:
    under expert parallelism a rank's receive buffer holds every sender's worst case (ep
    blocks of T·k rows) of which T·k (or capacity's kept rows) arrive."""
    if instr.opcode != "custom-call":
        return 0.0
    kind = _GROUPED_RE.search(instr.attrs)
    if kind is None:
        return 0.0
    operands = instr.attrs.split("operand_layout_constraints={", 1)[-1].split("}, api_version")[0]
    two_d = [tuple(map(int, m.split(","))) for m in _FLOAT_RE.findall(operands)
             if m.count(",") == 1]
    result = tuple(map(int, _FLOAT_RE.search(instr.shape).group(1).split(",")))
    if not two_d or len(result) != (2 if kind.group(1) == "rows" else 3):
        raise hlo_module.HloParseError(f"grouped GEMM kernel %{instr.name} in its HLO: no "
                                       "[M, K] operand or result of the kernel's rank")
    m = two_d[0][0]
    if kind.group(1) == "rows":
        k, n = two_d[0][1], result[1]
    else:
        k, n = result[1], result[2]
    return 2.0 * m * k * n * rows_share


def executed_flops_of(instr, comp, grouped_rows_share: float = 1.0,
                      head_dims: tuple[int, int] | None = None) -> float:
    """Matmul FLOPs of an op: GEMMs and dots, attention kernels as their dense matmuls (at
    `head_dims`: attention_kernel_flops_of), the grouped GEMM kernels by their routed rows
    (grouped_gemm_flops_of)."""
    return (hlo.matmul_flops_of(instr, comp) + attention_kernel_flops_of(instr, comp, head_dims)
            + grouped_gemm_flops_of(instr, grouped_rows_share))
