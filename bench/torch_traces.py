"""Two-rank torch.profiler traces with known MFU terms, to check jaxtrain's MFU breakdown on.

    python bench/torch_traces.py OUT_DIR      # writes OUT_DIR/<scenario>/{rank0,rank1}.json,
                                              # config.json and truth.json

A small discrete-event model of a torchrun job on one node (rank r on GPU r) runs an SPMD
program step by step: a host thread per rank that launches kernels (and waits in its
DataLoader, and syncs on the loss), a compute stream and an NCCL stream per GPU (NCCL ends a
collective on the ranks up to 12 µs apart; in the two-node scenario rank 1's host clock reads
3.7 ms ahead of rank 0's), FSDP2-style
all-gathers prefetched one layer ahead and reduce-scatters after each layer's backward, a loss
all-reduce, the optimizer, and, per scenario, torch.utils.checkpoint's replay (non-reentrant:
the layer's forward replayed inside its first backward node) or an expert-parallel all-to-all.
A collective starts on each rank when that rank's stream reaches it and moves data only once
the last rank has arrived, so its end is the same on both.

The export is what torch.profiler writes (Kineto's Chrome trace): `distributedInfo` with the
rank, world size and process groups; ProfilerStep#N and the DataLoader on the main thread;
backward ops on the autograd thread under `autograd::engine::evaluate_function: ...` nodes with
`Sequence number` / `Fwd thread id`; launches (cudaLaunchKernel, cudaMemcpyAsync, cuLaunchKernel
for Triton) and kernels linked by `correlation` and ac2g flow events; record_param_comms with the
collective's name, process group and ranks (on the NCCL kernel too, except where a scenario
drops it, as some torch versions do); Memcpy HtoD of the batch and DtoH of the loss.

The truth is the model's own schedule: every instant of a rank's step window (the end of its
previous step's device work to the end of its own) is charged by what the model knows it was:
a kernel of a given role (GEMM, attention, non-GEMM, memory copy; replayed forward =
recompute), or, with compute idle, a collective before its last peer arrived (stragglers,
with the cause the scenario planted) or after (exposed communication, on the axis of its
process group), the batch's copy or the host in its DataLoader (data wait), or nothing
(launch overhead). The model, its truth and the export are bench/torch_trace_model.py;
bench/mfu_torch_check.py runs the breakdown on these files and prints each term's error
against this truth.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import sys

GEMM_FWD = "nvjet_tst_192x192_64x4_1x2_h_bz_coopB_TNT"
GEMM_DGRAD = "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT"
GEMM_WGRAD = ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_nt_n_tilesize128x128x64_warpgroupsize1x1x1_"
              "execute_segment_k_off_kernel__5x_cublas")
FLASH_FWD = ("void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<128, "
             "128, 64, 4, false, false, cutlass::bfloat16_t>, false, true, false, false, true, "
             "true, false, false>(pytorch_flash::Flash_fwd_params)")
FLASH_BWD = ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<pytorch_flash::"
             "Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, false, cutlass::"
             "bfloat16_t>, true, false, false, false, false, true, false>(pytorch_flash::"
             "Flash_bwd_params)")
FLASH_DOT_DO_O = ("void pytorch_flash::flash_bwd_dot_do_o_kernel<true, pytorch_flash::"
                  "Flash_bwd_kernel_traits<128, 64, 128, 8>>(pytorch_flash::Flash_bwd_params)")
FLASH_CONVERT_DQ = ("void pytorch_flash::flash_bwd_convert_dq_kernel<pytorch_flash::"
                    "Flash_bwd_kernel_traits<128, 64, 128, 8>>(pytorch_flash::Flash_bwd_params, "
                    "int)")
NORM = "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0"
SILU = "triton_poi_fused_mul_silu_1"
ELEMENTWISE = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10"
               "::BFloat16>, at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::"
               "BFloat16>, at::detail::Array<char*, 3>)")
ADAM = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous"
        " namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunc"
        "tor<float, 4>, float*, double, double, double, double, double, double, bool, bool>")
GRAD_NORM = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anony"
             "mous namespace)::TensorListMetadata<1>, at::native::(anonymous namespace)::LpNormFu"
             "nctor<float, 2>, float*>")
NCCL = {"all_gather_into_tensor": "ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, "
                                  "ncclWork*)",
        "reduce_scatter_tensor": "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevComm*, "
                                 "unsigned long, ncclWork*)",
        "allreduce": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, "
                     "ncclWork*)",
        "all_to_allv": "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)"}
ROLE_OF = {GEMM_FWD: "gemm", GEMM_DGRAD: "gemm", GEMM_WGRAD: "gemm", FLASH_FWD: "attention",
           FLASH_BWD: "attention", FLASH_DOT_DO_O: "non_gemm", FLASH_CONVERT_DQ: "non_gemm",
           NORM: "non_gemm", SILU: "non_gemm", ELEMENTWISE: "non_gemm", ADAM: "non_gemm",
           GRAD_NORM: "non_gemm"}


@dataclasses.dataclass
class Op:
    """One device op of the SPMD program (or host work: `host`)."""
    name: str
    us: float = 0.0                  # device duration, µs (before the rank's slow factor)
    role: str = ""                   # gemm | attention | non_gemm | h2d | memcpy | comm
    stack: tuple = ()                # (op name, args, instance id) around its launch
    thread: str = "main"             # main | autograd
    recompute: bool = False
    wait: str = ""                   # tag of an op whose end it waits on
    tag: str = ""
    comm: dict | None = None         # {"name", "pg", "desc", "ranks", "axis", "transfer_us"}
    pg_on_kernel: bool = True        # the kernel event carries the process-group metadata
    host: str = ""                   # host work instead: "data" | "sync"
    api: str = "cudaLaunchKernel"
    host_us: float = 7.0             # the host's cost of launching it


@dataclasses.dataclass
class Scenario:
    name: str
    layers: int = 4
    recompute: bool = False          # full activation checkpointing
    moe: bool = False                # an expert-parallel all-to-all around each MLP
    bwd_slowdown: float = 1.0        # backward GEMMs' time per FLOP over the forward's
    data_ms: dict = dataclasses.field(default_factory=dict)   # (rank, step) -> DataLoader ms
    slow: dict = dataclasses.field(default_factory=dict)      # (rank, step) -> compute factor
    causes: dict = dataclasses.field(default_factory=dict)    # step -> the planted cause
    config: dict = dataclasses.field(default_factory=dict)    # parallel.* of the job
    steps: int = 4
    nodes: int = 1                   # 2: rank 1 on another host, its clock 3.7 ms ahead


SCENARIOS = [
    Scenario("fsdp_full_recompute", recompute=True, config={"fsdp": 2, "data": 1},
             data_ms={(1, 2): 7.0}, slow={(0, 3): 1.25},
             causes={2: "data_wait", 3: "kernel_efficiency"}),
    Scenario("remat_none_slow_backward", bwd_slowdown=1.6, config={"fsdp": 2, "data": 1},
             slow={(1, 2): 1.15}, causes={2: "kernel_efficiency"}),
    Scenario("moe_all_to_all", moe=True, config={"fsdp": 1, "data": 2},
             data_ms={(0, 3): 5.0}, causes={3: "data_wait"}),
    Scenario("fsdp_two_nodes", recompute=True, config={"fsdp": 2, "data": 1}, nodes=2,
             slow={(1, 2): 1.2}, data_ms={(0, 3): 4.0},
             causes={2: "kernel_efficiency", 3: "data_wait"}),
]
CLOCK_AHEAD_US = 3700.0
DEFAULT_DATA_MS = 0.6
TRANSFER_US = {"all_gather_into_tensor": 900.0, "reduce_scatter_tensor": 1100.0,
               "allreduce": 40.0, "all_to_allv": 450.0}


# ----------------------------------------------------------------------------- the program

_ids = itertools.count(1)


def _op(name, args=None):
    return (name, args or {}, next(_ids))


def program(sc: Scenario, step: int) -> list[Op]:
    """One step's SPMD program, in the order the host issues it."""
    seq = itertools.count(1000 * step)
    dims = {"Input Dims": [[8192, 4096], [4096, 4096]], "Input type": ["c10::BFloat16"] * 2}
    out = [Op("DataLoader", host="data"),
           Op("Memcpy HtoD (Pinned -> Device)", 300.0, "h2d", (_op("aten::to"), _op(
               "aten::_to_copy"), _op("aten::copy_")), api="cudaMemcpyAsync")]
    fsdp = sc.config.get("fsdp", 1) > 1
    group = {"pg": "0", "desc": "default_pg", "ranks": [0, 1],
             "axis": "fsdp" if fsdp else "data"}

    def comm(name, tag="", wait="", thread="main", pg=None, stack=()):
        g = pg or group
        args = {"Collective name": name, "In msg nelems": 33554432, "Out msg nelems": 33554432,
                "Group size": 2, "dtype": "BFloat16", "Process Group Name": g["pg"],
                "Process Group Description": g["desc"], "Process Group Ranks": str(g["ranks"])}
        return Op(NCCL[name], 0.0, "comm", stack + (_op("record_param_comms", args),
                                                     _op(f"nccl:{name}")), thread, tag=tag,
                  wait=wait, comm={**g, "name": name, "transfer_us": TRANSFER_US[name]},
                  pg_on_kernel=not sc.moe)

    def forward(i, replay_of=None):
        """Layer i's forward kernels; replay_of: the backward node op it replays inside."""
        thread = "autograd" if replay_of else "main"
        base = (replay_of,) if replay_of else ()
        ops = []
        for kernel, us, name in ((NORM, 60, "aten::rms_norm"), (GEMM_FWD, 420, "aten::linear"),
                                 (FLASH_FWD, 520, "aten::scaled_dot_product_attention"),
                                 (GEMM_FWD, 140, "aten::linear"),
                                 (ELEMENTWISE, 45, "aten::add"),
                                 (NORM, 60, "aten::rms_norm"), (GEMM_FWD, 560, "aten::linear"),
                                 (SILU, 70, "CompiledFunction"), (GEMM_FWD, 280, "aten::linear")):
            stack = base + (_op(name, {"Sequence number": next(seq), "Fwd thread id": 0,
                                       **(dims if kernel == GEMM_FWD else {})}),)
            if kernel == GEMM_FWD:
                stack += (_op("aten::mm", dims),)
            ops.append(Op(kernel, us, ROLE_OF[kernel], stack, thread, recompute=bool(replay_of),
                          api="cuLaunchKernel" if kernel in (NORM, SILU) else "cudaLaunchKernel"))
        ops[0].wait = f"ag{'b' if replay_of else 'f'}{i}"
        return ops

    for i in range(sc.layers):   # forward, each layer's parameters gathered one layer ahead
        if i == 0:
            out.append(comm("all_gather_into_tensor", tag="agf0",
                            stack=(_op("FSDP::pre_forward"),)))
        if i + 1 < sc.layers:
            out.append(comm("all_gather_into_tensor", tag=f"agf{i + 1}",
                            stack=(_op("FSDP::pre_forward"),)))
        layer = forward(i)
        if sc.moe:   # the MLP's tokens go to their experts' ranks and back
            ep = {"pg": "1", "desc": "mesh_ep", "ranks": [0, 1], "axis": "expert"}
            layer[5].tag, layer[8].tag = f"norm{i}", f"down{i}"
            layer[6].wait = f"disp{i}"
            layer[6:6] = [comm("all_to_allv", tag=f"disp{i}", wait=f"norm{i}", pg=ep)]
            layer += [comm("all_to_allv", tag=f"comb{i}", wait=f"down{i}", pg=ep),
                      Op(ELEMENTWISE, 45, "non_gemm", (_op("aten::add"),), wait=f"comb{i}")]
        out += layer
    out += [Op(GEMM_FWD, 900, "gemm", (_op("aten::linear", {"Sequence number": next(seq)}),)),
            Op(ELEMENTWISE, 150, "non_gemm", (_op("aten::cross_entropy_loss"),))]
    for i in reversed(range(sc.layers)):
        if i == sc.layers - 1:
            out.append(comm("all_gather_into_tensor", tag=f"agb{i}", thread="autograd",
                            stack=(_op("FSDP::pre_backward"),)))
        if i > 0:
            out.append(comm("all_gather_into_tensor", tag=f"agb{i - 1}", thread="autograd",
                            stack=(_op("FSDP::pre_backward"),)))
        node = _op("autograd::engine::evaluate_function: MmBackward0")
        node_op = _op("MmBackward0", {"Sequence number": 1000 * step + i, "Fwd thread id": 1})
        ops = forward(i, replay_of=node) if sc.recompute else []
        for op in ops:   # the replay runs inside the first backward node's own op
            op.stack = (node, node_op) + op.stack[1:]
        if ops:
            ops[0].wait = f"agb{i}"
        bwd = [(GEMM_DGRAD, 280), (GEMM_WGRAD, 280), (SILU, 140), (GEMM_DGRAD, 560),
               (GEMM_WGRAD, 560), (NORM, 120), (ELEMENTWISE, 45), (GEMM_DGRAD, 140),
               (GEMM_WGRAD, 140), (FLASH_DOT_DO_O, 60), (FLASH_BWD, 1300), (FLASH_CONVERT_DQ, 40),
               (GEMM_DGRAD, 420), (GEMM_WGRAD, 420), (NORM, 120)]
        for k, (kernel, us) in enumerate(bwd):
            gemm = ROLE_OF[kernel] == "gemm"
            if k and (not gemm or kernel == GEMM_DGRAD):   # a new backward node
                name = "MmBackward0" if gemm else f"Backward{k}"
                node = _op(f"autograd::engine::evaluate_function: {name}")
                node_op = _op(name, {"Sequence number": 1000 * step + 100 * i + k,
                                     "Fwd thread id": 1})
            stack = (node, node_op) + ((_op("aten::mm", {"Input Dims": [[4096, 8192], [
                8192, 4096]]}),) if gemm else ())
            ops.append(Op(kernel, us * (sc.bwd_slowdown if gemm else 1.0), ROLE_OF[kernel],
                          stack, "autograd", wait=f"agb{i}" if not ops else ""))
        ops[-1].tag = f"grad{i}"
        out += ops
        out.append(comm("reduce_scatter_tensor", wait=f"grad{i}", thread="autograd",
                        stack=(_op("FSDP::post_backward_reduce"),), tag=f"rs{i}"))
    out.append(comm("allreduce", tag="loss", wait="rs0"))
    out += [Op(GRAD_NORM, 9.0, "non_gemm", (_op("aten::_foreach_norm"),),
               wait="rs0" if k == 0 else "", host_us=28.0)
            for k in range(24)]   # gradient clipping, one small kernel per tensor: launch-bound
    out += [Op(ADAM, 350, "non_gemm", (_op("Optimizer.step#AdamW.step"),), wait="rs0")
            for _ in range(3)]
    out += [Op("Memcpy DtoH (Device -> Pageable)", 5.0, "memcpy", (_op("aten::item"), _op(
        "aten::_local_scalar_dense")), wait="loss", api="cudaMemcpyAsync", tag="item"),
            Op("item", host="sync", wait="item")]
    return out


def write(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Every scenario's traces, config.json and truth.json under out_dir."""
    root = pathlib.Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    import dataclasses as dc

    import torch_trace_model as model   # it runs this module's program
    from jaxtrain.config import load_config
    from jaxtrain.ledger.flops import (attention_flops_per_token, model_flops_per_token,
                                       tokens_per_step)
    written = []
    for seed, sc in enumerate(SCENARIOS):
        folder = out_dir / sc.name
        folder.mkdir(parents=True, exist_ok=True)
        cfg = load_config(str(root / "configs" / "tiny.py"), [f"--parallel.{k}={v}" for k, v in
                                              sc.config.items()] +
                          (["--remat.granularity=full", "--remat.num_layers=1"]
                           if sc.recompute else []))
        ideal_s = 0.020   # the peak that makes T_ideal 20 ms on 2 devices
        flops = model_flops_per_token(cfg) * tokens_per_step(cfg) / 2
        cfg = dc.replace(cfg, train=dc.replace(cfg.train, peak_tflops=flops / ideal_s / 1e12))
        attention_s = ideal_s * attention_flops_per_token(cfg.model, cfg.train.seq_len) / (
            model_flops_per_token(cfg))
        (folder / "config.json").write_text(cfg.to_json())
        runs, spans, marks = model.simulate(sc, seed)
        known = {}
        for r in runs:
            trace = model.export(sc, r, runs[r], spans[r], marks[r])
            if sc.nodes > 1 and r == 1:
                trace["host_name"] = "node1"
                trace = model.shift(trace, CLOCK_AHEAD_US)
            (folder / f"rank{r}.json").write_text(json.dumps(trace))
            known[r] = model.truth(sc, runs[r], spans[r], ideal_s, attention_s)
        (folder / "truth.json").write_text(json.dumps({"ideal_s": ideal_s, "ranks": known},
                                                      indent=1))
        written.append(folder)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.split("\n\n")[1])
    for folder in write(pathlib.Path(sys.argv[1])):
        print(folder)
