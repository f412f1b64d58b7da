"""The real XLA:GPU compiler on compile-only H100s (jaxtrain.tools.targets): what a GPU would run.

Nothing executes. These read what only the GPU program has: which attention kernel runs at
every pipeline depth, cuBLASLt FP8 GEMMs and their result types, each Pallas kernel's
registers, spills and shared memory, async collectives, and the compiled memory against the
ledger (which is calibrated here, not on XLA:CPU). Run with `-m gpu_compile` after installing
the gpu-compile extra (README's third command).
"""
import json
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jaxtrain.model import fp8_matmul, moe
from jaxtrain.model import llama as model_lib
from jaxtrain.parallel import sharding
from jaxtrain.tools import gpu_kernels, gpu_program, hlo, hlo_module, pipeline_flops
from jaxtrain.tools.compile_step import compile_step
from jaxtrain.config import Fp8Config, ModelConfig, MoeConfig, load_config
from jaxtrain.ledger import comm, estimate, layout_from_config
from jaxtrain.ledger.memory import workspace_bytes
from jaxtrain.model.kernels import flash_attention
from jaxtrain.model.kernels import grouped_matmul as gm
from jaxtrain.model.kernels import grouped_matmul_kernels as gmk
from util import tiny_config

pytestmark = pytest.mark.gpu_compile

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


def _compile(h100, *overrides, n=8, options=None, mosaic_dump=None):
    cfg = tiny_config(*BF16, *overrides)
    with gpu_kernels.mosaic_dump(mosaic_dump):
        return compile_step(cfg, sharding.make_mesh(cfg.parallel, h100(n)),
                            extra_options=options)


def _assert_fit(kernels):
    """Every kernel within an H100 block's shared memory, 255 registers, without spills."""
    for x in kernels:
        assert x.shared_memory <= H100_SMEM_PER_BLOCK, x
        assert x.registers is not None and x.registers <= 255 and not x.spills, x


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
    out = _compile(h100, f"--model.attention={impl}", *layout, *CONTEXT[context], *cp,
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
        _assert_fit(kernels)


def test_collectives_of_a_gpu_program_are_read_per_mesh_axis(h100):
    """hlo reads GPU programs: async start/done pairs count once, combined (tuple) operands,
    reduce-scatters, and the mesh-style replica groups of compile-only devices."""
    out = _compile(h100, "--model.attention=xla", *LAYOUTS[1])
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
    out = _compile(h100, *FP8, "--parallel.data=2", "--parallel.tensor=2", n=4,
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
    out = _compile(h100, *FP8, "--parallel.data=2", "--parallel.tensor=2", n=4,
                   options=NO_TRITON_GEMM)
    gemms = gpu_program.fp8_gemm_scales(out.text)
    assert len(gemms) == 21, gemms  # 7 projections x forward, dgrad, wgrad in the layer loop
    for g in gemms:
        assert g.result == "bf16" and len(g.scales) == 2, g
        assert all("f32" in types and "bf16" not in types for types in g.scales), g


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
    _assert_fit(kernels)


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


# ----------------------------------------------------------------------------- the ledger

RECIPES = {
    # (recipe, devices, overrides): the ledger plans what was compiled
    "llama70b_tp8_sp_fsdp8": ("configs/llama70b.py", 64, [
        "--parallel.stage=1", "--parallel.virtual_stages=1", "--parallel.schedule=1f1b",
        "--parallel.fsdp=8", "--parallel.data=1", "--parallel.zero1=false",
        "--train.global_batch=64"]),
    # the recipe's per-device shapes (micro-batch 1, 8 microbatches) on 128 devices: data 8
    "llama70b_pipelined": ("configs/llama70b.py", 128, ["--train.global_batch=64"]),
    "llama3_8b": ("configs/llama3_8b.py", 8, []),
    "llama3_8b_128k": ("configs/llama3_8b_128k.py", 8, []),   # context 4, ring, full remat
    "llama405b": ("configs/llama405b.py", 1024, []),   # PP8 uneven, full remat, data 16
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_compiled_memory_is_the_ledgers(h100, tmp_path, name):
    """memory_analysis() of the step compiled for H100s within 10% of the ledger's total less
    its cuBLAS/NCCL workspace (which a static buffer assignment never holds); the step's
    attention is the Mosaic GPU kernel (`auto`), within the H100's limits."""
    path, n, overrides = RECIPES[name]
    cfg = load_config(path, overrides)
    out = _compile_recipe(h100, cfg, n, tmp_path)
    compiled = hlo.memory(out.compiled)["total_bytes"]
    est = estimate(cfg, layout_from_config(cfg, n), "h100")
    ledger = est.total_bytes - workspace_bytes(cfg)
    assert abs(compiled / ledger - 1) <= 0.10, (compiled / 2**30, ledger / 2**30)


# Each recipe at a depth that keeps its layout (stages, virtual stages, uneven ends) and
# compiles in about a minute here
RECIPE_SLICES = {"llama70b_tp8_sp_fsdp8": ["--model.num_layers=8"],
                 "llama70b_pipelined": ["--model.num_layers=16"],
                 "llama3_8b": ["--model.num_layers=4"],
                 "llama3_8b_128k": ["--model.num_layers=4"],
                 "llama405b": ["--model.num_layers=22", "--parallel.first_stage_layers=2",
                               "--parallel.last_stage_layers=2"]}


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_dry_run_reads_each_recipe_like_for_like(h100, name):
    """On every recipe (depth-sliced), the dry run's headline rows agree with the ledger: the
    matmul FLOPs a device executes and every mesh axis's wire bytes within 10%, no axis
    left with an unexplained difference."""
    from jaxtrain.tools import dry_run, dry_run_report
    path, n, overrides = RECIPES[name]
    r = dry_run.dry_run(load_config(path, overrides + RECIPE_SLICES[name]), target="h100",
                        devices=n, config_name=name)
    assert not r.changes, r.changes
    e = r.estimate
    flops_off = r.executed.mean / (e.hfu_flops_per_step_full_attn / e.n_devices) - 1
    comm = r.comm_by_axes()
    assert abs(flops_off) <= 0.10, flops_off
    assert all(row.off is not None and abs(row.off) <= 0.10 for row in comm.values()), comm
    assert not dry_run_report.axis_causes(r)


def _compile_recipe(h100, cfg, n, dump):
    """A recipe's step for n H100s; its Mosaic attention kernels checked from the dump."""
    with gpu_kernels.mosaic_dump(dump):
        out = compile_step(cfg, sharding.make_mesh(cfg.parallel, h100(n)))
    names = gpu_kernels.mosaic_kernel_names(out.text)
    assert names == MOSAIC_KERNELS, names
    _assert_fit(gpu_kernels.mosaic_kernels(dump, names))
    return out


# A model whose layer stack outweighs everything else: 4 layers of 16.8M parameters (bf16:
# a 128 MiB stack gradient), microbatches of 2 x 128 tokens.
STACK = ("--model.hidden_size=1024", "--model.num_layers=4", "--model.num_heads=8",
         "--model.num_kv_heads=8", "--model.mlp_size=4096", "--train.seq_len=128",
         "--model.max_seq_len=128", "--train.global_batch=8", "--parallel.data=2",
         "--parallel.microbatches=4")


def test_fused_accumulation_holds_no_bf16_stack_gradient(h100, monkeypatch):
    """Each layer's gradient goes into the fp32 accumulator as the backward makes it: the
    compiled step holds none of the stack's bf16 gradient but one layer's, as the ledger
    prices it; the unfused step (each microbatch's gradients added after its backward) holds
    the whole of it. Measured: a 128 MiB stack gradient; 1257 MiB fused, 1346 MiB unfused (88
    MiB less; one layer's 32 MiB in flight), ledger 1223 MiB."""
    import functools
    from jaxtrain.executors import replica
    cfg = tiny_config(*BF16, *STACK)
    mesh = sharding.make_mesh(cfg.parallel, h100(2))
    fused = hlo.memory(compile_step(cfg, mesh).compiled)["total_bytes"]
    monkeypatch.setattr(replica, "grad_sums", functools.partial(replica.grad_sums, fuse=False))
    added = hlo.memory(compile_step(cfg, mesh).compiled)["total_bytes"]
    est = estimate(cfg, layout_from_config(cfg, 2), "h100")
    layer = est.static_breakdown["gradients"]             # one layer's bf16 gradient
    stack = layer * cfg.model.num_layers
    assert added - fused >= 0.9 * (stack - layer), ((added - fused) / 2**20, stack / 2**20)
    ledger = est.total_bytes - workspace_bytes(cfg)
    assert abs(fused / ledger - 1) <= 0.10, (fused / 2**20, ledger / 2**20)


# ----------------------------------------------------------------------------- the dry run

def test_dry_run_for_h100_reports_the_gpu_program_as_text_and_json(capsys, h100):
    from test_dry_run import TINY, train_main
    assert train_main(["--config", TINY, "--dry-run", "--target", "h100", "--devices", "8",
                       "--parallel.data=2", "--parallel.fsdp=2", "--parallel.tensor=2",
                       "--model.compute_dtype=bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "dry run on 8 x H100 SXM5 80GB" in out and "GPU program" in out
    assert "static overlap" in out and "jaxtrain_mosaic_flash_fwd" in out and ": fits" in out
    assert "attention core: mosaic (auto: jax" in out  # which kernel, and why
    assert train_main(["--config", TINY, "--dry-run", "--target", "h100", "--devices", "8",
                       "--parallel.fsdp=8", "--parallel.data=1", "--json",
                       "--model.compute_dtype=bfloat16"]) == 0
    report = json.loads(capsys.readouterr().out)
    gpu = report["gpu"]
    assert report["devices"] == 8 and gpu["fits"] is True
    assert {k["name"] for k in gpu["kernels"]} == MOSAIC_KERNELS
    assert all(k["spill_stores"] == 0 for k in gpu["kernels"])
    assert report["attention"]["core"] == "mosaic"
    assert any(o["axes"] == ["fsdp"] and o["wire_bytes"] > 0 for o in gpu["overlap"])
    assert gpu["xla_options"]["xla_gpu_enable_pipelined_all_gather"] is True
    assert report["compiled"]["memory"]["total_bytes"] > 0
    # static state per term: the H100 program's state arguments against the ledger's
    ledger_terms, compiled_terms = report["ledger"]["static_terms"], report["compiled"][
        "state_terms"]
    for term in ("master", "moments"):
        assert compiled_terms[term] == pytest.approx(ledger_terms[term], rel=0.01), term


def test_a_layout_that_does_not_fit_is_compiled_and_says_by_how_much(capsys, h100):
    from test_dry_run import train_main
    assert train_main(["--config", "configs/llama70b.py", "--dry-run", "--target", "h100",
                       "--devices", "64", "--parallel.stage=1", "--parallel.virtual_stages=1",
                       "--parallel.schedule=1f1b", "--parallel.fsdp=8", "--parallel.data=1",
                       "--parallel.zero1=false"]) == 0  # micro-batch 8: ~5x a device
    out = capsys.readouterr().out
    assert re.search(r"DOES NOT FIT: [\d.]+ GiB over", out), out[-800:]


# ----------------------------------------------------------------------------- the pipeline

def _executed(out):
    s = out.setup.cfg.parallel
    from jaxtrain.ledger.pipeline_schedule import build_schedule
    table = build_schedule(s.schedule, out.mesh.shape["stage"], s.microbatches,
                           s.virtual_stages).table
    return pipeline_flops.executed_matmul_flops(out.text, table.columns, out.mesh.shape["stage"],
                                                s.virtual_stages)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_pipelined_step_executes_the_unpipelined_steps_matmuls(h100, schedule, v):
    """Without recompute a pipelined device runs the matmuls of the unpipelined step's device
    (same model, batch and device count) within 3%: an F stashes what its B needs and each
    rank runs only its own ops. Counting every branch of every table step, as the HLO reader
    does, gives several times that."""
    layout = ("--parallel.tensor=2", "--model.attention=xla", "--model.num_layers=4")
    piped = _compile(h100, *layout, "--parallel.stage=2", "--parallel.data=2",
                     f"--parallel.schedule={schedule}", f"--parallel.virtual_stages={v}",
                     "--parallel.microbatches=4")
    flat = _compile(h100, *layout, "--parallel.data=4", "--parallel.microbatches=4")
    executed, reference = _executed(piped), hlo.matmul_flops_from_text(flat.text)
    assert 0.97 <= executed.mean / reference <= 1.03, (executed, reference)
    assert executed.every_branch > 2 * executed.max


def test_1f1b_compiled_memory_does_not_grow_with_microbatches(h100):
    """1F1B's stash is fixed by the stages: from 8 to 32 microbatches of the same size the
    compiled step's memory grows by the token buffers only (each rank holds 2(p-1-r) stashed
    residual sets whatever m). GPipe's grows by a residual set per microbatch."""
    mem = {}
    for kind in ("1f1b", "gpipe"):
        for m in (8, 32):
            out = _compile(h100, "--parallel.stage=4", "--parallel.data=2",
                           f"--parallel.schedule={kind}", f"--parallel.microbatches={m}",
                           f"--train.global_batch={2 * m}", "--model.num_layers=4")
            mem[kind, m] = hlo.memory(out.compiled)["total_bytes"]
    growth = {k: (mem[k, 32] - mem[k, 8]) / 24 for k in ("1f1b", "gpipe")}
    assert growth["1f1b"] < 0.05 * growth["gpipe"], (mem, growth)
    assert mem["1f1b", 32] < 1.02 * mem["1f1b", 8], mem


# the Mosaic kernels' head size 128; TP with SP, FSDP and data
ATTENTION_SHAPES = ("--train.seq_len=256", "--model.max_seq_len=256", "--model.hidden_size=256",
                    "--model.num_heads=2", *LAYOUTS[1])


@pytest.mark.parametrize("impl", ["pallas", "mosaic", "cudnn"])
def test_attention_kernels_count_as_the_dense_attentions_matmuls(h100, impl):
    """A step whose attention runs in a kernel executes, as the dry run counts it, the matmul
    FLOPs of the same step on XLA's attention (dots over the full square): each kernel call
    counts as the dense attention's matmuls it stands for (measured: equal to the FLOP)."""
    kernel = _compile(h100, f"--model.attention={impl}", *ATTENTION_SHAPES)
    dense = _compile(h100, "--model.attention=xla", *ATTENTION_SHAPES)
    counted = pipeline_flops.executed_matmul_flops(kernel.text, None).mean
    assert counted == pytest.approx(hlo.matmul_flops_from_text(dense.text), rel=1e-9)
    assert counted > 1.2 * hlo.matmul_flops_from_text(kernel.text)   # the kernels' share


# ----------------------------------------------------------------------------- context

def _float_share(shape: str) -> float:
    """The floating-point part of a collective's (tuple) shape: K/V and their gradients, not
    the int32 segment ids and positions the combiner packs in with them."""
    arrays = re.findall(r"\b[a-z]+\d*\[[\d,]*\]", shape)
    total = sum(hlo_module.shape_bytes(a) for a in arrays)
    return sum(hlo_module.shape_bytes(a) for a in arrays if not a.startswith(("s32", "u32"))) / total


CP = ("--model.attention=pallas", "--parallel.data=2", "--parallel.context=4",
      "--parallel.microbatches=2", "--train.seq_len=128", "--model.max_seq_len=128")


@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_context_collectives_match_the_ledger_and_the_ring_hides_every_hop(h100, strategy,
                                                                           remat):
    """Over `context`, the K/V (and dK/dV) bytes of the GPU program are the ledger's, with full
    recompute too (whose re-run forward shares its first hop, or its whole gather, with the
    backward); the ring's permutes are async start/done pairs with a Pallas attention block
    scheduled between every start and its done, in the forward and the backward loop."""
    remat_args = ["--remat.granularity=full", "--remat.num_layers=1"] if remat == "full" else []
    cfg = tiny_config(*BF16, *CP, f"--parallel.context_strategy={strategy}", *remat_args)
    out = compile_step(cfg, sharding.make_mesh(cfg.parallel, h100(8)))
    acs = [a for a in gpu_program.async_collectives(out.text, out.mesh)
           if a.collective.axes == ("context",)]
    layout = layout_from_config(cfg, 8)
    passes = comm.layer_passes(layout, (cfg.model.num_layers,), None, float(remat == "full"))
    base = comm.layer_passes(layout, (cfg.model.num_layers,), None)
    want = comm.cp_bytes(cfg, layout, cfg.train.seq_len, passes, passes.forward - base.forward)
    got = sum(a.collective.wire_bytes_per_step * _float_share(a.collective.shape) for a in acs)
    assert got == pytest.approx(want, rel=1e-6)
    if strategy == "ring":
        hops = [a for a in acs if a.collective.in_loop and _float_share(a.collective.shape) > 0]
        assert hops and {a.collective.kind for a in hops} == {"collective-permute"}
        assert all(a.is_async and a.overlapped for a in hops), [
            (a.collective.op, a.overlapped) for a in hops]


def test_ring_attention_inside_pipeline_stages_compiles_for_h100(h100):
    """stage 2 x context 2 x data 2 with the ring (refused on XLA:CPU, which crashes running
    it): its hops are collective-permutes over `context` inside the executor's loop (the
    all-reduces there are the weight gradients GSPMD reduces over context, docs/design.md §9)."""
    out = _compile(h100, "--model.attention=pallas", "--parallel.stage=2", "--parallel.data=2",
                   "--parallel.context=2", "--parallel.context_strategy=ring",
                   "--parallel.microbatches=2", "--train.seq_len=128", "--model.max_seq_len=128")
    assert gpu_kernels.pallas_kernel_names(out.text) == FLASH_KERNELS
    kinds = {c.kind for c in hlo.collectives_from_text(out.text, out.mesh)
             if c.axes == ("context",) and c.in_loop}
    assert kinds == {"collective-permute", "all-reduce"}, kinds


def test_activation_memory_falls_with_the_context_degree(h100):
    """Llama 3 8B at 64K tokens (tensor 2 + SP) on 8 H100s: the compiled memory one more layer
    costs (4 layers minus 2, halved; the logits and head cancel) less the ledger's per-layer
    state is the ledger's per-layer activations, which context parallelism divides by c."""
    per_layer = {}
    for c in (1, 2, 4):
        compiled, ledger = {}, {}
        for layers in (2, 4):
            cfg = load_config("configs/llama3_8b.py", [
                f"--model.num_layers={layers}", "--train.seq_len=65536",
                "--model.max_seq_len=65536", f"--parallel.context={c}",
                f"--parallel.data={4 // c}", "--parallel.microbatches=2",
                f"--train.global_batch={2 * (4 // c)}", "--parallel.context_strategy=ring"])
            out = compile_step(cfg, sharding.make_mesh(cfg.parallel, h100(8)))
            compiled[layers] = hlo.memory(out.compiled)["total_bytes"]
            ledger[layers] = estimate(cfg, layout_from_config(cfg, 8), "h100")
        layer_state = (ledger[4].static_bytes - ledger[2].static_bytes) / 2
        per_layer[c] = (compiled[4] - compiled[2]) / 2 - layer_state
        assert per_layer[c] == pytest.approx(ledger[4].activation_bytes_per_layer, rel=0.05)
    assert per_layer[1] / per_layer[2] == pytest.approx(2, rel=0.05)
    assert per_layer[1] / per_layer[4] == pytest.approx(4, rel=0.05)


def test_cudnn_runs_the_all_gather_strategy(h100):
    """cuDNN's fused attention (forward and backward) attends a context shard's queries to
    the gathered keys under an explicit causal/document mask."""
    cfg = tiny_config(*BF16, *CP, "--model.attention=cudnn")
    text = compile_step(cfg, sharding.make_mesh(cfg.parallel, h100(8))).text
    assert len(CUDNN_TARGET.findall(text)) == 2
    assert not gpu_kernels.pallas_kernel_names(text)


@pytest.mark.parametrize("impl, family", [("pallas", "Pallas flash attention (jaxtrain)"),
                                          ("cudnn", "cuDNN attention")])
def test_the_mfu_breakdown_tells_attention_kernels_in_a_gpu_program(h100, impl, family):
    """What the breakdown reads of an H100 program's HLO (jaxtrain.tools.profile_trace): the
    attention custom calls are attention (their own line under kernel efficiency), not GEMMs,
    and the GEMMs are known by their FLOPs."""
    from jaxtrain.tools import kernel_classes, profile_trace
    ops = profile_trace.hlo_ops(_compile(h100, f"--model.attention={impl}", n=1).text)
    calls = [o for o in ops.values() if o.opcode == "custom-call" and o.kernel]
    attention = {kernel_classes.classify(o.kernel).family for o in calls
                 if kernel_classes.classify(o.kernel).cls == "attention"}
    assert attention == {family}
    assert not any(o.gemm_flops for o in calls
                   if kernel_classes.classify(o.kernel).cls == "attention")
    assert sum(o.gemm_flops > 0 for o in ops.values()) >= 4

# ----------------------------------------------------------------------------- MoE

MIXTRAL_ROWS, MIXTRAL_D, MIXTRAL_F, MIXTRAL_E = 16384, 4096, 14336, 8  # 8k tokens x top-2


def test_grouped_matmul_kernels_fit_an_h100_at_mixtral_shapes(h100, tmp_path):
    """One Mixtral expert projection's forward, dX and dW (16k routed rows, 4096 x 14336,
    8 experts) compile to three Mosaic GPU kernels within the shared memory a block may use,
    without spills, and nothing else in the program multiplies or holds a transposed copy."""
    sh = SingleDeviceSharding(h100(1)[0])
    x = jax.ShapeDtypeStruct((MIXTRAL_ROWS, MIXTRAL_D), jnp.bfloat16, sharding=sh)
    w = jax.ShapeDtypeStruct((MIXTRAL_E, MIXTRAL_D, MIXTRAL_F), jnp.bfloat16, sharding=sh)
    sizes = jax.ShapeDtypeStruct((MIXTRAL_E,), jnp.int32, sharding=sh)

    def fwd_bwd(x, w, sizes):
        y, pull = jax.vjp(lambda a, b: gm.grouped_matmul(a, b, sizes), x, w)
        return y, pull(y)
    with gpu_kernels.mosaic_dump(tmp_path):
        compiled = jax.jit(fwd_bwd).lower(x, w, sizes).compile()
    text = compiled.as_text()
    assert text.count('custom_call_target="mosaic_gpu_v2"') == 3
    assert hlo.matmul_flops_from_text(text) == 0
    assert compiled.memory_analysis().temp_size_in_bytes < 2 ** 20
    names = gpu_kernels.mosaic_kernel_names(text)
    assert names == {gmk.PER_GROUP_KERNEL, gmk.ROWS_KERNEL}   # rows: forward and dX
    kernels = gpu_kernels.mosaic_kernels(tmp_path, names)   # the worst instance of each
    assert {k.name for k in kernels} == names
    for k in kernels:
        assert k.grid == (132, 1, 1) and k.threads == (128,), k
        assert 0 < k.shared_memory <= 232448, k
        assert k.registers is not None and k.registers <= 255 and not k.spills, k


def test_moe_layer_on_the_kernels_runs_no_expert_dense_gemm(h100):
    """lax.ragged_dot on XLA:GPU multiplies E times the grouped work (a dense GEMM over every
    expert, ../shared/notes/moe-and-mosaic-gpu-without-gpu.md); the layer on the kernels runs
    its experts as Mosaic GPU kernels (3 forward, 6 backward), and only the router is a GEMM;
    the executed count reads the kernels as the grouped work they do."""
    sh = SingleDeviceSharding(h100(1)[0])
    t, d, f, e, k = 2048, 512, 1024, 8, 2
    cfg = ModelConfig(hidden_size=d, compute_dtype="bfloat16", num_layers=1,
                      moe=MoeConfig(num_experts=e, top_k=k, mlp_size=f))
    grouped = 3 * 3 * 2 * (t * k) * d * f     # forward + 2 backward products, 3 projections
    router = 3 * 2 * t * d * e

    def compiled(grouped_dot):
        layer = nnx.eval_shape(lambda: moe.MoeLayer(cfg, model_lib.Ops(grouped_dot=grouped_dot),
                                                    nnx.Rngs(0)))
        graphdef, state = nnx.split(layer)
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), state)
        x = jax.ShapeDtypeStruct((1, t, d), jnp.bfloat16, sharding=sh)

        def loss(state, x):
            return jnp.sum(nnx.merge(graphdef, state)(x)[0].astype(jnp.float32) ** 2)
        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).compile().as_text()
    ragged, kernels = compiled(moe.ragged_dot), compiled(gm.grouped_matmul)
    assert hlo.matmul_flops_from_text(ragged) == pytest.approx(e * grouped + router, rel=0.01)
    assert hlo.matmul_flops_from_text(kernels) == pytest.approx(router, rel=0.01)
    assert kernels.count('custom_call_target="mosaic_gpu_v2"') == 9
    # as the dry run counts them (kernel_flops): every buffer row is routed on one device
    executed = pipeline_flops.executed_matmul_flops(kernels, None).mean
    assert executed == pytest.approx(grouped + router, rel=0.01)
