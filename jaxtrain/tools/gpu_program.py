"""What only a GPU program has: GEMM backends, async collectives and their overlap, kernels.

Reads the optimized HLO of a step compiled for (compile-only) GPUs, and the compiler's dump
folder (`compiler_options={"xla_dump_to": DIR}`):

- `gemms`: every matmul by what runs it — a cuBLASLt GEMM (bf16/fp16/fp32, or FP8 with its
  scales fused), a Triton GEMM fusion, or a plain dot — with its FLOPs per step.
- `async_collectives`: every collective with its start/done pair and whether a matmul-class
  kernel (or a loop holding them) is scheduled between the two (the static overlap: XLA:GPU
  prints a scheduled module, so the instruction order is the execution order of the compute
  stream; a collective with only elementwise work, or nothing, between start and done, or a
  synchronous one, is exposed whatever the hardware does).
- `kernels` / `mosaic_kernels` (gpu_kernels.py): each Pallas kernel's launch resources,
  registers and spills (Triton from XLA's dump folder, Mosaic GPU from its own).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxtrain.tools import hlo, hlo_module
from jaxtrain.tools.gpu_kernels import (kernels, mosaic_kernel_names, mosaic_kernels,
                                        pallas_kernel_names)

# Between an async collective's start and done, what hides it: a matmul-class kernel (a GEMM
# custom call or fusion, a Pallas/cuDNN kernel) or a loop or call (whose bodies hold them).
# Elementwise fusions, slices and copies take microseconds next to a weight's all-gather.
_CALL_OPS = {"while", "conditional", "call"}
_KERNEL_TARGET = re.compile(
    r'custom_call_target="(?:__cublas|__cudnn|__gpu\$xla\.gpu\.triton|mosaic_gpu)')


@dataclasses.dataclass(frozen=True)
class Gemm:
    backend: str        # cublaslt / cublaslt-fp8 / cublas / triton / dot
    dtype: str          # operand element type(s), e.g. bf16 or f8e4m3fn x f8e5m2
    flops: float        # per step (loops counted by trip count)
    op: str


@dataclasses.dataclass(frozen=True)
class AsyncCollective:
    collective: hlo.Collective
    is_async: bool      # a -start/-done pair (else a synchronous op)
    overlapped: bool    # compute scheduled between start and done


# ----------------------------------------------------------------------------- GEMMs

_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_KIND_RE = re.compile(r'"kind":"(__triton[a-z_]*gemm[a-z_]*)"')
_ELEM_RE = re.compile(r"\b([a-z][a-z0-9]*)\[")


def _operand_types(instr, comp) -> str:
    types = []
    for name, shape in list(zip(instr.operands, instr.operand_shapes))[:2]:
        shape = shape or (comp.by_name[name].shape if name in comp.by_name else "")
        m = _ELEM_RE.search(shape or "")
        types.append(m.group(1) if m else "?")
    return " x ".join(dict.fromkeys(types))


def gemms(text: str) -> list[Gemm]:
    """Every matmul of the module with what runs it and its FLOPs per step."""
    comps, reach = hlo_module.parsed(text)
    fused = {c for comp in comps.values() for i in comp.instrs if i.opcode == "fusion"
             for c, _, _ in hlo_module.callees(i)}   # computations a fusion calls
    out = []
    for comp in comps.values():
        for instr in comp.instrs:
            n = reach[comp.name].count
            if instr.opcode == "custom-call":
                m = _TARGET_RE.search(instr.attrs)
                target = m.group(1) if m else ""
                if "cublas" not in target:
                    continue
                backend = ("cublaslt-fp8" if target.endswith("$f8") else
                           "cublaslt" if "$lt$" in target else "cublas")
                out.append(Gemm(backend, _operand_types(instr, comp),
                                hlo.matmul_flops_of(instr, comp) * n, instr.name))
            elif instr.opcode == "fusion" and _FUSION_KIND_RE.search(instr.attrs):
                called = [c for c, _, _ in hlo_module.callees(instr) if c in comps]
                dots = [(i, comps[c]) for c in called for i in comps[c].instrs
                        if i.opcode == "dot"]
                flops = sum(hlo.matmul_flops_of(i, c) for i, c in dots) * n
                dtype = _operand_types(*dots[0]) if dots else "?"
                out.append(Gemm("triton", dtype, flops, instr.name))
            elif instr.opcode == "dot" and comp.name not in fused:
                out.append(Gemm("dot", _operand_types(instr, comp),
                                hlo.matmul_flops_of(instr, comp) * n, instr.name))
    return out


@dataclasses.dataclass(frozen=True)
class Fp8Gemm:
    op: str
    result: str                     # the element type it writes, e.g. bf16
    scales: tuple[frozenset, ...]   # per scalar (scale) operand: the element types its value
                                    # passed through on the way (fused computations too)


def _producer_types(comp, name: str, comps: dict, depth: int = 0) -> set[str]:
    instr = comp.by_name.get(name)
    if instr is None:
        return set()
    types = set(_ELEM_RE.findall(instr.shape))
    if instr.opcode == "fusion":
        types |= {t for c, _, _ in hlo_module.callees(instr) if c in comps
                  for i in comps[c].instrs for t in _ELEM_RE.findall(i.shape)}
    if instr.opcode not in ("parameter", "get-tuple-element", "constant") and depth < 16:
        for operand in instr.operands:
            types |= _producer_types(comp, operand, comps, depth + 1)
    return types


def fp8_gemm_scales(text: str) -> list[Fp8Gemm]:
    """Every cuBLASLt FP8 GEMM with its result type and what its fp32 scale operands were
    computed through: a bf16 there is a scale rounded to bf16 before the GEMM applied it."""
    comps, _ = hlo_module.parsed(text)
    out = []
    for comp in comps.values():
        for instr in comp.instrs:
            if instr.opcode != "custom-call" or '"__cublas$lt$matmul$f8"' not in instr.attrs:
                continue
            scalars = [name for name, shape in zip(instr.operands, instr.operand_shapes)
                       if (shape or comp.by_name[name].shape).startswith("f32[]")]
            result = _ELEM_RE.search(instr.shape.lstrip("("))
            out.append(Fp8Gemm(instr.name, result.group(1) if result else "?", tuple(
                frozenset(_producer_types(comp, name, comps)) for name in scalars)))
    return out


def gemm_summary(gs: list[Gemm]) -> dict[tuple[str, str], tuple[int, float]]:
    """(backend, dtype) -> (ops, FLOPs per step)."""
    out: dict = {}
    for g in gs:
        n, f = out.get((g.backend, g.dtype), (0, 0.0))
        out[(g.backend, g.dtype)] = (n + 1, f + g.flops)
    return out


# ----------------------------------------------------------------------------- overlap

def async_collectives(text: str, mesh: Any, collectives=None) -> list[AsyncCollective]:
    """Every collective of the module, with whether compute runs between its start and done
    (`collectives`: hlo.collectives_from_text(text, mesh), when the caller has them)."""
    comps, _ = hlo_module.parsed(text)
    if collectives is None:
        collectives = hlo.collectives_from_text(text, mesh)
    by_op = {(c.computation, c.op): c for c in collectives}
    out = []
    for comp in comps.values():
        for k, instr in enumerate(comp.instrs):
            coll = by_op.get((comp.name, instr.name))
            if coll is None:
                continue
            if not instr.opcode.endswith("-start"):
                out.append(AsyncCollective(coll, False, False))
                continue
            done = next((j for j in range(k + 1, len(comp.instrs))
                         if comp.instrs[j].opcode.endswith("-done")
                         and instr.name in comp.instrs[j].operands), None)
            if done is None:
                raise hlo.HloParseError(f"async %{instr.name} has no -done in {comp.name}")
            between = comp.instrs[k + 1:done]
            out.append(AsyncCollective(coll, True, any(map(_hides, between))))
    return out


def _hides(instr) -> bool:
    if instr.opcode in _CALL_OPS or instr.opcode == "dot":
        return True
    if instr.opcode == "custom-call":
        return bool(_KERNEL_TARGET.search(instr.attrs))
    return instr.opcode == "fusion" and bool(_FUSION_KIND_RE.search(instr.attrs))


def overlap_by_axis(acs: list[AsyncCollective], runs: dict | None = None
                    ) -> dict[tuple | None, tuple[float, float]]:
    """mesh axes -> (wire bytes per step with compute between start and done, all of them);
    `runs`: executions per step of each computation as a device runs it (a pipelined step's
    executed runs, pipeline_flops.executed_runs), else every branch of every conditional."""
    out: dict = {}
    for a in acs:
        c = a.collective
        if not c.axes:
            continue
        wire = c.wire_bytes_per_step if runs is None else c.wire_bytes * runs[c.computation]
        hidden, total = out.get(c.axes, (0.0, 0.0))
        out[c.axes] = (hidden + (wire if a.overlapped else 0.0), total + wire)
    return out


# ----------------------------------------------------------------------------- the report

_RAGGED_RE = re.compile(r"\bragged-all-to-all(-start|-done)?\(")


def ragged_all_to_alls(text: str) -> tuple[int, int]:
    """(async start/done pairs, synchronous ops) of ragged-all-to-all in a GPU program (the
    expert dispatch's transport; hlo.KINDS leaves it out: its static shape is the receive
    buffer's worst case, not the rows it moves). A start without its done raises."""
    ops = [m.group(1) or "" for line in text.splitlines() if " = " in line
           for m in [_RAGGED_RE.search(line.split(" = ", 1)[1])] if m]
    starts, dones = ops.count("-start"), ops.count("-done")
    if starts != dones:
        raise ValueError(f"{starts} ragged-all-to-all-start but {dones} -done in the program")
    return starts, ops.count("")


def ragged_pairs_hidden(text: str) -> int:
    """How many ragged-all-to-all start/done pairs have compute (a GEMM, a kernel, a call)
    scheduled between them: the dispatch's static overlap, as async_collectives reads it
    for the other collectives."""
    comps, _ = hlo_module.parsed(text)
    hidden = 0
    for comp in comps.values():
        for k, instr in enumerate(comp.instrs):
            if instr.opcode != "ragged-all-to-all-start":
                continue
            done = next((j for j in range(k + 1, len(comp.instrs))
                         if comp.instrs[j].opcode == "ragged-all-to-all-done"
                         and instr.name in comp.instrs[j].operands), len(comp.instrs))
            hidden += any(map(_hides, comp.instrs[k + 1:done]))
    return hidden


@dataclasses.dataclass
class GpuReport:
    """What the dry run adds for a GPU program (module docstring)."""
    gemms: dict                 # (backend, dtype) -> (ops, FLOPs per step)
    collectives: list           # AsyncCollective
    kernels: list               # Kernel
    device_memory: int          # bytes the target device reports
    total_bytes: int | None     # the compiled step's footprint per device
    xla_options: dict = dataclasses.field(default_factory=dict)  # what it compiled with
    runs: dict | None = None    # computation -> executions per step as a device runs it
    ragged: tuple = (0, 0)      # ragged all-to-alls (the MoE dispatch): start/done pairs, sync
    ragged_hidden: int = 0      # of those pairs, how many have compute between start and done

    @classmethod
    def read(cls, text: str, mesh, dump_dir, device_memory: int, total_bytes,
             xla_options: dict | None = None, collectives=None, mosaic_dir=None,
             runs: dict | None = None):
        names = pallas_kernel_names(text)
        ks = kernels(dump_dir, names) if names and dump_dir is not None else []
        mosaic = mosaic_kernel_names(text)
        if mosaic and mosaic_dir is not None:
            ks += mosaic_kernels(mosaic_dir, mosaic)
        return cls(gemm_summary(gemms(text)), async_collectives(text, mesh, collectives), ks,
                   device_memory, total_bytes, dict(xla_options or {}), runs,
                   ragged_all_to_alls(text), ragged_pairs_hidden(text))

    def overlap(self) -> dict:
        return overlap_by_axis(self.collectives, self.runs)

    def async_pairs(self) -> dict[str, tuple[int, int]]:
        """kind -> (async start/done pairs, synchronous ops)."""
        out: dict = {}
        for a in self.collectives:
            pairs, sync = out.get(a.collective.kind, (0, 0))
            out[a.collective.kind] = (pairs + a.is_async, sync + (not a.is_async))
        if any(self.ragged):
            out["ragged-all-to-all"] = self.ragged
        return out

    def fits(self) -> bool | None:
        return None if self.total_bytes is None else self.total_bytes <= self.device_memory

    def format(self) -> str:
        gib = 2 ** 30
        out = ["", "GPU program (XLA:GPU for sm_90a; nothing ran, nothing autotuned):"]
        out.append("  XLA options: " + (" ".join(f"{k}={v}" for k, v in
                                                 sorted(self.xla_options.items())) or "none"))
        total = sum(f for _, f in self.gemms.values()) or 1.0
        out.append("  GEMMs by backend      ops   FLOPs/step  share")
        for (backend, dtype), (n, f) in sorted(self.gemms.items(), key=lambda kv: -kv[1][1]):
            out.append(f"    {backend:12} {dtype:14} {n:5d}  {f:10.4g}  {f / total:5.1%}")
        out.append("  collectives (async start/done pairs, synchronous ops): " + ", ".join(
            f"{k} {p}/{s}" for k, (p, s) in sorted(self.async_pairs().items())))
        if self.ragged[0]:
            out.append(f"  ragged all-to-alls (MoE dispatch) with compute between start and done: "
                       f"{self.ragged_hidden} of {self.ragged[0]} pairs")
        out.append("  static overlap: wire bytes with compute scheduled between start and done"
                   + (" (as a device executes them)" if self.runs is not None else ""))
        for axes, (hidden, all_) in sorted(self.overlap().items(), key=lambda kv: str(kv[0])):
            if all_ < 1e6:   # the loss's and the gradient norm's scalars
                continue
            label = "?" if axes is None else ",".join(axes)
            out.append(f"    {label:14} {hidden / 1e9:10.3f} of {all_ / 1e9:10.3f} GB  "
                       f"{hidden / all_ if all_ else 0:6.1%}")
        if self.kernels:
            out.append("  Pallas kernels                  grid              threads  smem KiB  "
                       "regs  spills")
            for k in self.kernels:
                spills = "-" if k.spill_stores is None else f"{k.spill_stores}/{k.spill_loads} B"
                wg = (" (setmaxnreg " + "/".join(map(str, k.warpgroup_registers)) + ")"
                      if k.warpgroup_registers else "")
                out.append(f"    {k.name:30} {str(list(k.grid)):16} {k.threads[0]:7d}  "
                           f"{k.shared_memory / 1024:8.0f}  {k.registers or '-':>4}  {spills}{wg}")
        if self.total_bytes is not None:
            verdict = ("fits" if self.fits() else
                       f"DOES NOT FIT: {(self.total_bytes - self.device_memory) / gib:.2f} GiB "
                       "over")
            out.append(f"  memory: {self.total_bytes / gib:.2f} GiB per device of the device's "
                       f"{self.device_memory / gib:.2f} GiB: {verdict} (static buffers only: "
                       "no NCCL buffers, allocator slack or CUDA context)")
        return "\n".join(out)

    def to_json(self) -> dict:
        return {
            "gemms": [{"backend": b, "dtype": d, "ops": n, "flops_per_step": f}
                      for (b, d), (n, f) in sorted(self.gemms.items())],
            "async_pairs": {k: {"async": p, "sync": s} for k, (p, s) in self.async_pairs().items()},
            "overlap": [{"axes": None if a is None else list(a), "hidden_wire_bytes": h,
                         "wire_bytes": t} for a, (h, t) in sorted(self.overlap().items(),
                                                                  key=lambda kv: str(kv[0]))],
            "kernels": [dataclasses.asdict(k) for k in self.kernels],
            "device_memory_bytes": self.device_memory, "fits": self.fits(),
            "xla_options": self.xla_options,
        }
