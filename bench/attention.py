"""Causal attention throughput: jaxtrain's flash attention on Mosaic GPU (checked and fast
products) and on Triton vs cuDNN vs XLA.

    python bench/attention.py                      # GPU: seq 1k..16k, D=128, bf16
    python bench/attention.py --quick              # CPU smoke test (Pallas interpret mode)
    python bench/attention.py --kv-heads 2 --block-q 128 --block-k 64
    python bench/attention.py --doc-len 2048       # every impl on packed 2048-token documents
    python bench/attention.py --doc-lens 8192,2048,512,128   # packed documents: block skipping

Impls: mosaic (backend="mosaic", the checked products: the default), mosaic_fast (fast_mma:
FlashAttention-3's products, to be confirmed on a GPU), pallas (the Triton kernel), cudnn
(jax.nn.dot_product_attention; with --doc-len the model's cuDNN core: an explicit document
mask), xla (the model's XLA core). The Mosaic kernels are Hopper's; off GPU they are listed
as skipped (interpreted they take minutes), not dropped.

FLOP convention (FlashAttention-2's benchmark): a causal forward counts 4*B*S*S*H*D/2 (two matmuls,
half the score matrix); the backward counts 2.5x the forward (five matmuls), so forward+backward
counts 3.5x the forward (--fwd-bwd-factor changes this). "fwd+bwd" times one jitted
jax.grad step, which runs the forward and the backward. Recompute inside the kernels is not
counted. Also reported: max |difference| of output and gradients against XLA, where XLA fits.

--doc-lens packs each row with documents of those lengths (segment ids 1, 2, ...) and reports
the tiles (q block x kv block x head) the Pallas kernels compute with and without block
skipping: counted by the kernels themselves off GPU (interpret mode, checked against the host
block map), by the host block map on GPU, where both variants are also timed. `packed_documents`
is the function other scripts (the GPU suite) call.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxtrain.model import attention as attention_cores  # noqa: E402
from jaxtrain.model.kernels import block_counts, flash_attention  # noqa: E402
from jaxtrain.model.kernels.flash_attention import _kernel_block_counts  # noqa: E402

IMPLS = ("mosaic", "mosaic_fast", "pallas", "cudnn", "xla")
KERNEL_BACKENDS = {"mosaic": ("mosaic", False), "mosaic_fast": ("mosaic", True),
                   "pallas": ("triton", False)}


def causal_fwd_flops(B, S, H, D):
  return 4 * B * S * S * H * D / 2


def _attention_fn(impl, args, seg=None):
  """impl's causal attention of (q, k, v); `seg` [B, S]: packed documents, or None."""
  if impl in KERNEL_BACKENDS:
    backend, fast = KERNEL_BACKENDS[impl]
    blocks = dict(block_q=args.block_q, block_k=args.block_k, block_q_bwd=args.block_q_bwd,
                  block_k_bwd=args.block_k_bwd)
    return lambda q, k, v: flash_attention(q, k, v, seg, causal=True, backend=backend,
                                           fast_mma=fast, **blocks)
  if seg is not None or impl == "xla":  # the model's cores: documents as segment ids / mask
    ids = seg if seg is not None else None
    core = attention_cores.cudnn_attention if impl == "cudnn" else attention_cores.xla_attention
    return lambda q, k, v: core(q, k, v, ids if ids is not None else
                                jnp.zeros(q.shape[:2], jnp.int32))
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                      implementation=impl)


def _skip_reason(impl):
  on_gpu = jax.default_backend() == "gpu"
  if impl == "cudnn" and not on_gpu:
    return f"cuDNN needs a CUDA GPU; the default backend is {jax.default_backend()}"
  if impl.startswith("mosaic"):
    if not on_gpu:
      return ("the Mosaic GPU kernels run on Hopper GPUs (interpreted off GPU they take "
              "minutes; the fast products do not interpret at all)")
    capability = getattr(jax.devices()[0], "compute_capability", "")
    if not str(capability).startswith("9."):
      return f"the Mosaic GPU kernels need sm_90 (H100/H200); this is sm_{capability}"
  return None


def _time(fn, inputs, warmup, iters):
  """(compile seconds, median seconds per call, result of the last call)."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*inputs))
  compile_s = time.perf_counter() - t0
  for _ in range(warmup):
    jax.block_until_ready(fn(*inputs))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*inputs))
    times.append(time.perf_counter() - t0)
  return compile_s, statistics.median(times), out


def _short_error(e: Exception) -> str:
  text = f"{type(e).__name__}: {e}".splitlines()[0]
  if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
    return "out of memory"
  return text[:90]


def _max_diff(a, b):
  if a is None or b is None:
    return None
  return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def run(args):
  dtype = jnp.dtype(args.dtype)
  D, H, K = args.head_dim, args.heads, args.kv_heads
  rows = []
  skipped = {}
  for S in args.seq_lens:
    B = max(1, args.tokens // S)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, S, H, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, S, K, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, S, K, D)), dtype)
    do = jnp.asarray(rng.standard_normal((B, S, H, D)), dtype)
    seg = None if not args.doc_len else jnp.asarray(packed_segments(B, S, args.doc_len))
    fwd_flops = causal_fwd_flops(B, S, H, D)
    results = {}
    for impl in args.impls:
      reason = _skip_reason(impl)
      if reason:
        skipped[impl] = reason
        continue
      attn = _attention_fn(impl, args, seg)
      fwd = jax.jit(attn)
      # sum(out * do) gives the backward a dense random cotangent.
      loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
      fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
      row = dict(S=S, B=B, impl=impl)
      for mode, fn, flops in (("fwd", fwd, fwd_flops),
                              ("fwd_bwd", fwd_bwd, fwd_flops * args.fwd_bwd_factor)):
        if args.fwd_only and mode == "fwd_bwd":
          continue
        try:
          compile_s, sec, out = _time(fn, (q, k, v), args.warmup, args.iters)
          row[mode] = (sec * 1e3, flops / sec / 1e12)
          if S <= args.check_max_seq:
            results[(impl, mode)] = out
        except Exception as e:  # noqa: BLE001 - a failed cell is reported, not fatal
          row[mode] = _short_error(e)
      rows.append(row)
    for row in rows:
      if row["S"] != S:
        continue
      for mode in ("fwd", "fwd_bwd"):
        diff = _max_diff(results.get((row["impl"], mode)), results.get(("xla", mode)))
        row[mode + "_diff"] = diff
    print(f"  done seq {S}", file=sys.stderr, flush=True)
  return rows, skipped


def packed_segments(batch, seq, doc_len):
  """[batch, seq] int32 ids of back-to-back documents of doc_len tokens (the last one cut)."""
  return np.broadcast_to(np.arange(seq, dtype=np.int32) // doc_len + 1, (batch, seq)).copy()


def packed_documents(seq_len=8192, doc_lens=(8192, 2048, 512, 128), *, tokens=16384, heads=16,
                     kv_heads=None, head_dim=128, dtype="bfloat16", iters=10, warmup=2,
                     blocks=None, time_kernels=None, count_kernels=None):
  """Block skipping for packed documents: one row per document length with the tiles each
  kernel computes (skip and dense: (fwd, dkv, dq)) and, with `time_kernels` (default: on
  GPU), the median fwd+bwd ms of the skipping and the dense kernel. `count_kernels` (default:
  off GPU) has the kernels count their tiles (debug counters) and checks the host count."""
  on_gpu = jax.default_backend() == "gpu"
  time_kernels = on_gpu if time_kernels is None else time_kernels
  count_kernels = not on_gpu if count_kernels is None else count_kernels
  kv_heads = heads if kv_heads is None else kv_heads
  blocks = blocks or {}
  B, S, H, K, D = max(1, tokens // seq_len), seq_len, heads, kv_heads, head_dim
  rng = np.random.default_rng(0)
  q, k, v, do = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in
                 ((B, S, H, D), (B, S, K, D), (B, S, K, D), (B, S, H, D)))
  rows = []
  for doc_len in doc_lens:
    seg = packed_segments(B, S, doc_len)
    row = dict(S=S, B=B, doc_len=doc_len,
               skip=block_counts(q.shape, seg, **blocks),
               dense=block_counts(q.shape, seg, skip_empty_blocks=False, **blocks))
    if count_kernels:
      order = ("block_q", "block_k", "block_q_bwd", "block_k_bwd")
      counted = _kernel_block_counts(q, k, v, seg, blocks=tuple(blocks.get(n) for n in order))
      if counted != row["skip"]:
        raise AssertionError(f"kernel counters {counted} != host block map {row['skip']}")
      row["counted_by"] = "kernels"
    else:
      row["counted_by"] = "host"
    if time_kernels:
      seg_j = jnp.asarray(seg)
      for name, skip in (("skip_ms", True), ("dense_ms", False)):
        attn = lambda q, k, v, skip=skip: flash_attention(q, k, v, seg_j, causal=True,
                                                          skip_empty_blocks=skip, **blocks)
        loss = lambda q, k, v, attn=attn: jnp.sum(attn(q, k, v).astype(jnp.float32) *
                                                  do.astype(jnp.float32))
        fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        try:
          row[name] = _time(fn, (q, k, v), warmup, iters)[1] * 1e3
        except Exception as e:  # noqa: BLE001 - a failed cell is reported, not fatal
          row[name] = _short_error(e)
    rows.append(row)
    print(f"  done doc_len {doc_len}", file=sys.stderr, flush=True)
  return rows


def print_packed_table(rows, heads, head_dim, dtype):
  print(f"\nPacked documents, causal, heads {heads}, head_dim {head_dim}, {dtype}; tiles = "
        "(q block x kv block x head) per kernel, fwd / dK/dV / dQ; device "
        f"{jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}\n")
  print("| seq | batch | doc len | tiles skipping | tiles dense | computed | counted by | "
        "fwd+bwd skip ms | fwd+bwd dense ms |")
  print("|---:|---:|---:|---|---|---:|---|---:|---:|")
  for r in rows:
    frac = sum(r["skip"]) / sum(r["dense"])
    ms = lambda x: "-" if x is None else (x if isinstance(x, str) else f"{x:.3f}")
    print(f"| {r['S']} | {r['B']} | {r['doc_len']} | {' / '.join(map(str, r['skip']))} | "
          f"{' / '.join(map(str, r['dense']))} | {frac:.1%} | {r['counted_by']} | "
          f"{ms(r.get('skip_ms'))} | {ms(r.get('dense_ms'))} |")


def _cell(value):
  if value is None:
    return "-"
  if isinstance(value, str):
    return value
  ms, tflops = value
  return f"{ms:.3f} ms / {tflops:.3g}"


def print_table(args, rows, skipped):
  device = jax.devices()[0]
  docs = f"packed {args.doc_len}-token documents" if args.doc_len else "one document per row"
  print(f"\nCausal attention, {args.dtype}, heads {args.heads}, kv heads {args.kv_heads}, "
        f"head_dim {args.head_dim}, batch = {args.tokens} tokens // seq, {docs}; device "
        f"{device.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
  print(f"FLOPs: fwd = 4*B*S^2*H*D/2, fwd+bwd = {args.fwd_bwd_factor}x fwd (causal, whatever "
        f"the documents skip). Cells: median time / TFLOP/s. diff: max |impl - xla| over "
        f"output (fwd) or grads.\n")
  print("| seq | batch | impl | fwd | fwd+bwd | fwd diff | grad diff |")
  print("|---:|---:|---|---:|---:|---:|---:|")
  fmt = lambda d: "-" if d is None else f"{d:.2e}"
  for r in rows:
    print(f"| {r['S']} | {r['B']} | {r['impl']} | {_cell(r.get('fwd'))} | "
          f"{_cell(r.get('fwd_bwd'))} | {fmt(r.get('fwd_diff'))} | {fmt(r.get('fwd_bwd_diff'))} |")
  for impl, reason in skipped.items():
    print(f"\n{impl}: skipped ({reason})")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--seq-lens", default="1024,2048,4096,8192,16384",
                 type=lambda s: [int(x) for x in s.split(",")])
  p.add_argument("--tokens", type=int, default=16384, help="batch = tokens // seq")
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--impls", default=",".join(IMPLS), type=lambda s: s.split(","))
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--fwd-only", action="store_true")
  p.add_argument("--fwd-bwd-factor", type=float, default=3.5,
                 help="fwd+bwd FLOPs as a multiple of forward FLOPs (FA2 convention: 3.5)")
  p.add_argument("--check-max-seq", type=int, default=4096,
                 help="compare against XLA up to this sequence length")
  for name in ("block-q", "block-k", "block-q-bwd", "block-k-bwd"):
    p.add_argument(f"--{name}", type=int, default=None, help="Pallas tile size (default: auto)")
  p.add_argument("--doc-len", type=int, default=None,
                 help="time every impl on rows packed with documents of this many tokens")
  p.add_argument("--doc-lens", default=None, type=lambda s: [int(x) for x in s.split(",")],
                 help="packed-document lengths: report block skipping instead (one --seq-lens)")
  p.add_argument("--quick", action="store_true",
                 help="tiny shapes and few iterations (CPU smoke test in interpret mode)")
  args = p.parse_args(argv)
  if args.kv_heads is None:
    args.kv_heads = args.heads
  bad = [i for i in args.impls if i not in IMPLS]
  if bad:
    p.error(f"unknown --impls {bad}; choose from {IMPLS}")
  if args.quick:
    args.seq_lens, args.tokens, args.heads = [128], 128, 2
    args.kv_heads = min(args.kv_heads, 2)
    args.iters, args.warmup = 2, 1
  return args


def main(argv=None):
  args = parse_args(argv)
  if args.doc_lens:
    blocks = {n: getattr(args, n) for n in ("block_q", "block_k", "block_q_bwd", "block_k_bwd")
              if getattr(args, n) is not None}
    rows = packed_documents(args.seq_lens[0], args.doc_lens, tokens=args.tokens,
                            heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                            dtype=args.dtype, iters=args.iters, warmup=args.warmup,
                            blocks=blocks)
    print_packed_table(rows, args.heads, args.head_dim, args.dtype)
    return
  rows, skipped = run(args)
  print_table(args, rows, skipped)


if __name__ == "__main__":
  main()
