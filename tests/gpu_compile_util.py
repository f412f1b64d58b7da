"""What the GPU-compile test modules share: a tiny model compiled for compile-only H100s
(jaxtrain.tools.targets, the `h100` fixture of conftest.py) and the H100's kernel limits."""
import re

from jaxtrain.parallel import sharding
from jaxtrain.tools import gpu_kernels
from jaxtrain.tools.compile_step import compile_step
from util import tiny_config

BF16 = ("--model.compute_dtype=bfloat16", "--model.vocab_size=512", "--train.global_batch=16")
LAYOUTS = {
    1: ("--parallel.data=2", "--parallel.fsdp=2", "--parallel.tensor=2",
        "--parallel.sequence_parallel=true"),
    2: ("--parallel.stage=2", "--parallel.data=2", "--parallel.tensor=2",
        "--parallel.microbatches=4"),
}
FLASH_KERNELS = {"jaxtrain_flash_fwd", "jaxtrain_flash_bwd_dkv", "jaxtrain_flash_bwd_dq"}
MOSAIC_KERNELS = {"jaxtrain_mosaic_flash_fwd", "jaxtrain_mosaic_flash_bwd_dkv",
                  "jaxtrain_mosaic_flash_bwd_dq"}
CUDNN_TARGET = re.compile(r'custom_call_target="__cudnn\$fmha')
H100_SMEM_PER_BLOCK = 232448


def compile_tiny(h100, *overrides, n=8, options=None, mosaic_dump=None):
    cfg = tiny_config(*BF16, *overrides)
    with gpu_kernels.mosaic_dump(mosaic_dump):
        return compile_step(cfg, sharding.make_mesh(cfg.parallel, h100(n)),
                            extra_options=options)


def assert_fit(kernels):
    """Every kernel within an H100 block's shared memory, 255 registers, without spills."""
    for x in kernels:
        assert x.shared_memory <= H100_SMEM_PER_BLOCK, x
        assert x.registers is not None and x.registers <= 255 and not x.spills, x


