"""parallel.collective_matmul on compile-only H100s: the rings' permutes are in the program,
asynchronous with a GEMM scheduled between each start and its done, and the tensor axis moves
no more bytes than the plain TP+SP program's gathers and scatters."""
import pytest

from jaxtrain.tools import gpu_program
from gpu_compile_util import compile_tiny

pytestmark = pytest.mark.gpu_compile

# tensor=2 splits tiny_config's 2 KV heads: every in-projection runs in the ring
TP_SP = ("--parallel.data=2", "--parallel.fsdp=2", "--parallel.tensor=2",
         "--parallel.sequence_parallel=true")


def _tensor(out):
    return [a for a in gpu_program.async_collectives(out.text, out.mesh)
            if a.collective.axes == ("tensor",)]


# the pipeline's stages run the rings inside the executor's per-stage branches
PP_TP_SP = ("--parallel.stage=2", "--parallel.data=2", "--parallel.tensor=2",
            "--parallel.microbatches=4", "--parallel.sequence_parallel=true")


FULL_REMAT = ["--remat.granularity=full", "--remat.num_layers=1"]


def _hidden(acs) -> float:
    """The share of `acs`' wire bytes with compute between start and done."""
    wire = sum(a.collective.wire_bytes_per_step for a in acs)
    return sum(a.collective.wire_bytes_per_step for a in acs if a.overlapped) / wire


def _wire(acs) -> float:
    return sum(a.collective.wire_bytes_per_step for a in acs)


@pytest.mark.parametrize("layout, extra", [(TP_SP, []), (TP_SP, FULL_REMAT), (PP_TP_SP, [])],
                         ids=["tp_sp", "full_remat", "pp"])
def test_collective_matmul_hides_its_permutes_behind_gemms(h100, layout, extra):
    """Most of the rings' permute bytes (the tiny model leaves a few hops with no GEMM the
    scheduler can put inside them) and more of the tensor axis than the plain program's are
    hidden; without remat no more bytes move (full recompute moves more: docs/design.md §9)."""
    plain = _tensor(compile_tiny(h100, *layout, *extra))
    ring = _tensor(compile_tiny(h100, *layout, *extra, "--parallel.collective_matmul=true"))
    hops = [a for a in ring if a.collective.kind == "collective-permute"]
    assert hops and all(a.is_async for a in hops)
    assert _hidden(hops) >= 0.75, _hidden(hops)
    assert _hidden(ring) > _hidden(plain), (_hidden(ring), _hidden(plain))
    # the rings replace SP's gathers and reduce-scatters of the layers' projections
    kinds = lambda acs: sum(a.collective.kind in ("all-gather", "reduce-scatter")  # noqa: E731
                            for a in acs)
    assert kinds(ring) < kinds(plain)
    if not extra:
        assert _wire(ring) <= _wire(plain) * (1 + 1e-6), (_wire(ring), _wire(plain))
