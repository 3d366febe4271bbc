"""Flax routing of attention dropout and sinks (nnx and linen).

The kernels' dropout and sinks are tested in dropout_test.py and
sinks_test.py; here the XLA path (the same semantics and the same masks)
keeps the module tests fast.
"""

from unittest import mock

from absl.testing import absltest
import chex
from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import jflash
import jflash.linen
import jflash.nnx
from jflash._src import flax_adapter

FEATURES = 32
_STATIC = ("dropout_rate", "broadcast_dropout", "deterministic")


def _inputs(seed, shape=(2, 16, FEATURES)):
  # Drawn with NumPy: jax.random compiles a sampler for every new shape.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(
      shape, np.float32))


class AttentionFnTest(absltest.TestCase):

  def test_dropout_reaches_the_kernel_call(self):
    # Two batch dims, flattened to one by the adapter: the masks are those
    # of flash_attention on the flattened batch.
    q, k, v = (_inputs(i, (2, 3, 16, 4, 8)) for i in range(3))
    key = jax.random.key(7)
    fn = jax.jit(jflash.nnx.attention_fn(implementation="xla"),
                 static_argnames=_STATIC)
    out = fn(q, k, v, dropout_rng=key, dropout_rate=0.3,
             broadcast_dropout=False, deterministic=False)
    flat = lambda x: x.reshape(6, *x.shape[2:])
    flash = jax.jit(jflash.flash_attention, static_argnames=(
        "implementation", "dropout_rate", "broadcast_dropout"))
    expected = flash(
        flat(q), flat(k), flat(v), dropout_rate=0.3, dropout_rng=key,
        implementation="xla")
    chex.assert_trees_all_equal(out, expected.reshape(out.shape))
    # Deterministic: no dropout.
    plain = flash(flat(q), flat(k), flat(v),
                  implementation="xla").reshape(out.shape)
    chex.assert_trees_all_equal(
        fn(q, k, v, dropout_rng=key, dropout_rate=0.3, deterministic=True),
        plain)
    with self.assertRaisesRegex(ValueError, "dropout_rng is required"):
      fn(q, k, v, dropout_rate=0.3, deterministic=False)

  def test_deterministic_grads_reaches_flash_attention(self):
    # jflash's deterministic_grads, from attention_fn and both modules, to
    # flash_attention; Flax's deterministic (dropout) does not touch it.
    seen = []
    flash = flax_adapter.api.flash_attention

    def spy(*args, **kwargs):
      seen.append(kwargs["deterministic_grads"])
      return flash(*args, **kwargs)

    x = _inputs(9)
    q = x.reshape(2, 16, 4, 8)
    module_options = dict(num_heads=4, implementation="xla")
    with mock.patch.object(flax_adapter.api, "flash_attention", spy):
      jflash.nnx.attention_fn(implementation="xla")(q, q, q,
                                                    deterministic=False)
      jflash.nnx.attention_fn(implementation="xla",
                              deterministic_grads=False)(q, q, q)
      nnx_module = jflash.nnx.FlashMultiHeadAttention(
          in_features=FEATURES, decode=False, deterministic_grads=False,
          rngs=nnx.Rngs(0), **module_options)
      nnx_module(x)
      linen_module = jflash.linen.FlashMultiHeadDotProductAttention(
          deterministic_grads=False, **module_options)
      linen_module.apply(linen_module.init(jax.random.key(0), x), x)
    # The linen module runs twice (init and apply).
    self.assertEqual(seen, [True, False, False, False, False])

  def test_broadcast_dropout_shares_the_mask(self):
    # Identical batch elements and heads stay identical only when the mask
    # is shared.
    x = jnp.broadcast_to(_inputs(8, (1, 16, 1, 8)), (2, 16, 3, 8))
    fn = jax.jit(jflash.linen.attention_fn(implementation="xla"),
                 static_argnames=_STATIC)
    for broadcast in (True, False):
      out = fn(x, x, x, dropout_rng=jax.random.key(0), dropout_rate=0.5,
               broadcast_dropout=broadcast, deterministic=False)
      same = bool(jnp.all(out == out[:1, :, :1]))
      self.assertEqual(same, broadcast)

  def test_stock_modules_train_with_jflash_dropout(self):
    x = _inputs(9)
    nnx_layer = nnx.MultiHeadAttention(
        num_heads=4, in_features=FEATURES, dropout_rate=0.2, decode=False,
        attention_fn=jflash.nnx.attention_fn(implementation="xla"),
        rngs=nnx.Rngs(0, dropout=1))
    train, evaluate = (nnx.jit(lambda m, d=d: m(x, deterministic=d))(
        nnx_layer) for d in (False, True))
    self.assertGreater(float(jnp.max(jnp.abs(train - evaluate))), 1e-3)
    linen_layer = nn.MultiHeadDotProductAttention(
        num_heads=4, dropout_rate=0.2,
        attention_fn=jflash.linen.attention_fn(implementation="xla"))
    # Jitted: op by op, init runs (and compiles) every primitive alone.
    variables = jax.jit(lambda key: linen_layer.init(
        key, x, deterministic=True))(jax.random.key(0))
    apply = jax.jit(lambda seed: linen_layer.apply(
        variables, x, deterministic=False,
        rngs={"dropout": jax.random.key(seed)}))
    chex.assert_trees_all_equal(apply(1), apply(1))
    self.assertGreater(float(jnp.max(jnp.abs(apply(1) - apply(2)))), 1e-3)


class NnxModuleTest(absltest.TestCase):

  def test_dropout_uses_the_dropout_stream(self):
    make = lambda: jflash.nnx.FlashMultiHeadAttention(
        num_heads=4, in_features=FEATURES, dropout_rate=0.3, decode=False,
        implementation="xla", rngs=nnx.Rngs(0, dropout=5))
    x = _inputs(10)
    first, second = make(), make()
    # Jitted (nnx.jit carries the modules' rng streams in and out): op by
    # op, each call compiles every primitive alone.
    train = nnx.jit(lambda m: m(x, deterministic=False))
    chex.assert_trees_all_equal(train(first), train(second))
    # Training differs from evaluation; call-time rngs take precedence.
    self.assertGreater(float(jnp.max(jnp.abs(
        train(first) - nnx.jit(lambda m: m(x, deterministic=True))(second)))),
                       1e-3)
    with_rngs = nnx.jit(lambda m, rngs: m(x, deterministic=False, rngs=rngs))
    chex.assert_trees_all_equal(with_rngs(first, nnx.Rngs(dropout=3)),
                                with_rngs(second, nnx.Rngs(dropout=3)))
    no_rngs = jflash.nnx.FlashMultiHeadAttention(
        num_heads=4, in_features=FEATURES, dropout_rate=0.3, decode=False,
        implementation="xla", keep_rngs=False, rngs=nnx.Rngs(0))
    with self.assertRaisesRegex(ValueError, "rngs"):
      no_rngs(x, deterministic=False)

  def test_sinks_parameter(self):
    kwargs = dict(num_heads=4, in_features=FEATURES, num_kv_heads=2,
                  decode=False)
    stock = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
    ours = jflash.nnx.FlashMultiHeadAttention(
        **kwargs, use_sinks=True, implementation="xla", rngs=nnx.Rngs(1))
    self.assertEqual(ours.sinks.shape, (4,))
    np.testing.assert_array_equal(ours.sinks[...], 0.0)
    nnx.update(ours, nnx.state(stock, nnx.Param))
    x = _inputs(11)
    call = nnx.jit(lambda m: m(x, is_causal=True))
    # Zero sinks lower every attention weight, so the output changes; the
    # sinks are learnable.
    with jax.default_matmul_precision("highest"):
      expected = call(stock)
      self.assertGreater(float(jnp.max(jnp.abs(call(ours) - expected))),
                         1e-3)
      grads = nnx.jit(nnx.grad(lambda m: jnp.sum(call(m) ** 2)))(ours)
      self.assertGreater(float(jnp.max(jnp.abs(grads["sinks"][...]))), 0.0)
      # A -inf sink is no sink: the stock module's output.
      ours.sinks[...] = jnp.full((4,), -jnp.inf)
      chex.assert_trees_all_close(call(ours), expected, rtol=2e-5,
                                  atol=2e-5)


class LinenModuleTest(absltest.TestCase):

  def test_dropout_and_sinks(self):
    layer = jflash.linen.FlashMultiHeadDotProductAttention(
        num_heads=4, dropout_rate=0.3, use_sinks=True, implementation="xla")
    x = _inputs(12)
    # Every call jitted (as the stock modules' above): op by op, each call
    # compiles every primitive alone.
    variables = jax.jit(lambda key: layer.init(key, x, deterministic=True))(
        jax.random.key(0))
    np.testing.assert_array_equal(variables["params"]["sinks"],
                                  np.zeros(4))
    apply = lambda **kw: layer.apply(variables, x, deterministic=False, **kw)
    stream = jax.jit(lambda key: apply(rngs={"dropout": key}))
    chex.assert_trees_all_equal(stream(jax.random.key(1)),
                                stream(jax.random.key(1)))
    # An explicit dropout_rng takes precedence over the rng stream.
    explicit = jax.jit(lambda key: apply(dropout_rng=key))
    chex.assert_trees_all_equal(
        jax.jit(lambda stream_key, key: apply(
            rngs={"dropout": stream_key}, dropout_rng=key))(
                jax.random.key(1), jax.random.key(2)),
        explicit(jax.random.key(2)))
    evaluate = lambda v: layer.apply(v, x, deterministic=True)
    self.assertGreater(float(jnp.max(jnp.abs(
        explicit(jax.random.key(2)) - jax.jit(evaluate)(variables)))), 1e-3)
    grads = jax.jit(jax.grad(lambda v: jnp.sum(evaluate(v) ** 2)))(variables)
    self.assertGreater(float(jnp.max(jnp.abs(grads["params"]["sinks"]))),
                       0.0)


if __name__ == "__main__":
  absltest.main()
