"""jflash.linen against flax.linen.MultiHeadDotProductAttention."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import linen as nn
import jax
import jax.numpy as jnp

import jflash.linen
from tests import test_util


# The backend options of the modules under test. The kernels have their own
# tests, per backend (tests/test_base.py targets); these test the module
# around them (parameters, masks, the decode cache, transforms), which hands
# every backend the same call. On a GPU every test runs the compiled
# kernels. On CPU the kernels run in the Pallas interpreter, ~2 s of
# compilation per call (fwd + bwd): there the tests that pass KERNELS (a
# parity case, the decode steps) run them end to end, the others jflash's
# plain-JAX path.
KERNELS = dict(interpret=test_util.INTERPRET)
WIRING = KERNELS if test_util.ON_GPU else dict(implementation="xla")


def _inputs(seed, batch=2, length=24, features=32):
  return jax.random.normal(jax.random.key(seed), (batch, length, features))


class LinenTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    # The stock modules' float32 matmuls default to TF32 on GPUs (~1e-3
    # relative); jflash's float32 kernels are IEEE fp32. Compare both exact.
    self.enter_context(jax.default_matmul_precision("highest"))

  def _ours(self, backend=WIRING, **kwargs):
    """A jflash module on `backend` (KERNELS or WIRING)."""
    return jflash.linen.FlashMultiHeadDotProductAttention(**backend,
                                                           **kwargs)

  def _assert_same(self, call_stock, call_ours, variables, tol=2e-5):
    """Outputs and parameter gradients agree for the same variables."""
    call_stock, call_ours = jax.jit(call_stock), jax.jit(call_ours)
    chex.assert_trees_all_close(call_ours(variables), call_stock(variables),
                                rtol=tol, atol=tol)
    loss = lambda call: lambda v: jnp.sum(jnp.sin(call(v)))
    chex.assert_trees_all_close(jax.jit(jax.grad(loss(call_ours)))(variables),
                                jax.jit(jax.grad(loss(call_stock)))(variables),
                                rtol=tol, atol=tol)

  @parameterized.named_parameters(
      ("self_attention", {}, False, WIRING),
      # The interpreted kernels end to end on CPU.
      ("causal_normalize_qk_kernels", dict(normalize_qk=True), True, KERNELS),
      ("cross_attention", dict(out_features=8, qkv_features=64), False,
       WIRING),
  )
  def test_parity_with_stock_module(self, kwargs, is_causal, backend):
    kwargs = dict(num_heads=4) | kwargs
    stock, ours = nn.MultiHeadDotProductAttention(**kwargs), self._ours(
        backend, **kwargs)
    x = _inputs(1)
    context = _inputs(2, length=17) if "out_features" in kwargs else x
    variables = stock.init(jax.random.key(0), x, context)
    # Same parameter tree: the stock module's variables load unchanged.
    self.assertEqual(jax.tree.structure(variables),
                     jax.tree.structure(ours.init(jax.random.key(1), x,
                                                  context)))
    mask = nn.make_causal_mask(x[..., 0]) if is_causal else None
    self._assert_same(
        lambda v: stock.apply(v, x, context, mask=mask),
        lambda v: ours.apply(v, x, context, is_causal=is_causal), variables)

  def test_segment_ids_match_stock_segment_mask(self):
    stock, ours = nn.MultiHeadDotProductAttention(num_heads=4), self._ours(
        num_heads=4)
    x = _inputs(9)
    ids = jnp.array([[0] * 7 + [1] * 11 + [2] * 6, [4] * 19 + [3] * 5])
    mask = nn.make_attention_mask(ids, ids, pairwise_fn=jnp.equal)
    variables = stock.init(jax.random.key(0), x)
    self._assert_same(
        lambda v: stock.apply(v, x, mask=mask),
        lambda v: ours.apply(v, x, q_segment_ids=ids, kv_segment_ids=ids),
        variables)

  def test_attention_fn_in_stock_module(self):
    stock = nn.MultiHeadDotProductAttention(num_heads=4)
    plugged = nn.MultiHeadDotProductAttention(
        num_heads=4, attention_fn=jflash.linen.attention_fn(**WIRING))
    x = _inputs(3)
    variables = stock.init(jax.random.key(0), x)
    self._assert_same(lambda v: stock.apply(v, x),
                      lambda v: plugged.apply(v, x), variables)
    # linen filters keywords by signature: the mask must reach jflash, never
    # be silently dropped (here it changes the result).
    mask = nn.make_causal_mask(x[..., 0])
    self._assert_same(lambda v: stock.apply(v, x, mask=mask),
                      lambda v: plugged.apply(v, x, mask=mask), variables)
    with jax.default_matmul_precision("highest"):
      unmasked = stock.apply(variables, x)
      masked = stock.apply(variables, x, mask=mask)
    self.assertGreater(float(jnp.max(jnp.abs(unmasked - masked))), 1e-2)

  def test_decode_matches_full_causal_attention(self):
    # The interpreted kernels end to end on CPU (the decode steps').
    stock = nn.MultiHeadDotProductAttention(num_heads=4)
    ours = self._ours(KERNELS, num_heads=4, decode=True)
    x = _inputs(4, length=10)
    params = stock.init(jax.random.key(0), x)["params"]
    cache = ours.init(jax.random.key(0), x)["cache"]
    step = jax.jit(lambda params, cache, token: ours.apply(
        {"params": params, "cache": cache}, token, mutable=["cache"]))
    steps = []
    for t in range(10):
      out, updates = step(params, cache, x[:, t:t + 1])
      cache = updates["cache"]
      steps.append(out)
    expected = stock.apply({"params": params}, x,
                           mask=nn.make_causal_mask(x[..., 0]))
    chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), expected,
                                rtol=2e-5, atol=2e-5)
    chex.assert_trees_all_equal(cache["cache_index"], jnp.array([10, 10]))

  def test_jit_and_vmap_of_apply(self):
    ours = self._ours(num_heads=4)
    xs = jnp.stack([_inputs(5), _inputs(6)])
    variables = ours.init(jax.random.key(0), xs[0])
    apply = lambda v, x: ours.apply(v, x, is_causal=True)
    expected = jnp.stack([apply(variables, x) for x in xs])
    chex.assert_trees_all_close(jax.jit(apply)(variables, xs[0]), expected[0],
                                rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(
        jax.jit(jax.vmap(apply, in_axes=(None, 0)))(variables, xs), expected,
        rtol=1e-5, atol=1e-5)

  def test_mixed_precision(self):
    kwargs = dict(num_heads=4, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    stock, ours = nn.MultiHeadDotProductAttention(**kwargs), self._ours(
        **kwargs)
    x = _inputs(7)
    variables = stock.init(jax.random.key(0), x)
    out = ours.apply(variables, x)
    self.assertEqual(out.dtype, jnp.bfloat16)
    chex.assert_trees_all_close(out.astype(jnp.float32),
                                stock.apply(variables, x).astype(jnp.float32),
                                rtol=0.05, atol=0.05)

  def test_unsupported_options_raise(self):
    ours = self._ours(num_heads=4)
    x = _inputs(8)
    variables = ours.init(jax.random.key(0), x)
    with self.assertRaisesRegex(NotImplementedError, "sow"):
      ours.apply(variables, x, sow_weights=True)
    with self.assertRaisesRegex(ValueError, "attention_fn"):
      self._ours(num_heads=4, attention_fn=jax.nn.dot_product_attention
                 ).init(jax.random.key(0), x)


if __name__ == "__main__":
  absltest.main()
