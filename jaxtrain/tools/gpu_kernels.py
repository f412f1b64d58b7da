"""The resources of the Pallas kernels a GPU program runs: per kernel its grid, threads,
shared memory, registers and spills (and, for Mosaic GPU, its warpgroups' register budgets).

- Triton (`kernels`): grid, threads and shared memory from the thunk sequence in XLA's dump
  folder, registers and spills from ptxas (the nvidia-cuda-nvcc wheel that jax[cuda12]
  installs) run on the kernel's PTX for sm_90a.
- Mosaic GPU (`mosaic_kernels`): the launch and ptxas report from the folder Mosaic dumps
  into while the step compiles (`mosaic_dump`: MOSAIC_GPU_DUMP_TO), with the setmaxnreg
  budgets.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import re
import subprocess

from jaxtrain.tools import hlo_module


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    grid: tuple
    threads: tuple
    shared_memory: int
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    warpgroup_registers: tuple = ()   # Mosaic: setmaxnreg budgets (compute, memory), if any

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads)


_THUNK_RE = re.compile(r"\]\s+(\S+)\s+grid:\s*\[([\d,\s]+)\]\s+threads:\s*\[([\d,\s]+)\]\s+"
                       r"shared_memory:\s*(\d+)")
_PALLAS_NAME_RE = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton".*?name = "([^"]+)"')


def pallas_kernel_names(text: str) -> set[str]:
    return set(_PALLAS_NAME_RE.findall(text))


def ptxas_path() -> pathlib.Path:
    import importlib.util
    spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("ptxas: the nvidia-cuda-nvcc wheel (installed with jax[cuda12]) "
                                "is missing")
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "bin" / "ptxas"


def _ptxas(ptx: pathlib.Path, arch: str = "sm_90a") -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) of a PTX file's kernel."""
    res = subprocess.run([str(ptxas_path()), f"-arch={arch}", "-v", str(ptx), "-o", "/dev/null"],
                         capture_output=True, text=True, timeout=300)
    info = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    if res.returncode or not regs:
        raise RuntimeError(f"ptxas failed on {ptx.name}: {info[-400:]}")
    return int(regs.group(1)), int(spill.group(1)) if spill else 0, \
        int(spill.group(2)) if spill else 0


def kernels(dump_dir: str | pathlib.Path, names: set[str]) -> list[Kernel]:
    """Launch resources of the named kernels from a compile's dump folder."""
    dump = pathlib.Path(dump_dir)
    seq = sorted(dump.glob("*thunk_sequence.txt"))
    if not seq:
        raise FileNotFoundError(f"no *thunk_sequence.txt in {dump}: compile with "
                                "compiler_options={'xla_dump_to': DIR}")
    launches = {}
    for line in seq[-1].read_text().splitlines():
        m = _THUNK_RE.search(line)
        if m and m.group(1) in names:
            launches.setdefault(m.group(1), m)
    ptx = {}
    for f in dump.glob("*.ptx"):
        m = re.search(r"\.entry\s+([\w$]+)\(", f.read_text())
        if m and m.group(1) in names:
            ptx[m.group(1)] = f
    out = []
    for name, m in sorted(launches.items()):
        regs = stores = loads = None
        if name in ptx:
            regs, stores, loads = _ptxas(ptx[name])
        out.append(Kernel(name, tuple(hlo_module.ints(m.group(2))), tuple(hlo_module.ints(m.group(3))),
                          int(m.group(4)), regs, stores, loads))
    return out


_MOSAIC_NAME_RE = re.compile(r'custom_call_target="mosaic_gpu(?:_v2)?".*?op_name="[^"]*?/(\w+)/'
                             r'mpmd_map"')
_LAUNCH_RE = re.compile(r"@mosaic_gpu_launch_kernel\(ptr %\w+, " + ", ".join([r"i32 (\d+)"] * 10))
_SETMAXNREG_RE = re.compile(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+);")


def mosaic_kernel_names(text: str) -> set[str]:
    """The Pallas Mosaic GPU kernels (plgpu.kernel's kernel_name) a compiled module calls."""
    return set(_MOSAIC_NAME_RE.findall(text))


_MOSAIC_DUMP_ENV = ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_HOST_LLVM")


@contextlib.contextmanager
def mosaic_dump(folder):
    """While compiling, Mosaic GPU writes each kernel's host code (its launch), PTX and ptxas
    report into `folder` (None: nothing)."""
    old = {k: os.environ.get(k) for k in _MOSAIC_DUMP_ENV}
    if folder is not None:
        pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
        os.environ.update(dict(zip(_MOSAIC_DUMP_ENV, (str(folder), "1"))))
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def mosaic_kernels(dump_dir, names: set[str]) -> list[Kernel]:
    """Launch resources of the named Mosaic GPU kernels from a `mosaic_dump` folder: per name
    the worst of its compiled instances (most shared memory, registers, spills)."""
    dump = pathlib.Path(dump_dir)
    worst: dict[str, Kernel] = {}
    for report in sorted(dump.glob("*.ptxas")):
        name = report.stem.rsplit("_", 1)[0]
        if name not in names:
            continue
        info = report.read_text()
        regs = re.search(r"Used (\d+) registers", info)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
        launch = _LAUNCH_RE.search(report.with_suffix(".ll").read_text())
        ptx = report.with_suffix(".ptx")
        budgets = tuple(int(x) for x in _SETMAXNREG_RE.findall(ptx.read_text())) \
            if ptx.exists() else ()
        if launch is None or regs is None:
            raise RuntimeError(f"{report.name}: no launch or register count in Mosaic's dump")
        g = [int(x) for x in launch.groups()]
        k = Kernel(name, tuple(g[0:3]), (g[6] * g[7] * g[8],), g[9], int(regs.group(1)),
                   int(spill.group(1)) if spill else 0, int(spill.group(2)) if spill else 0,
                   tuple(dict.fromkeys(budgets)))
        old = worst.get(name)
        if old is None or (k.spill_stores, k.shared_memory, k.registers) > (
                old.spill_stores, old.shared_memory, old.registers):
            worst[name] = k
    return [worst[n] for n in sorted(worst)]
