"""The MFU breakdown: synthetic traces with known gaps give exactly the known terms; a real CPU
profile of the tiny model parses end to end; bad input gets one clear line."""
import builtins
import dataclasses
import gzip
import json

import pytest

from jaxtrain.tools import mfu_breakdown as mb
from jaxtrain.tools import profile_trace as pt
from jaxtrain.ledger import estimate, layout_from_config
from jaxtrain.ledger.flops import model_flops_per_token, tokens_per_step
from util import check_breakdown_sums, tiny_config

MS = 1000.0  # trace timestamps are µs
STEP_MS = 55.0
IDEAL_S = 0.010

# One step on the device, ms from the window start (the end of the previous step):
#   [0, 2) idle, host in next_batch: data wait 2   [2, 3) idle: launch overhead 1
#   [3, 13) forward GEMM (an all-gather hidden under it)   [13, 18) elementwise
#   [18, 38) backward GEMM   [38, 43) a forward GEMM jax.checkpoint replays: recompute 5
#   [43, 47) all-reduce alone: exposed 4   [47, 50) collective-permute alone: bubble 3
#   [50, 52) all-reduce and collective-permute: exposed 2   [52, 55) elementwise, a permute under it
PATTERN = [  # (hlo_op, torch kernel name, stream, start ms, end ms)
    ("fwd.1", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "compute", 3, 13),
    ("ag-start.1", "ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", "comm", 5, 12),
    ("ew.1", "void at::native::vectorized_elementwise_kernel<4>", "compute", 13, 18),
    ("bwd.1", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nt_n_tilesize128x128x64", "compute", 18, 38),
    ("rc.1", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "compute", 38, 43),
    ("ar.1", "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)", "comm", 43, 47),
    ("cp.1", "ncclDevKernel_SendRecv(ncclDevComm*)", "p2p", 47, 52),
    ("ar.1", "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)", "comm", 50, 52),
    ("ew.1", "void at::native::vectorized_elementwise_kernel<4>", "compute", 52, 55),
    ("cp.1", "ncclDevKernel_SendRecv(ncclDevComm*)", "p2p", 52, 54),
]
EXPECTED = {"kernel_efficiency": 0.028, "recompute": 0.005, "bubble": 0.003,
            "exposed_comm": 0.006, "data_wait": 0.002, "launch_overhead": 0.001,
            "stragglers": 0.0}

HLO = """HloModule jit_train_step, entry_computation_layout={(f32[64,64]{1,0})->f32[64,64]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

ENTRY %main (p0: f32[64,64], p1: f32[BIG]) -> f32[64,64] {
  %p0 = f32[64,64]{1,0} parameter(0)
  %big = f32[BIG]{0} parameter(1)
  %fwd.1 = f32[64,64]{1,0} dot(%p0, %p0), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/jvp(loss)/dot_general"}
  %bwd.1 = f32[64,64]{1,0} dot(%fwd.1, %p0), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/transpose(jvp(loss))/dot_general"}
  %rc.1 = f32[64,64]{1,0} dot(%p0, %p0), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/transpose(jvp(loss))/checkpoint/rematted_computation/dot_general"}
  %ew.1 = f32[64,64]{1,0} add(%bwd.1, %rc.1), metadata={op_name="jit(train_step)/add"}
  %ag-start.1 = (f32[64,64]{1,0}, f32[128,64]{1,0}) all-gather-start(%p0), replica_groups={{0,1}}, dimensions={0}
  %ag-done.1 = f32[128,64]{1,0} all-gather-done(%ag-start.1)
  %ar.1 = f32[BIG]{0} all-reduce(%big), replica_groups={{0,1}}, to_apply=%add
  %cp.1 = f32[64,64]{1,0} collective-permute(%ew.1), source_target_pairs={{0,1},{1,0}}
  ROOT %out = f32[64,64]{1,0} add(%cp.1, %ew.1)
}
"""


def hlo_text(big=1_000_000_000):  # 4 GB all-reduce: ~9 ms on NVLink, never a straggler
    return HLO.replace("BIG", str(big))


def cfg_with_ideal(ideal_s=IDEAL_S, devices=2):
    """The tiny model with a peak that makes T_ideal a round number."""
    cfg = tiny_config()
    flops = model_flops_per_token(cfg) * tokens_per_step(cfg) / devices
    return dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, peak_tflops=flops / ideal_s / 1e12))


def meta(pid, name, tid=None, thread=None):
    out = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}]
    if tid is not None:
        out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                    "args": {"name": thread}})
    return out


def jax_trace(runs=3, stretch=None):
    """A JAX GPU profile: host markers and next_batch spans, a device with a compute and a
    collectives stream, plus a derived "XLA Ops" line that must be ignored.
    stretch: (hlo_op, ms) lengthens that op (and shifts what follows)."""
    ev = meta(1, "/host:CPU", 10, "python") + meta(2, "/device:GPU:0", 20, "Stream #13(Compute)")
    ev += meta(2, "/device:GPU:0", 21, "Stream #20(Nccl)") + meta(2, "/device:GPU:0", 22,
                                                                "XLA Ops")
    base = 0.0
    for r in range(runs):
        shift = 0.0
        for op, _, stream, s, e in PATTERN:
            s, e = s + shift, e + shift
            if stretch and op == stretch[0] and shift == 0.0:
                e += stretch[1]
                shift = stretch[1]
            args = {"hlo_op": op, "hlo_module": "jit_train_step", "run_id": str(100 + r)}
            tid = 20 if stream == "compute" else 21
            ev.append({"ph": "X", "pid": 2, "tid": tid, "ts": base + s * MS,
                       "dur": (e - s) * MS, "name": op, "args": args})
            ev.append({"ph": "X", "pid": 2, "tid": 22, "ts": base + s * MS + 100,
                       "dur": (e - s) * MS, "name": op, "args": args})
        if r:  # the first run was dispatched before the trace began: no marker
            ev.append({"ph": "X", "pid": 1, "tid": 10, "ts": base - 0.5 * MS, "dur": 200,
                       "name": "train", "args": {"step_num": str(r)}})
        ev.append({"ph": "X", "pid": 1, "tid": 10, "ts": base, "dur": 2 * MS,
                   "name": mb.DATA_SPAN})
        base += (STEP_MS + shift) * MS
    return {"displayTimeUnit": "ns", "traceEvents": ev}


def write(tmp_path, trace, name="host.trace.json.gz"):
    path = tmp_path / name
    with gzip.open(path, "wt") as fh:
        json.dump(trace, fh)
    return path


def run(tmp_path, trace=None, files=None, **kw):
    files = files or [write(tmp_path, trace or jax_trace())]
    kw.setdefault("hlo_text", hlo_text())
    kw.setdefault("n_devices", 2)
    return mb.breakdown(trace=files, cfg=kw.pop("cfg", cfg_with_ideal()), gpu="h100", **kw)


def test_synthetic_jax_trace_gives_exactly_the_known_terms(tmp_path):
    bd = run(tmp_path)
    assert bd.assignment == "run_id" and [s.step for s in bd.steps] == [1, 2]
    assert bd.ideal == pytest.approx(IDEAL_S, rel=1e-12)
    for s in bd.steps:
        assert s.t_step == pytest.approx(STEP_MS / 1e3, abs=1e-12)
        assert s.terms == pytest.approx(EXPECTED, abs=1e-12)
        assert s.exposed_by_axis == pytest.approx({"data": 0.006}, abs=1e-12)
        assert s.kernel_split == pytest.approx({"gemm_below_peak": 0.035 - 0.010 - 0.005,
                                                "non_gemm": 0.008}, abs=1e-12)
    check_breakdown_sums(bd)
    # GEMM efficiency by shape: 2·64·64·64 FLOPs per dot, over the dot's measured time.
    shapes = {g["shape"]: g for g in bd.gemms}
    g = shapes["f32[64,64] x f32[64,64]"]
    assert g["count"] == 6 and g["time_s"] == pytest.approx(2 * 0.035)
    assert g["tflops"] == pytest.approx(6 * 2 * 64 ** 3 / (2 * 0.035) / 1e12)


def test_a_slow_backward_gemm_is_not_recompute(tmp_path):
    """The backward GEMM 10 ms longer (three times the forward): kernel efficiency, not
    recompute, which stays the replayed GEMM's 5 ms."""
    bd = run(tmp_path, trace=jax_trace(stretch=("bwd.1", 10.0)))
    for s in bd.steps:
        assert s.terms["recompute"] == pytest.approx(0.005, abs=1e-12)
        assert s.terms["kernel_efficiency"] == pytest.approx(0.038, abs=1e-12)
    check_breakdown_sums(bd)


def test_budget_is_the_planners_estimate_and_points_add_up(tmp_path):
    cfg = cfg_with_ideal()
    bd = run(tmp_path, cfg=cfg)
    gpu = dataclasses.replace(mb.get_gpu("h100"), bf16_flops=cfg.train.peak_tflops * 1e12,
                              fp32_flops=cfg.train.peak_tflops * 1e12)
    est = estimate(cfg, layout_from_config(cfg, 2), gpu)
    b = bd.budget
    assert b.ideal == pytest.approx(est.ideal_step_s) == pytest.approx(bd.ideal)
    assert b.terms["recompute"] == est.losses["recompute"]
    assert b.terms["launch_overhead"] == est.losses["overhead"]
    assert b.terms["kernel_efficiency"][0] == pytest.approx(est.losses["compute"][0]
                                                            - est.ideal_step_s)
    assert b.step == pytest.approx(sum(sum(v) / 2 for v in est.losses.values()))
    planned, measured = bd.ideal / b.step, bd.mfu
    assert sum(bd.points().values()) == pytest.approx(100 * (planned - measured))
    text = bd.format()
    for word in ("T_ideal", "kernel efficiency", "GEMMs below peak", "recompute",
                 "pipeline bubble", "exposed communication", "data wait",
                 "host launch overhead", "stragglers", "T_step", "GEMM efficiency by shape"):
        assert word in text
    bd.save(tmp_path / "out")
    back = json.loads((tmp_path / "out" / "mfu_breakdown.json").read_text())
    assert back["mean"]["terms_s"] == pytest.approx(EXPECTED, abs=1e-12)
    assert (tmp_path / "out" / "mfu_breakdown.png").stat().st_size > 1000


def test_multi_process_trace_gives_the_straggler_term(tmp_path):
    """Host b computes 5 ms longer; host a's all-reduce waits those 5 ms for it."""
    a = write(tmp_path, jax_trace(stretch=("ar.1", 5.0)), "a.trace.json.gz")
    b = write(tmp_path, jax_trace(stretch=("ew.1", 5.0)), "b.trace.json.gz")
    bd = run(tmp_path, files=[a, b])
    for s in bd.steps:
        assert s.devices == 2 and s.t_step == pytest.approx(0.060, abs=1e-12)
        fast, slow = (s.per_device[d] for d in sorted(s.per_device))
        assert fast["stragglers"] == pytest.approx(0.005, abs=1e-12)
        assert fast["exposed_comm"] == pytest.approx(0.006, abs=1e-12)
        assert slow["stragglers"] == 0.0
        assert slow["kernel_efficiency"] == pytest.approx(0.028 + 0.005, abs=1e-12)
        assert s.terms["stragglers"] == pytest.approx(0.0025, abs=1e-12)
    check_breakdown_sums(bd)


def test_a_collective_far_longer_than_its_bytes_allow_is_a_straggler(tmp_path):
    """A 4 KB all-reduce should take ~latency (100 µs); running 4 ms, the rest is waiting."""
    bd = run(tmp_path, hlo_text=hlo_text(big=1000))
    want = 100e-6 + 2 * (1 / 2) * 4000 / 450e9   # latency + ring wire bytes on NVLink
    s = bd.steps[0]
    assert s.terms["stragglers"] == pytest.approx((0.004 - want) + (0.002 - want), abs=1e-12)
    assert s.terms["exposed_comm"] == pytest.approx(2 * want, abs=1e-12)
    check_breakdown_sums(bd)


def torch_trace(steps=3):
    """torch.profiler's export: ProfilerStep markers, DataLoader spans, cudaLaunchKernel with
    correlation ids, kernels running after their launches on stream 7 (and 20 for NCCL)."""
    ev = meta(4242, "python3", 1, "python3") + meta(0, "GPU 0", 7, "stream 7")
    base, corr = 10 * MS, 0
    for r in range(steps):
        ev.append({"ph": "X", "cat": "user_annotation", "pid": 4242, "tid": 1,
                   "ts": base - 9 * MS, "dur": 5 * MS, "name": f"ProfilerStep#{r}"})
        ev.append({"ph": "X", "cat": "gpu_user_annotation", "pid": 0, "tid": 7, "ts": base,
                   "dur": STEP_MS * MS, "name": f"ProfilerStep#{r}", "args": {"device": 0}})
        ev.append({"ph": "X", "cat": "user_annotation", "pid": 4242, "tid": 1, "ts": base,
                   "dur": 2 * MS,
                   "name": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"})
        for i, (_, kernel, stream, s, e) in enumerate(PATTERN):
            corr += 1
            ev.append({"ph": "X", "cat": "cuda_runtime", "pid": 4242, "tid": 1,
                       "ts": base - 8 * MS + i * 10, "dur": 5, "name": "cudaLaunchKernel",
                       "args": {"correlation": corr}})
            ev.append({"ph": "X", "cat": "kernel", "pid": 0, "tid": 7 if stream == "compute"
                       else 20, "ts": base + s * MS, "dur": (e - s) * MS, "name": kernel,
                       "args": {"device": 0, "stream": 7, "correlation": corr}})
        base += STEP_MS * MS
    return ev   # a bare list, as some exporters write it


def test_torch_profiler_trace(tmp_path):
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps(torch_trace()))
    bd = mb.breakdown(trace=[path], cfg=cfg_with_ideal(devices=1), gpu="h100")
    assert bd.assignment == "correlation"
    later = [s for s in bd.steps if s.step >= 1]  # step 0 starts at its host marker
    assert [s.step for s in later] == [1, 2]
    for s in later:
        assert s.t_step == pytest.approx(STEP_MS / 1e3, abs=1e-12)
        # no HLO and no autograd markers: recompute n/a, its time stays in kernel efficiency
        assert s.terms["recompute"] is None
        measured = {k: v for k, v in s.terms.items() if k != "recompute"}
        want = {k: v for k, v in EXPECTED.items() if k != "recompute"}
        assert measured == pytest.approx({**want, "kernel_efficiency": 0.033}, abs=1e-12)
        assert s.exposed_by_axis == pytest.approx({"all-reduce": 0.006}, abs=1e-12)
        assert s.kernel_split["non_gemm"] == pytest.approx(0.008, abs=1e-12)
    check_breakdown_sums(bd)
    assert any(n.startswith("recompute n/a: the trace has no autograd backward nodes") and
               "folded" in n for n in bd.notes)
    assert bd.budget.terms["recompute"] is None and "n/a" in bd.format()


@pytest.mark.slow
def test_real_cpu_profile_of_the_tiny_model(tmp_path, capsys):
    """train.profile_steps: the trainer profiles and train.py's hook saves the HLO and prints the
    breakdown; the run directory reads back the same through xprof (xplane) and jax's JSON."""
    from jaxtrain import trainer
    cfg = tiny_config("--train.steps=5", "--train.profile_start=2", "--train.profile_steps=2",
                      workdir=str(tmp_path))
    trainer.train(cfg, on_profile=mb.after_profile)
    assert "MFU breakdown of" in capsys.readouterr().out
    files = pt.session_files(tmp_path)
    assert [f.name.endswith(".xplane.pb") for f in files] == [True]
    assert (files[0].parent / pt.HLO_FILE).is_file()
    saved = json.loads((tmp_path / "profile" / "mfu_breakdown.json").read_text())
    bd = mb.breakdown(tmp_path)
    assert [s.step for s in bd.steps] == [2, 3] and bd.steps[0].devices == 8
    check_breakdown_sums(bd)
    assert saved["mean"]["t_step_s"] == pytest.approx(bd.mean.t_step)
    # The only collectives are the data-parallel gradient reduction's, and the HLO says so.
    text = (files[0].parent / pt.HLO_FILE).read_text()
    mesh = {"stage": 1, "data": 8, "fsdp": 1, "context": 1, "tensor": 1}
    assert {o.axes for o in pt.hlo_ops(text, mesh).values() if o.comm} == {("data",)}
    assert set(bd.mean.exposed_by_axis) <= {"data"}
    assert bd.gemms and bd.mean.kernel_split is not None
    # remat none: no GEMM is replayed in the backward (only the elementwise insides of the norms
    # and SwiGLU, which llama._elementwise_recomputed recomputes by design)
    assert bd.mean.recompute_split["gemm"] == 0.0
    assert bd.mean.terms["recompute"] < 0.05 * bd.mean.t_step
    # the compiled step's matmul FLOPs all show up as GEMMs on each device, every step
    from jaxtrain.tools import hlo
    per_step = hlo.matmul_flops_from_text((files[0].parent / pt.HLO_FILE).read_text())
    counted = sum(g["count"] for g in bd.gemms)
    assert counted > 0 and sum(
        g["tflops"] * 1e12 * g["time_s"] for g in bd.gemms) == pytest.approx(
            per_step * 8 * len(bd.steps), rel=1e-6)
    json_file = files[0].with_name(files[0].name.replace(".xplane.pb", ".trace.json.gz"))
    via_json = mb.breakdown(trace=[json_file], cfg=bd_cfg(tmp_path), n_devices=8,
                            hlo_text=(files[0].parent / pt.HLO_FILE).read_text())
    assert [s.t_step for s in via_json.steps] == pytest.approx([s.t_step for s in bd.steps])


def bd_cfg(run_dir):
    return mb.mfu_job.config_arg(str(run_dir / "config.json"))


# ----------------------------------------------------------------------------- bad input

def cli_error(capsys, argv) -> str:
    assert mb.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("mfu_breakdown: error: ")
    return err


def test_run_directory_without_a_profile(tmp_path, capsys):
    tiny = tiny_config(workdir=str(tmp_path))
    (tmp_path / "config.json").write_text(tiny.to_json())
    assert "has no profile" in cli_error(capsys, [str(tmp_path)])
    assert "profile_steps" in cli_error(capsys, [str(tmp_path)])


def test_trace_without_a_complete_step(tmp_path, capsys):
    one_run = jax_trace(runs=1)   # its only execution has no marker and nothing before it
    path = write(tmp_path, one_run)
    cfg = tmp_path / "config.json"
    cfg.write_text(tiny_config().to_json())
    err = cli_error(capsys, ["--trace", str(path), "--config", str(cfg)])
    assert "no complete step" in err and "profile_steps=2" in err


def test_unknown_trace_formats(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(tiny_config().to_json())
    odd = tmp_path / "trace.pftrace"
    odd.write_bytes(b"\x0a\x02binary")
    assert "unknown trace format" in cli_error(capsys, ["--trace", str(odd), "--config",
                                                        str(cfg)])
    no_events = tmp_path / "x.json"
    no_events.write_text(json.dumps({"foo": 1}))
    assert "no traceEvents" in cli_error(capsys, ["--trace", str(no_events), "--config",
                                                  str(cfg)])
    broken = tmp_path / "y.json"
    broken.write_text("{not json")
    assert "not a Chrome/Perfetto trace JSON" in cli_error(
        capsys, ["--trace", str(broken), "--config", str(cfg)])
    assert "needs --config" in cli_error(capsys, ["--trace", str(no_events)])


def test_xplane_without_xprof_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "host.xplane.pb"
    path.write_bytes(b"")
    real = builtins.__import__

    def no_xprof(name, *a, **kw):
        if name.startswith("xprof"):
            raise ImportError(name)
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_xprof)
    with pytest.raises(pt.TraceError, match=r"pip install 'jaxtrain\[profile\]'"):
        pt.load([path])
