"""Where a run's numbers go: console line, metrics.jsonl, TensorBoard, a progress bar.

Throughput figures (tokens/s, MFU, HFU) come from the ledger's formulas (docs/design.md §5) over
the device's nominal peak; on CPU the peak is an estimate and the log line says so. `mfu` and
`hfu` count causal attention as half (Megatron's and MaxText's convention); `mfu_full_attn`
and `hfu_full_attn` count the full s×s square.
"""
from __future__ import annotations

import json
import pathlib
import struct
import time

import jax

from jaxtrain.ledger.flops import hfu_flops_per_token, model_flops_per_token
from jaxtrain.ledger.hardware import gpu_for_device_kind
from jaxtrain.config import Config


# The profiler span the trainer puts around fetching a batch: the MFU breakdown's data wait.
DATA_SPAN = "next_batch"


def peak_flops_per_device(cfg: Config) -> tuple[float, bool]:
    """(peak FLOP/s of one device for the compute dtype, is_estimate). FP8 runs divide by the
    same (bf16) peak as the ledger's expected MFU, so the two compare and FP8's gain shows as a
    higher MFU (torchtitan reports it the same way)."""
    if cfg.train.peak_tflops > 0:
        return cfg.train.peak_tflops * 1e12, False
    gpu = gpu_for_device_kind(jax.devices()[0].device_kind)
    return gpu.peak_flops(cfg.model.compute_dtype), gpu.estimate


class Throughput:
    """Turns wall time between logged steps into tokens/s, MFU and HFU."""

    def __init__(self, cfg: Config, n_devices: int):
        self.n_devices = n_devices
        self.peak, self.peak_is_estimate = peak_flops_per_device(cfg)
        self.flops = {"mfu": model_flops_per_token(cfg), "hfu": hfu_flops_per_token(cfg),
                      "mfu_full_attn": model_flops_per_token(cfg, causal=False),
                      "hfu_full_attn": hfu_flops_per_token(cfg, causal=False)}
        self.tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        self._created = time.perf_counter()
        self._t, self._step = None, None

    @property
    def started(self) -> bool:
        return self._t is not None

    def start(self, step: int) -> float:
        """Start timing after `step` (the first, which compiled); returns the seconds since
        this object was made (that first step's compile and run)."""
        self._t, self._step = time.perf_counter(), step
        return self._t - self._created

    def measure(self, step: int) -> dict:
        now = time.perf_counter()
        steps = step - self._step
        dt = (now - self._t) / max(steps, 1)
        self._t, self._step = now, step
        tps = self.tokens_per_step / dt
        denom = self.n_devices * self.peak
        return {"step_time_s": dt, "tokens_per_sec": tps,
                "tokens_per_sec_per_device": tps / self.n_devices,
                **{k: tps * f / denom for k, f in self.flops.items()}}


def device_memory_gb() -> float | None:
    device = jax.local_devices()[0]  # jax.devices()[0] belongs to process 0 only
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] / 2**30


def _drop_records_after(path: pathlib.Path, step: int) -> None:
    """Rewrite the jsonl at `path` without the records of steps after `step` (atomically)."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _record_step(line) <= step]
    if len(kept) != len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)


def _trim_torn_events(folder: pathlib.Path) -> None:
    """Cut each TensorBoard events file after its last whole record (TFRecord framing: u64
    length, u32 crc, payload, u32 crc): a process killed mid-write leaves a torn one, at which
    readers stop or fail. The next run writes a file of its own."""
    for path in sorted(folder.glob("events.out.tfevents.*")) if folder.is_dir() else []:
        data, end = path.read_bytes(), 0
        while end + 12 <= len(data):
            (length,) = struct.unpack_from("<Q", data, end)
            if end + 16 + length > len(data):
                break
            end += 16 + length
        if end < len(data):
            with open(path, "r+b") as f:
                f.truncate(end)


def _record_step(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except (ValueError, AttributeError):
        return float("inf")  # a line torn by a kill mid-write


class MetricsWriter:
    def __init__(self, workdir: pathlib.Path, total_steps: int, enabled: bool = True,
                 peak_is_estimate: bool = False, start_step: int = 0):
        self.enabled = enabled
        self.peak_note = " (CPU peak is an estimate)" if peak_is_estimate else ""
        self._jsonl = self._tb = self._bar = None
        if not enabled:
            return
        # What an earlier attempt logged after the checkpoint this run starts from (steps it
        # will log again) is dropped, from metrics.jsonl and (purge_step) TensorBoard alike, so
        # a restart leaves no overlap.
        _drop_records_after(workdir / "metrics.jsonl", start_step)
        _trim_torn_events(workdir / "tensorboard")
        self._jsonl = open(workdir / "metrics.jsonl", "a")
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(str(workdir / "tensorboard"), purge_step=start_step + 1)
        from tqdm import tqdm
        self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                         leave=False)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)):
                self._tb.add_scalar(k, v, step)
        self.console(_format_line(record, self.peak_note))

    def flush(self) -> None:
        """Put what was logged on disk (TensorBoard buffers up to its 120 s flush): called
        when a checkpoint is saved and when a stop is requested, so the steps a restart will
        not log again are never lost with the process."""
        if self._tb is not None:
            self._tb.flush()

    def console(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()


def _plain(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def _format_line(r: dict, peak_note: str) -> str:
    if "eval_loss" in r:
        return f"step {r['step']:>6} | eval loss {r['eval_loss']:.4f}"
    parts = [f"step {r['step']:>6}", f"loss {r['loss']:.4f}", f"grad_norm {r['grad_norm']:.3f}",
             f"lr {r['lr']:.2e}"]
    if "first_step_time_s" in r:
        parts.append(f"first step {r['first_step_time_s']:.1f} s (compile included)")
    if "tokens_per_sec" in r:
        parts += [f"{r['tokens_per_sec']:,.0f} tok/s",
                  f"{r['tokens_per_sec_per_device']:,.0f} tok/s/dev",
                  f"{r['step_time_s'] * 1e3:.1f} ms/step",
                  f"MFU {100 * r['mfu']:.2f}% HFU {100 * r['hfu']:.2f}%{peak_note}"]
    if "moe_aux_loss" in r:   # the MoE layers' (model/moe.py means): losses, load, drops
        parts.append(f"moe aux {r['moe_aux_loss']:.4f} lb {r['moe_load_balancing_loss']:.3f} "
                     f"z {r['moe_z_loss']:.3f} load {r['moe_load_min']:.2f}-"
                     f"{r['moe_load_max']:.2f} cv {r['moe_load_cv']:.2f} dropped "
                     f"{100 * r['moe_dropped_fraction']:.1f}%")
    if "mtp_loss" in r:   # multi-token prediction's mean depth loss (model/mtp.py)
        parts.append(f"mtp {r['mtp_loss']:.4f}")
    if r.get("memory_gb") is not None:
        parts.append(f"mem {r['memory_gb']:.2f} GiB")
    return " | ".join(parts)
