"""jaxtrain.xla_flags: the GPU defaults follow the mesh's resolved degrees (a -1 in the config
is filled by then), apply only on GPUs, and train.xla_flags overrides them."""
from jaxtrain import xla_flags
from util import tiny_config

MESH = {"stage": 1, "data": 1, "fsdp": 8, "context": 1, "tensor": 1}


def test_a_filled_fsdp_degree_gets_the_fsdp_defaults():
    cfg = tiny_config("--parallel.data=1", "--parallel.fsdp=-1")
    got = xla_flags.for_platform(cfg, "gpu", MESH)
    assert got == {**xla_flags.FSDP, **xla_flags.LAYER_LOOP_ONLY}
    assert xla_flags.for_platform(cfg, "cpu", MESH) == {}


def test_a_filled_context_degree_gets_the_ring_default_and_overrides_win():
    ring = ("--parallel.data=1", "--parallel.context=-1", "--parallel.context_load_balance=false",
            "--parallel.context_strategy=ring")
    mesh = {**MESH, "fsdp": 1, "context": 4}
    assert xla_flags.for_platform(tiny_config(*ring), "gpu", mesh) == xla_flags.RING
    cfg = tiny_config(*ring,
                      "--train.xla_flags=xla_gpu_experimental_parallel_collective_overlap_limit=1")
    assert xla_flags.for_platform(cfg, "gpu", mesh) == {
        "xla_gpu_experimental_parallel_collective_overlap_limit": 1}


def test_collective_matmul_turns_the_dot_merger_off():
    cfg = tiny_config("--parallel.data=1", "--parallel.tensor=8",
                      "--parallel.sequence_parallel=true", "--parallel.collective_matmul=true")
    mesh = {**MESH, "fsdp": 1, "tensor": 8}
    assert xla_flags.for_platform(cfg, "gpu", mesh) == xla_flags.COLLECTIVE_MATMUL
    assert xla_flags.for_platform(cfg, "cpu", mesh) == {}
