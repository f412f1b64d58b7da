import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.model import llama as model_lib
from jaxtrain.config import ModelConfig, RopeScaling

CFG = ModelConfig(vocab_size=384, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  mlp_size=128, max_seq_len=64, compute_dtype="float32",
                  rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=16))


class _Jitted:
    """The model's forward under one jit (eager NNX is slow on a loaded CPU)."""

    def __init__(self, model):
        self.graphdef, self.state = nnx.split(model)
        self.fn = jax.jit(lambda st, *a: nnx.merge(self.graphdef, st)(*a))

    def __call__(self, *args):
        return self.fn(self.state, *args)


def _model(cfg=CFG, **kw):
    return _Jitted(model_lib.Llama(cfg, rngs=nnx.Rngs(0), **kw))


def test_logits_at_i_do_not_depend_on_later_tokens():
    model = _model()
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 256)
    changed = tokens.at[:, 12:].set((tokens[:, 12:] + 7) % 256)
    a, b = model(tokens), model(changed)
    np.testing.assert_allclose(a[:, :12], b[:, :12], atol=1e-6)
    assert np.abs(np.asarray(a[:, 12:] - b[:, 12:])).max() > 1e-3  # the test can fail


def test_packed_documents_do_not_attend_across_the_boundary():
    model = _model()
    s = 24
    tokens = jax.random.randint(jax.random.key(2), (1, s), 0, 256)
    segment_ids = jnp.asarray([[1] * 10 + [2] * 14])
    positions = jnp.asarray([list(range(10)) + list(range(14))])
    packed = model(tokens, positions, segment_ids)
    # Document 2 alone gives the same logits as inside the pack...
    alone = model(tokens[:, 10:])
    np.testing.assert_allclose(packed[:, 10:], alone, atol=2e-5)
    # ...and changing document 1 leaves document 2 untouched.
    other = tokens.at[:, :10].set((tokens[:, :10] + 3) % 256)
    np.testing.assert_allclose(model(other, positions, segment_ids)[:, 10:], packed[:, 10:],
                               atol=1e-6)
    # Without segment ids the two documents do mix: the check above is not vacuous.
    mixed = model(tokens, positions)
    assert np.abs(np.asarray(mixed[:, 10:] - packed[:, 10:])).max() > 1e-4


def test_params_carry_logical_axes_and_stack_layers():
    _, state = nnx.split(nnx.eval_shape(lambda: model_lib.Llama(CFG, rngs=nnx.Rngs(0))))
    from jaxtrain.parallel.sharding import logical_axes
    axes = logical_axes(state)
    assert tuple(axes["blocks"]["attn"]["wq"]["kernel"]) == ("layers", "embed", "heads", "head_dim")
    assert tuple(axes["embed"]) == ("vocab", "embed")
    assert nnx.to_pure_dict(state)["blocks"]["mlp"]["w_up"]["kernel"].shape == (2, 64, 128)


def test_llama31_rope_scaling_changes_low_frequencies_only():
    plain = model_lib.rope_frequencies(ModelConfig(rope_theta=500000.0, head_dim=128,
                                                   num_heads=8, hidden_size=1024))
    scaled = model_lib.rope_frequencies(ModelConfig(rope_theta=500000.0, head_dim=128,
                                                    num_heads=8, hidden_size=1024,
                                                    rope_scaling=RopeScaling()))
    assert scaled[0] == plain[0]                      # high frequency: untouched
    np.testing.assert_allclose(scaled[-1], plain[-1] / 8.0, rtol=1e-6)  # low: divided by factor


def test_padded_vocab_is_masked_out_of_the_loss():
    padded = ModelConfig(**{**CFG.__dict__, "vocab_size": 512})
    model = _model(padded, real_vocab=300)
    logits = model(jnp.zeros((1, 8), jnp.int32))
    assert logits.shape[-1] == 512
    assert np.all(np.asarray(logits[..., 300:]) < -1e29)


def test_padding_changes_no_drawn_weight():
    """The same seed draws the same model at every padded vocab size (tensor degree): the real
    rows as an unpadded model draws them, zero padding, every later parameter unchanged."""
    def params(vocab):
        cfg = ModelConfig(**{**CFG.__dict__, "vocab_size": vocab})
        model = model_lib.Llama(cfg, rngs=nnx.Rngs(0), real_vocab=300)
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))
    plain, padded = params(300), params(512)
    np.testing.assert_array_equal(padded["embed"][:300], plain["embed"])
    np.testing.assert_array_equal(padded["lm_head"][:, :300], plain["lm_head"])
    assert not np.any(padded["embed"][300:]) and not np.any(padded["lm_head"][:, 300:])
    rest = lambda p: {k: v for k, v in p.items() if k not in ("embed", "lm_head")}  # noqa: E731
    jax.tree.map(np.testing.assert_array_equal, rest(padded), rest(plain))


def test_bf16_compute_keeps_fp32_logits_and_params():
    cfg = ModelConfig(**{**CFG.__dict__, "compute_dtype": "bfloat16"})
    model = _model(cfg)
    assert model.state["embed"][...].dtype == jnp.float32
    assert model(jnp.zeros((1, 8), jnp.int32)).dtype == jnp.float32
