"""The real XLA:GPU compiler on compile-only H100s (jaxtrain.tools.targets): what a GPU would run.

Nothing executes. These read what only the GPU program has: which attention kernel runs at
every pipeline depth, cuBLASLt FP8 GEMMs and their result types, each Pallas kernel's
registers, spills and shared memory, what the MFU breakdown reads of the attention kernels.
The compiled memory against the ledger is test_gpu_compile_ledger.py's, the pipeline's and
context parallelism's programs test_gpu_compile_parallel.py's, MoE's test_gpu_compile_moe.py's.
Run with `-m gpu_compile` after installing the gpu-compile extra (README's third command).
"""
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from jaxtrain.model import fp8_matmul
from jaxtrain.tools import gpu_kernels, gpu_program, hlo, hlo_module
from jaxtrain.config import Fp8Config, padded_vocab
from jaxtrain.ledger.flops import param_counts
from jaxtrain.model.kernels import flash_attention
from gpu_compile_util import (CUDNN_TARGET, FLASH_KERNELS, LAYOUTS, MOSAIC_KERNELS, assert_fit,
                              compile_tiny)

pytestmark = pytest.mark.gpu_compile


CONTEXT = {"none": (), "all_gather": ("--parallel.context=2",),
           "ring": ("--parallel.context=2", "--parallel.context_strategy=ring")}


@pytest.fixture(scope="module")
def mosaic_dir(tmp_path_factory):
    """One Mosaic dump folder for the module's attention compiles: Mosaic compiles a kernel
    once per process and dumps it then (auto's kernels are mosaic's, found there)."""
    return tmp_path_factory.mktemp("mosaic_dump")


@pytest.mark.parametrize("context", list(CONTEXT))
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("impl", ["xla", "pallas", "mosaic", "cudnn", "auto"])
def test_every_attention_compiles_at_every_pipeline_depth(h100, mosaic_dir, impl, stage, context):
    """The kernel each choice means on a GPU is the one in the program, at pipeline depth 1
    and 2 (the kernel's shard_map inside the pipeline's) and under each context strategy:
    on H100s `auto` is the Mosaic GPU kernel, within the H100's limits (no spills)."""
    if impl == "cudnn" and context == "ring":
        pytest.skip("cuDNN runs all_gather only (config.rules.CONTEXT_STRATEGIES)")
    cp = ("--train.seq_len=128", "--model.max_seq_len=128") if CONTEXT[context] else ()
    layout = LAYOUTS[stage] if not CONTEXT[context] else (
        ("--parallel.data=2", "--parallel.tensor=2") if stage == 1 else
        ("--parallel.stage=2", "--parallel.data=2", "--parallel.microbatches=2"))
    out = compile_tiny(h100, f"--model.attention={impl}", *layout, *CONTEXT[context], *cp,
                   mosaic_dump=mosaic_dir)
    pallas = gpu_kernels.pallas_kernel_names(out.text)
    mosaic = gpu_kernels.mosaic_kernel_names(out.text)
    cudnn = bool(CUDNN_TARGET.search(out.text))
    assert (pallas == FLASH_KERNELS) == (impl == "pallas"), pallas
    assert (mosaic == MOSAIC_KERNELS) == (impl in ("mosaic", "auto")), mosaic
    assert cudnn == (impl == "cudnn")
    if mosaic:
        kernels = gpu_kernels.mosaic_kernels(mosaic_dir, mosaic)
        assert {x.name for x in kernels} == MOSAIC_KERNELS
        assert_fit(kernels)


def test_collectives_of_a_gpu_program_are_read_per_mesh_axis(h100):
    """hlo reads GPU programs: async start/done pairs count once, combined (tuple) operands,
    reduce-scatters, and the mesh-style replica groups of compile-only devices."""
    out = compile_tiny(h100, "--model.attention=xla", *LAYOUTS[1])
    colls = hlo.collectives_from_text(out.text, out.mesh)
    opcodes = [i.opcode for c in hlo_module.parsed(out.text)[0].values() for i in c.instrs]
    starts = sum(o.removesuffix("-start") in hlo.KINDS for o in opcodes if o.endswith("-start"))
    dones = sum(o.removesuffix("-done") in hlo.KINDS for o in opcodes if o.endswith("-done"))
    sync = sum(o in hlo.KINDS for o in opcodes)
    assert len(colls) == starts + sync and starts == dones > 0
    assert all(c.axes is not None for c in colls), [c for c in colls if c.axes is None]
    kinds = {(c.kind, c.axes) for c in colls}
    assert ("reduce-scatter", ("fsdp",)) in kinds and ("all-gather", ("fsdp",)) in kinds
    assert any(c.shape.startswith("((") for c in colls)  # a combined all-gather
    assert "replica_groups=mesh[" in out.text


# ----------------------------------------------------------------------------- FP8

FP8 = ("--fp8.enabled=true", "--fp8.amax_history_len=16", "--model.attention=xla")
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}  # the cuBLAS path FP8 targets


def _f8_gemms(text):
    return [line for line in text.splitlines()
            if 'custom_call_target="__cublas$lt$matmul$f8"' in line]


def test_fp8_projections_are_cublaslt_gemms_that_write_the_compute_dtype(h100):
    """Every projection's forward, dgrad and wgrad is one cuBLASLt FP8 GEMM with its scales
    fused, writing bf16 (fp32 accumulation inside): no fp32 GEMM result, no cast kernel."""
    out = compile_tiny(h100, *FP8, "--parallel.data=2", "--parallel.tensor=2", n=4,
                   options=NO_TRITON_GEMM)
    comps, reach = hlo_module.parsed(out.text)
    f8 = [(i, reach[c.name].count) for c in comps.values() for i in c.instrs
          if i.opcode == "custom-call" and '"__cublas$lt$matmul$f8"' in i.attrs]
    # 7 projections x forward/dgrad/wgrad per layer, however the layer loop is unrolled
    runs = sum(n for _, n in f8)
    assert runs == 3 * 7 * out.setup.cfg.model.num_layers, runs
    results = [re.match(r"\((\w+)\[", i.shape).group(1) for i, _ in f8]
    assert set(results) == {"bf16"}, results


def test_fp8_gemms_take_their_scales_in_fp32(h100):
    """Transformer Engine's GEMM: fp32 accumulation, an fp32 alpha (the two scale_invs), one
    rounding to bf16. Every FP8 GEMM of the step (forward, dgrad, wgrad; the row-parallel
    ones before their all-reduce too) takes both scales as fp32 operands computed without a
    bf16 on the way, and writes bf16. The scale was cast to bf16 before it was applied (10
    of these 21 GEMMs took it rounded; the row-parallel ones multiplied after the all-reduce)."""
    out = compile_tiny(h100, *FP8, "--parallel.data=2", "--parallel.tensor=2", n=4,
                   options=NO_TRITON_GEMM)
    gemms = gpu_program.fp8_gemm_scales(out.text)
    assert len(gemms) == 21, gemms  # 7 projections x forward, dgrad, wgrad in the layer loop
    for g in gemms:
        assert g.result == "bf16" and len(g.scales) == 2, g
        assert all("f32" in types and "bf16" not in types for types in g.scales), g


FSDP_REMAT = ("--parallel.data=1", "--remat.granularity=full", "--remat.method=uniform",
              "--remat.num_layers=1", "--model.attention=xla")
ALL_FP8 = ("--fp8.enabled=true", "--fp8.bf16_first_layers=0", "--fp8.bf16_last_layers=0")


def _fsdp_gather_bytes(out):
    """Payload bytes per step of the all-gathers over fsdp alone, and the dtypes they move."""
    gathers = [c for c in hlo.collectives_from_text(out.text, out.mesh)
               if c.kind == "all-gather" and c.axes == ("fsdp",)]
    dtypes = {d for c in gathers for d in re.findall(r"(\w+)\[", c.shape)}
    return sum(c.bytes_per_step for c in gathers), dtypes


@pytest.mark.parametrize("layout", [("--parallel.fsdp=8",),
                                    ("--parallel.fsdp=4", "--parallel.tensor=2")])
def test_fsdp_gathers_fp8_weights_once_for_the_recompute_and_the_backward(h100, layout):
    """FSDP with every layer in FP8 and full remat: each layer's weights are gathered twice
    (forward; recompute and backward together), in FP8, and the head once in bf16 (the
    embedding never moves; its lookup gathers the int32 token ids): the floor of FSDP. The
    bf16 program gathers the same, at 2 bytes a weight. Before, the projections that share
    their input (q/k/v, gate/up) were cast again in their backward's re-trace and gathered
    once more: 3 gathers a layer."""
    bf16 = compile_tiny(h100, *FSDP_REMAT, *layout)
    fp8 = compile_tiny(h100, *FSDP_REMAT, *layout, *ALL_FP8)
    cfg = bf16.setup.cfg
    m, t = cfg.model, bf16.mesh.shape["tensor"]
    per = param_counts(m).per_layer
    layer_weights = sum(n for k, n in per.items() if k != "norms") / t  # norms: replicated
    head = m.hidden_size * padded_vocab(m.vocab_size, t) / t * 2
    ids = cfg.train.global_batch * cfg.train.seq_len * 4
    floor = {w: m.num_layers * 2 * layer_weights * w + head + ids for w in (1, 2)}
    got_bf16, bf16_dtypes = _fsdp_gather_bytes(bf16)
    got_fp8, fp8_dtypes = _fsdp_gather_bytes(fp8)
    assert got_bf16 == floor[2], (got_bf16, floor)
    assert bf16_dtypes == {"bf16", "s32"} and fp8_dtypes == {"f8e4m3fn", "bf16", "s32"}
    assert got_fp8 / got_bf16 <= floor[1] / floor[2], (got_fp8, floor)


def _projection_temps(fn, *args):
    compiled = jax.jit(fn).lower(*args).compile(compiler_options=NO_TRITON_GEMM)
    return compiled.memory_analysis().temp_size_in_bytes, compiled.as_text()


def test_one_fp8_projection_holds_bf16_temporaries_plus_its_fp8_operands(h100):
    """A 4096x8192x28672 projection's forward + backward: the FP8 step's temporaries are within
    10% of the bf16 step's plus its FP8 operand copies (and the transposes cuBLASLt's layout
    needs). An fp32 GEMM result with a separate cast kernel held 1040 MiB here; 592 now (480
    when the scale was rounded to bf16 and applied to the bf16 result)."""
    sh = SingleDeviceSharding(h100(1)[0])
    m, k, n = 4096, 8192, 28672
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=sh)
    w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=sh)
    recipe = fp8_matmul.recipe_of(Fp8Config(enabled=True))
    meta = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                        fp8_matmul.init_meta(recipe))
    dims = (((1,), (0,)), ((), ()))

    def fp8_step(x, w, meta):
        return jax.grad(lambda *a: jnp.sum(jnp.square(fp8_matmul.fp8_dot_general(
            a[0], a[1], dims, meta=a[2], cfg=recipe).astype(jnp.float32))),
            argnums=(0, 1, 2))(x, w, meta)

    def bf16_step(x, w):
        return jax.grad(lambda x, w: jnp.sum(jnp.square((x @ w).astype(jnp.float32))),
                        argnums=(0, 1))(x, w)
    fp8_temps, text = _projection_temps(fp8_step, x, w, meta)
    bf16_temps, _ = _projection_temps(bf16_step, x, w)
    f8_buffers = sum(hlo_module.shape_bytes(s) for s in re.findall(
        r"(f8e(?:4m3fn|5m2)\[[\d,]+\])\{[\d,]+\} ", text))
    assert len(_f8_gemms(text)) == 3
    assert fp8_temps <= 1.1 * (bf16_temps + f8_buffers), (fp8_temps, bf16_temps, f8_buffers)


# ----------------------------------------------------------------------------- kernels

@pytest.mark.parametrize("b,s,h,kv,d", [
    (1, 4096, 32, 8, 128),   # Llama 3 8B on one GPU
    (1, 8192, 8, 1, 128),    # Llama 3 70B per tensor shard at tensor=8
    (2, 4096, 16, 16, 64),   # head dim 64, MHA
])
def test_flash_kernels_fit_an_h100(h100, tmp_path, b, s, h, kv, d):
    """Forward and both backward kernels compile for sm_90a within the shared memory a block
    may use, without register spills (ptxas on the kernels' PTX)."""
    sh = SingleDeviceSharding(h100(1)[0])
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16, sharding=sh)
    k = jax.ShapeDtypeStruct((b, s, kv, d), jnp.bfloat16, sharding=sh)
    segment_ids = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=sh)  # as training passes

    def fwd_bwd(q, k, v, seg):
        return jax.grad(lambda *a: jnp.sum(flash_attention(*a, seg, interpret=False).astype(
            jnp.float32)), argnums=(0, 1, 2))(q, k, v)
    jax.jit(fwd_bwd).lower(q, k, k, segment_ids).compile(
        compiler_options={"xla_dump_to": str(tmp_path)})
    kernels = gpu_kernels.kernels(tmp_path, FLASH_KERNELS)
    assert {x.name for x in kernels} == FLASH_KERNELS
    for x in kernels:
        assert x.shared_memory <= 232448, x
        assert x.registers is not None and x.registers <= 255 and not x.spills, x


@pytest.mark.parametrize("fast", [False, True], ids=["checked", "fast"])
@pytest.mark.parametrize("b,s,h,kv,d,dv", [
    (1, 4096, 32, 8, 128, 128),   # Llama 3 8B on one GPU
    (1, 8192, 8, 1, 128, 128),    # Llama 3 70B per tensor shard at tensor=8
    (2, 4096, 16, 16, 64, 64),    # head dim 64, MHA
])
def test_mosaic_kernels_fit_an_h100(h100, tmp_path, fast, b, s, h, kv, d, dv):
    """The Mosaic GPU forward and both backward kernels, in their checked form (the default)
    and FlashAttention-3's fast form, compile for sm_90a within a block's shared memory and
    registers, without spills (ptxas' report from Mosaic's dump), with segment ids."""
    sh = SingleDeviceSharding(h100(1)[0])
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16, sharding=sh)
    k = jax.ShapeDtypeStruct((b, s, kv, d), jnp.bfloat16, sharding=sh)
    v = jax.ShapeDtypeStruct((b, s, kv, dv), jnp.bfloat16, sharding=sh)
    segment_ids = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=sh)

    def fwd_bwd(q, k, v, seg):
        attn = lambda *a: flash_attention(*a, seg, interpret=False, backend="mosaic",  # noqa
                                          fast_mma=fast)
        return jax.grad(lambda *a: jnp.sum(attn(*a).astype(jnp.float32)),
                        argnums=(0, 1, 2))(q, k, v)
    with gpu_kernels.mosaic_dump(tmp_path):
        text = jax.jit(fwd_bwd).lower(q, k, v, segment_ids).compile().as_text()
    assert gpu_kernels.mosaic_kernel_names(text) == MOSAIC_KERNELS
    kernels = gpu_kernels.mosaic_kernels(tmp_path, MOSAIC_KERNELS)
    assert {x.name for x in kernels} == MOSAIC_KERNELS
    assert_fit(kernels)


def test_cudnn_with_packed_documents_carries_the_document_mask(h100):
    """MaxText #4476 found a cuDNN path that dropped segment ids. Ours never passes any: the
    compiled forward and backward cuDNN calls both take the [B, 1, S, S] document mask (as a
    bias), which tests/test_attention.py checks against the reference on jax's XLA path."""
    from jaxtrain.model import attention
    sh = SingleDeviceSharding(h100(1)[0])
    b, s = 2, 1024
    q = jax.ShapeDtypeStruct((b, s, 8, 128), jnp.bfloat16, sharding=sh)
    kv = jax.ShapeDtypeStruct((b, s, 2, 128), jnp.bfloat16, sharding=sh)
    seg = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=sh)
    grads = lambda q, k, v, seg: jax.grad(lambda *a: jnp.sum(attention.cudnn_attention(  # noqa
        *a, seg).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
    text = jax.jit(grads).lower(q, kv, kv, seg).compile().as_text()
    calls = [line for line in text.splitlines() if CUDNN_TARGET.search(line)]
    assert len(calls) == 2
    for line in calls:
        operands = line.split("operand_layout_constraints={", 1)[1].split("}, api_version")[0]
        assert f"bf16[{b},1,{s},{s}]" in operands, operands




@pytest.mark.parametrize("impl, family", [("pallas", "Pallas flash attention (jaxtrain)"),
                                          ("cudnn", "cuDNN attention")])
def test_the_mfu_breakdown_tells_attention_kernels_in_a_gpu_program(h100, impl, family):
    """What the breakdown reads of an H100 program's HLO (jaxtrain.tools.profile_trace): the
    attention custom calls are attention (their own line under kernel efficiency), not GEMMs,
    and the GEMMs are known by their FLOPs."""
    from jaxtrain.tools import kernel_classes, profile_trace
    ops = profile_trace.hlo_ops(compile_tiny(h100, f"--model.attention={impl}", n=1).text)
    calls = [o for o in ops.values() if o.opcode == "custom-call" and o.kernel]
    attention = {kernel_classes.classify(o.kernel).family for o in calls
                 if kernel_classes.classify(o.kernel).cls == "attention"}
    assert attention == {family}
    assert not any(o.gemm_flops for o in calls
                   if kernel_classes.classify(o.kernel).cls == "attention")
    assert sum(o.gemm_flops > 0 for o in ops.values()) >= 4

