"""The MFU breakdown on torch.profiler traces of several ranks, built here with known terms:
ranks on their own GPUs, a peer late for a slow kernel or for its DataLoader, recompute from
autograd markers (and slow backward GEMMs that are not recompute), process groups on the
config's mesh axes, an expert-parallel all-to-all, kernel families by name, memory copies,
the job's device count from the config and distributedInfo, and the PNG's bars."""
import dataclasses
import json

import pytest

from jaxtrain.config import ParallelConfig
from jaxtrain.ledger.flops import model_flops_per_token, tokens_per_step
from jaxtrain.tools import kernel_classes, mfu_breakdown as mb, mfu_plot
from util import check_breakdown_sums, tiny_config

MS = 1000.0
IDEAL_MS = 10.0
STEP_MS = 40.0
FWD = (("aten::linear", {"Sequence number": 1, "Input Dims": [[64, 32], [48, 32], [48]]}),
       ("aten::addmm", {"Sequence number": 2, "Input Dims": [[48], [64, 32], [32, 48]]}))
BWD = (("autograd::engine::evaluate_function: AddmmBackward0", {}),
       ("AddmmBackward0", {"Sequence number": 2, "Fwd thread id": 1}),
       ("aten::mm", {"Input Dims": [[64, 48], [48, 32]]}))
REPLAY = BWD[:2] + tuple((n, {**a, "Sequence number": a["Sequence number"] + 10})
                         for n, a in FWD)   # torch.utils.checkpoint's replay inside the node
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>>"
ALLREDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
SENDRECV = "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)"


def comms(name, pg="0", desc="default_pg", ranks=(0, 1)):
    return (("record_param_comms", {"Collective name": name, "Process Group Name": pg,
                                    "Process Group Description": desc,
                                    "Process Group Ranks": str(list(ranks))}),
            (f"nccl:{name}", {}))


# One step of one rank, ms from its device start: (kernel, start, end, host stack, stream).
# [0, 10) forward GEMM  [10, 14) elementwise  [14, 30) backward GEMM  [30, 38) all-reduce,
# of which the last 2 ms move data; the next step starts 2 ms after it ends.
def base_step(bwd_ms=16.0, replay_ms=0.0, allreduce_end=38.0):
    b = 14 + bwd_ms
    out = [(GEMM, 0, 10, FWD, 7), (ELEMENTWISE, 10, 14, FWD[:1], 7), (GEMM, 14, b, BWD, 7)]
    if replay_ms:
        out.append((GEMM, b, b + replay_ms, REPLAY, 7))
        b += replay_ms
    # a collective ends on every peer at once: after the last one arrives, plus its transfer
    return out + [(ALLREDUCE, b, allreduce_end, comms("allreduce"), 20)]


class Rank:
    """torch.profiler's export for one rank: host ops on the main and autograd threads,
    launches with correlation ids, kernels on its GPU, ProfilerStep and DataLoader spans."""

    def __init__(self, rank, world=2, gpu=None, pgs=None):
        self.rank, self.gpu, self.ev, self.corr = rank, rank if gpu is None else gpu, [], 0
        self.info = {"distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world,
                                         "pg_config": pgs or [{"pg_name": "0", "pg_desc":
                                                               "default_pg", "ranks": [0, 1]}]},
                     "host_name": "node0", "record_shapes": 1}
        self.pid = 1000 + rank
        self.ev += [{"ph": "M", "pid": self.pid, "name": "process_name",
                     "args": {"name": "python"}},
                    {"ph": "M", "pid": self.gpu, "name": "process_name",
                     "args": {"name": f"GPU {self.gpu}"}}]

    def step(self, n, t0, kernels, data=None):
        """Step n's device work from t0 (ms), the DataLoader from data[0] to data[1] (default:
        the first of the 2 ms before t0, where the previous step ended)."""
        data = data or (t0 - 2.0, t0 - 1.0)
        self.host(f"ProfilerStep#{n}", min(data[0], t0 - 2.0) - 0.5, t0 + STEP_MS - 2.5,
                  cat="user_annotation")
        self.host("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", *data,
                  cat="user_annotation")
        for name, s, e, stack, stream, *cat in kernels:
            self.kernel(name, t0 + s, t0 + e, stack, stream, *cat)

    def host(self, name, s, e, cat="cpu_op", tid=1, args=None):
        self.ev.append({"ph": "X", "cat": cat, "name": name, "pid": self.pid, "tid": tid,
                        "ts": s * MS, "dur": (e - s) * MS, "args": args or {}})

    def kernel(self, name, s, e, stack=(), stream=7, cat="kernel"):
        self.corr += 1
        launch = s - 0.4   # the host launches it just before the GPU reaches it
        tid = 2 if any(n.startswith("autograd::") for n, _ in stack) else 1
        for depth, (op, args) in enumerate(stack):   # nested around the launch
            self.host(op, launch - 0.1 + 0.01 * depth, launch + 0.1 - 0.01 * depth, tid=tid,
                      args=args)
        api = "cudaLaunchKernel" if cat == "kernel" else "cudaMemcpyAsync"
        self.host(api, launch, launch + 0.005, cat="cuda_runtime", tid=tid,
                  args={"correlation": self.corr})
        self.ev.append({"ph": "X", "cat": cat, "name": name, "pid": self.gpu, "tid": stream,
                        "ts": s * MS, "dur": (e - s) * MS,
                        "args": {"device": self.gpu, "stream": stream,
                                 "correlation": self.corr}})

    def write(self, tmp_path):
        path = tmp_path / f"trace_r{self.rank}.json"
        path.write_text(json.dumps({"schemaVersion": 1, **self.info, "traceEvents": self.ev}))
        return path


def config(fsdp=2, data=1, expert=None, devices=2, ideal_ms=IDEAL_MS):
    cfg = tiny_config(f"--parallel.fsdp={fsdp}", f"--parallel.data={data}")
    if expert:   # the expert axis another issue adds to the config: accepted when it is there
        cls = dataclasses.make_dataclass("ParallelWithExperts", [("expert", int, expert)],
                                         bases=(ParallelConfig,))
        cfg = dataclasses.replace(cfg, parallel=cls(**dataclasses.asdict(cfg.parallel)))
    flops = model_flops_per_token(cfg) * tokens_per_step(cfg) / devices
    return dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, peak_tflops=flops / (ideal_ms / 1e3) / 1e12))


def build(tmp_path, per_rank, steps=3, gpus=(0, 1)):
    """per_rank[r](n) -> (device start of step n, its kernels[, its DataLoader span])."""
    files = []
    for r, gpu in enumerate(gpus):
        rank = Rank(r, gpu=gpu)
        for n in range(steps):
            rank.step(n, *per_rank[r](n))
        files.append(rank.write(tmp_path))
    return files


def regular(step_fn):
    return lambda n: (10 + n * STEP_MS, step_fn())


def later_steps(bd):
    return [s for s in bd.steps if s.step >= 1]   # step 0's window starts at its host marker


def within(got: dict, want: dict, step_s: float):
    """Every term within 1% of the step of its true size."""
    for k, v in want.items():
        assert got[k] is not None and abs(got[k] - v) <= 0.01 * step_s, (k, got[k], v)


def test_two_ranks_on_gpus_0_and_1_find_the_straggler(tmp_path):
    """Rank 1 on GPU 1 runs its backward GEMM 6 ms longer: rank 0's all-reduce waits for it."""
    files = build(tmp_path, [regular(base_step), regular(lambda: base_step(bwd_ms=22))])
    bd = mb.breakdown(trace=files, cfg=config(), gpu="h100")
    assert bd.ideal == pytest.approx(IDEAL_MS / 1e3)
    for s in later_steps(bd):
        assert s.t_step == pytest.approx(STEP_MS / 1e3)
        fast, slow = (s.per_device[d] for d in sorted(s.per_device))
        within(fast, {"stragglers": 0.006, "exposed_comm": 0.002, "kernel_efficiency": 0.020,
                      "launch_overhead": 0.001, "data_wait": 0.001, "recompute": 0.0}, 0.040)
        within(slow, {"stragglers": 0.0, "exposed_comm": 0.002, "kernel_efficiency": 0.026,
                      "launch_overhead": 0.001, "data_wait": 0.001}, 0.040)
        assert s.exposed_by_axis == pytest.approx({"fsdp": 0.002})   # default_pg is fsdp here
        (peer, row), = s.stragglers_on.items()
        assert peer.startswith("device 1 (rank 1, gpu:1)") and row["cause"] == "kernel_efficiency"
    check_breakdown_sums(bd)
    assert "fsdp" in bd.budget.by_axis and "waiting on device 1" in bd.format()


def test_a_peer_late_from_its_dataloader_is_a_straggler(tmp_path):
    """Before step 2 rank 1's DataLoader takes 7 ms instead of 1: its step starts 6 ms late,
    rank 0's all-reduce waits those 6 ms for it, and both steps last 46 ms."""
    def on_time(n):
        return 10 + n * STEP_MS + 6 * (n > 2), base_step(allreduce_end=44 if n == 2 else 38)

    def late(n):
        t0 = 10 + n * STEP_MS + 6 * (n > 1)
        return t0, base_step(), (t0 - 8, t0 - 1) if n == 2 else None
    bd = mb.breakdown(trace=build(tmp_path, [on_time, late], steps=4), cfg=config(),
                      gpu="h100")
    s = next(s for s in bd.steps if s.step == 2)
    assert s.t_step == pytest.approx(0.046)
    waiting, late_rank = (s.per_device[d] for d in sorted(s.per_device))
    within(waiting, {"stragglers": 0.006, "exposed_comm": 0.008, "data_wait": 0.001,
                     "launch_overhead": 0.001, "kernel_efficiency": 0.020}, 0.046)
    within(late_rank, {"stragglers": 0.0, "data_wait": 0.007, "exposed_comm": 0.008,
                       "launch_overhead": 0.001, "kernel_efficiency": 0.020}, 0.046)
    (peer, row), = s.stragglers_on.items()
    assert peer.startswith("device 1 (rank 1") and row["cause"] == "data_wait"
    assert "late by data wait" in bd.format()
    for s in bd.steps:
        if s.step in (1, 3):
            within(s.terms, {"stragglers": 0.0, "exposed_comm": 0.008}, 0.040)
    check_breakdown_sums(bd)


def test_slow_backward_gemms_are_not_recompute_and_a_replay_is(tmp_path):
    """remat none, a 5 ms forward GEMM whose backward GEMMs take 16 ms (more than twice it):
    recompute is 0, measured; then a checkpointed layer whose 5 ms forward GEMM is replayed
    inside its backward node: recompute 5 ms."""
    slow = lambda: [(GEMM, 0, 5, FWD, 7), (ELEMENTWISE, 5, 14, FWD[:1], 7),  # noqa: E731
                    (GEMM, 14, 30, BWD, 7), (ALLREDUCE, 30, 38, comms("allreduce"), 20)]
    files = build(tmp_path, [regular(slow), regular(slow)])
    for s in later_steps(mb.breakdown(trace=files, cfg=config(), gpu="h100")):
        assert s.terms["recompute"] == 0.0
        within(s.terms, {"kernel_efficiency": 0.020, "exposed_comm": 0.008}, 0.040)
    replayed = lambda: base_step(bwd_ms=11, replay_ms=5)  # noqa: E731
    bd = mb.breakdown(trace=build(tmp_path, [regular(replayed), regular(replayed)]),
                      cfg=config(), gpu="h100")
    for s in later_steps(bd):
        within(s.terms, {"recompute": 0.005, "kernel_efficiency": 0.015}, 0.040)
        assert s.recompute_split["gemm"] == pytest.approx(0.005)
    check_breakdown_sums(bd)


def test_without_autograd_markers_recompute_is_not_available(tmp_path):
    bare = lambda: [(k, s, e, (), st) for k, s, e, _, st in base_step()]  # noqa: E731
    files = build(tmp_path, [regular(bare), regular(bare)])
    bd = mb.breakdown(trace=files, cfg=config(), gpu="h100")
    assert all(s.terms["recompute"] is None for s in bd.steps)
    assert bd.budget.terms["recompute"] is None and bd.budget.folded is not None
    assert sum(bd.points().values()) == pytest.approx(
        100 * (bd.ideal / bd.budget.step - bd.mfu))
    row = next(line for line in bd.format().splitlines() if line.startswith("recompute"))
    assert row.split()[1:3] == ["n/a", "n/a"]


def test_all_to_all_is_exposed_communication_on_the_expert_axis(tmp_path):
    """An MoE dispatch: NCCL runs the all_to_allv as SendRecv kernels; they are the expert
    axis's exposed communication, not pipeline bubble, with or without parallel.expert."""
    a2a = comms("all_to_allv", pg="1", desc="mesh_ep", ranks=(0, 1))
    step = lambda: [(GEMM, 0, 10, FWD, 7), (SENDRECV, 10, 13, a2a, 20),  # noqa: E731
                    (GEMM, 13, 30, BWD, 7), (ALLREDUCE, 30, 38, comms("allreduce"), 20)]
    files = build(tmp_path, [regular(step), regular(step)])
    for cfg in (config(fsdp=1, data=2, expert=2), config(fsdp=1, data=2)):
        bd = mb.breakdown(trace=files, cfg=cfg, gpu="h100")
        for s in later_steps(bd):
            within(s.terms, {"bubble": 0.0, "exposed_comm": 0.011}, 0.040)
            assert s.exposed_by_axis == pytest.approx({"expert": 0.003, "data": 0.008})
        assert bd.kernels["NCCL"]["kernels"] == 12   # 2 a step, 3 steps, 2 ranks


def test_kernel_families_by_what_they_are(tmp_path):
    """Inductor's GEMM template is a GEMM and its pointwise kernel named after addmm is not;
    FlashAttention-2's kernels are attention with their own line, its helpers non-GEMM."""
    step = lambda: [  # noqa: E731
        ("triton_tem_fused_mm_0", 0, 6, FWD, 7), ("triton_poi_fused_addmm_relu_1", 6, 8, FWD, 7),
        ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
         "cutlass::bfloat16_t>>(flash::Flash_fwd_params)", 8, 12, FWD, 7),
        ("void flash_bwd_dot_do_o_kernel<true>(flash::Flash_bwd_params)", 12, 13, BWD, 7),
        ("void flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64>>"
         "(flash::Flash_bwd_params)", 13, 21, BWD, 7),
        ("void flash_bwd_convert_dq_kernel<Flash_bwd_kernel_traits<128>>(flash::Flash_bwd_params"
         ", int)", 21, 22, BWD, 7),
        ("triton_tem_fused_addmm_2", 22, 30, BWD, 7), (ALLREDUCE, 30, 38, comms("allreduce"), 20)]
    files = build(tmp_path, [regular(step), regular(step)])
    cfg = config()
    bd = mb.breakdown(trace=files, cfg=cfg, gpu="h100")
    attn = IDEAL_MS / 1e3 * mb.attention_flops_per_token(cfg.model, cfg.train.seq_len) / (
        mb.model_flops_per_token(cfg))
    for s in later_steps(bd):
        within(s.kernel_split, {"gemm_below_peak": 0.014 - (0.010 - attn),
                                "attention_below_peak": 0.012 - attn, "non_gemm": 0.004}, 0.040)
    k = bd.kernels
    assert k["Inductor GEMM template"]["class"] == "gemm"
    assert k["Inductor pointwise/reduction"]["class"] == "non_gemm"
    assert k["FlashAttention-2"]["class"] == "attention" and k["FlashAttention-2"]["kernels"] == 12
    assert k["FlashAttention helper"]["class"] == "non_gemm"
    assert "attention below peak" in bd.format()
    assert kernel_classes.classify("ncclDevKernel_SendRecv(x)").cls == "p2p"


def test_memory_copies_have_their_own_place(tmp_path):
    """The batch's host-to-device copy before the first kernel is data wait; a device-to-device
    copy while compute is idle is a memory copy under kernel efficiency, not launch overhead."""
    def step(n):
        t0 = 10 + n * STEP_MS
        return t0, [("Memcpy HtoD (Pinned -> Device)", -1.5, -0.5, (), 7, "gpu_memcpy"),
                    *base_step()[:3], ("Memcpy DtoD (Device -> Device)", 30, 31, (), 7,
                                       "gpu_memcpy"),
                    (ALLREDUCE, 31, 38, comms("allreduce"), 20)], (t0 - 2, t0 - 1.5)
    bd = mb.breakdown(trace=build(tmp_path, [step, step]), cfg=config(), gpu="h100")
    for s in later_steps(bd):
        within(s.terms, {"data_wait": 0.0015, "launch_overhead": 0.0005,
                         "kernel_efficiency": 0.021, "exposed_comm": 0.007}, 0.040)
        within(s.kernel_split, {"memcpy": 0.001, "non_gemm": 0.004}, 0.040)
    assert bd.kernels["memcpy host-to-device"]["class"] == "h2d"
    check_breakdown_sums(bd)


def test_one_ranks_file_alone_keeps_the_jobs_t_ideal(tmp_path):
    files = build(tmp_path, [regular(base_step), regular(base_step)])
    both = mb.breakdown(trace=files, cfg=config(), gpu="h100")
    alone = mb.breakdown(trace=files[1:], cfg=config(), gpu="h100")
    assert alone.ideal == pytest.approx(both.ideal) == pytest.approx(IDEAL_MS / 1e3)
    assert [d.split("/")[-1] for d in alone.steps[-1].per_device] == ["gpu:1"]
    assert any("shows 1 of the job's 2 devices" in n for n in alone.notes)


def test_a_config_that_disagrees_with_the_trace_is_one_clear_line(tmp_path, capsys):
    files = build(tmp_path, [regular(base_step), regular(base_step)])
    cfg = tmp_path / "config.json"
    cfg.write_text(tiny_config("--parallel.fsdp=4", "--parallel.data=1").to_json())
    assert mb.main(["--trace", *map(str, files), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "world_size 2" in err
    assert "says 2 devices" in err and "says 4" in err
    assert mb.main(["--trace", str(files[0]), str(files[0]), "--config", str(cfg)]) == 2
    assert "two trace files are rank 0" in capsys.readouterr().err


def test_the_png_draws_the_split_and_keeps_the_budget_readable(tmp_path):
    """A measured step far beyond the budget: each bar is drawn as shares of its own step."""
    files = build(tmp_path, [regular(base_step), regular(base_step)])
    bd = mb.breakdown(trace=files, cfg=config(ideal_ms=0.5), gpu="h100")
    assert bd.mean.t_step > 5 * bd.budget.step
    bars = {name: (t_step, dict(segs)) for name, t_step, segs in mfu_plot.bars(bd)}
    assert bars["measured"][0] == bd.mean.t_step and bars["ledger budget"][0] == bd.budget.step
    for t_step, segs in bars.values():   # nothing negative here: the parts are the step
        assert sum(segs.values()) == pytest.approx(t_step)
    measured = bars["measured"][1]
    assert {"kernel eff.: GEMMs below peak", "kernel eff.: non-GEMM kernels"} <= set(measured)
    bd.save(tmp_path / "out")
    assert (tmp_path / "out" / "mfu_breakdown.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "out" / "mfu_breakdown.json").read_text())
    assert saved["kernel_classes"]["cuBLAS/cuBLASLt"]["examples"] == [GEMM]


def test_process_groups_on_the_configs_mesh_axes():
    """Ranks laid out stage-slowest, tensor-fastest; descriptions where ranks cannot tell."""
    from jaxtrain.tools.mfu_axes import desc_axis, group_label
    d = dict(stage=2, data=2, fsdp=1, context=1, tensor=2)
    assert [group_label(r, d) for r in ([0, 1], [0, 2], [0, 4], range(8), [0, 1, 2])] == [
        "tensor", "data", "stage", "stage+data+tensor", None]
    assert group_label([0, 2], d, kind="all-to-all") == "expert"   # no expert axis: dispatch
    assert group_label([0, 1], d, kind="all-to-all") == "tensor"
    four = dict(stage=1, data=4, fsdp=1, context=1, tensor=1)
    assert group_label([0, 1], four, expert=2, kind="all-to-all") == "expert"
    assert group_label([0, 2], four, expert=2) == group_label(range(4), four, expert=2) == "data"
    assert [desc_axis(x) for x in ("mesh_tp", "mesh_dp_shard", "mesh_dp_replicate",
                                   "PIPELINE_MODEL_PARALLEL_GROUP", "EXPERT_MODEL_PARALLEL_GROUP",
                                   "EXPERT_DATA_PARALLEL_GROUP", "default_pg")] == [
        "tensor", "fsdp", "data", "stage", "expert", "data", None]


@pytest.mark.parametrize("name, cls", [
    ("nvjet_tst_192x192_64x4_1x2_h_bz_coopB_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn>", "gemm"),
    ("triton_tem_fused_addmm_1", "gemm"), ("triton_poi_fused_addmm_relu_3", "non_gemm"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<>>>",
     "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)",
     "attention"),
    ("jaxtrain_flash_bwd_dkv", "attention"),
    ("void flash_bwd_convert_dq_kernel<Flash_bwd_kernel_traits<128>>", "non_gemm"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevComm*)", "comm"),
    ("Memcpy HtoD (Pinned -> Device)", "h2d"), ("Memset (Device)", "memset")])
def test_kernel_classes_by_family(name, cls):
    assert kernel_classes.classify(name).cls == cls
