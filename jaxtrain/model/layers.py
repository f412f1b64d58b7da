"""What the blocks build from: parameters with logical axis names and their initializers, the
projection (Dense, FP8-capable) and its sequence-parallel gather/scatter forms, RMSNorm, and
the SwiGLU product. The dense and the mixture-of-experts blocks (llama.py, moe.py) share them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.config import ModelConfig


def param(rngs: nnx.Rngs, init, shape, axes, dtype):
    """A parameter drawn by `init`, carrying logical axis names (never a mesh axis)."""
    value = init(rngs.params(), shape, dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def normal(std):
    return jax.nn.initializers.normal(stddev=std)


def elementwise_recomputed(fn):
    """`fn` whose backward recomputes its (cheap, elementwise) insides from its inputs instead
    of keeping them: autodiff would otherwise hold every fp32 intermediate per layer (a 70B
    layer's norms kept 4 fp32 copies of the residual stream, its SwiGLU 5 MLP-sized tensors
    where Megatron keeps 3). The inputs are kept anyway (the residual stream, the in-projection
    outputs), so this costs no memory and a few elementwise passes."""
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)


@elementwise_recomputed
def swiglu(gate, up):
    return jax.nn.silu(gate) * up


class Dense(nnx.Module):
    """A projection: contracts x's last `len(in_shape)` dims with the kernel's leading dims.

    With FP8 on (`ops.fp8`, the converter) it also owns an FP8 meta, and `fp8=True` calls run
    in FP8.
    """

    def __init__(self, in_shape, out_shape, axes, *, cfg: ModelConfig, ops, rngs, std,
                 name: str):
        """`ops`: the model's llama.Ops (its dot_general and FP8 converter)."""
        self.kernel = param(rngs, normal(std), (*in_shape, *out_shape), axes,
                            jnp.dtype(cfg.param_dtype))
        self.n_in = len(in_shape)
        self.axes = tuple(axes)
        self.compute_dtype = jnp.dtype(cfg.compute_dtype)
        self.ops = ops
        self.name = name
        self.fp8_meta = ops.fp8.new_meta()

    def __call__(self, x, fp8: bool = False):
        return self.apply(x, self.weights(), fp8)

    def weights(self):
        """(kernel, FP8 meta or None): what `apply` computes with, as arrays."""
        return self.kernel[...], self.ops.fp8.meta_value(self.fp8_meta)

    def cast(self, weights, fp8: bool = False):
        """The kernel cast to FP8 on its shard (None for a compute-dtype call): what `apply`
        takes as `cast` when its caller re-traces it in a backward (project_gathered)."""
        kernel, meta = weights
        return self.ops.fp8.cast_kernel(kernel.astype(self.compute_dtype), meta, fp8=fp8)

    def apply(self, x, weights, fp8: bool = False, cast=None):
        """The projection of x with `weights` (from `weights()`; `cast` from `cast()` or
        None), reading no variable itself: callable where only explicit arrays may enter (a
        custom VJP's function)."""
        kernel, meta = weights
        w = kernel.astype(self.compute_dtype)
        n = self.n_in
        dims = ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ()))
        return self.ops.fp8.project(x.astype(self.compute_dtype), w, dims, meta, fp8=fp8,
                                    dot_general=self.ops.dot_general, name=self.name,
                                    gather=functools.partial(self.ops.gather_weight,
                                                             names=self.axes), cast=cast)


def project_gathered(gather, x, projections, fp8: bool):
    """The projections (Dense) of gather(x), the whole sequence, gathered once for all of them;
    the backward gathers x again for the weight gradients instead of keeping gather(x)
    (Megatron-SP: a layer keeps its sequence-parallel shard). Left to GSPMD, each projection
    gathers x itself and again in the backward (14 sequence-sized all-gathers per layer, 6
    here); a gather shared and kept holds the whole sequence per layer (+20 GiB at Llama 70B,
    tensor=8). Without sequence parallelism `gather` is the identity and nothing changes.

    The backward re-traces the projections for their VJP; their forward GEMMs, unused there,
    are dead code XLA removes (the compiled matmul FLOPs are unchanged). FP8 kernels are cast
    once, outside (`Dense.cast`), so the re-trace reads the forward's FP8 shard and shares its
    FSDP gather (cast again inside, each trace gathered its own copy: 3 weight gathers a layer
    under remat instead of 2). With `ops.collective_matmul` (parallel/collective_matmul.py)
    the gather and the GEMMs run as one ring instead."""
    ring = projections[0].ops.collective_matmul
    if ring is not None:
        return ring.gathered(x, projections, fp8)
    def run(xg, weights, casts):
        return tuple(p.apply(xg, w, fp8, c) for p, w, c in zip(projections, weights, casts))

    @jax.custom_vjp
    def projected(x, weights, casts):
        return run(gather(x), weights, casts)

    def fwd(x, weights, casts):
        return run(gather(x), weights, casts), (x, weights, casts)

    def bwd(saved, cts):
        x, weights, casts = saved
        xg, pull_gather = jax.vjp(gather, x)
        _, pull = jax.vjp(run, xg, weights, casts)
        d_xg, d_weights, d_casts = pull(cts)
        return pull_gather(d_xg)[0], d_weights, d_casts

    projected.defvjp(fwd, bwd)
    weights = tuple(p.weights() for p in projections)
    return projected(x, weights, tuple(p.cast(w, fp8) for p, w in zip(projections, weights)))


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs):
        self.scale = param(rngs, jax.nn.initializers.ones, (cfg.hidden_size,), ("norm",),
                            jnp.dtype(cfg.param_dtype))
        self.eps = cfg.norm_eps
        self.compute_dtype = jnp.dtype(cfg.compute_dtype)

    def __call__(self, x_BSD):
        return rms_norm(x_BSD, self.scale[...], self.eps, self.compute_dtype)


def gather_sequence(constrain):
    """x -> x with every position of its context shard (the projections' input), from its
    SP shards."""
    return lambda x_BSD: constrain(x_BSD, ("batch", "sequence", "embed"))


def split_sequence(constrain):
    """y -> y in the residual stream's layout (split over the sequence under SP)."""
    return lambda y_BSD: constrain(y_BSD, ("batch", "length", "embed"))


def project_scattered(gather, scatter, x, projection, fp8: bool):
    """scatter(projection(x)): a row-parallel projection whose output joins the residual
    stream (reduce-scattered over the sequence under sequence parallelism). Its backward
    gathers the output's cotangent once for both of the projection's gradients (GSPMD left to
    itself gathers it once per gradient GEMM: 2 of the 8 sequence-sized all-gathers a layer
    would run). With `ops.collective_matmul` the GEMM and the scatter run as one ring."""
    if projection.ops.collective_matmul is not None:
        return projection.ops.collective_matmul.scattered(x, projection, fp8)
    weights = projection.weights()
    apply = lambda x_, w_: projection.apply(x_, w_, fp8)  # noqa: E731

    @jax.custom_vjp
    def projected(x, weights):
        return scatter(apply(x, weights))

    def fwd(x, weights):
        y, pull = jax.vjp(apply, x, weights)   # keeps what autodiff would keep
        return scatter(y), pull

    def bwd(pull, ct):
        return pull(gather(ct))

    projected.defvjp(fwd, bwd)
    return projected(x, weights)


def rms_norm(x_BSD, scale_D, eps: float, compute_dtype):
    """RMSNorm with its statistics in fp32 whatever the compute dtype."""
    @elementwise_recomputed
    def norm(x_BSD, scale_D):
        x = x_BSD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
        return (x * scale_D.astype(jnp.float32)).astype(compute_dtype)
    return norm(x_BSD, scale_D)
