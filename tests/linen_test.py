"""jflash.linen against flax.linen.MultiHeadDotProductAttention."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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
  # Drawn with NumPy: jax.random compiles a sampler for every new shape.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(
      (batch, length, features), np.float32))


def _split_options(kwargs):
  """A call's keyword arguments: (arrays, the rest as hashable pairs);
  None values are left out (the default of every option here)."""
  arrays = {k: v for k, v in kwargs.items()
            if isinstance(v, (jax.Array, np.ndarray))}
  static = tuple(sorted((k, v) for k, v in kwargs.items()
                        if k not in arrays and v is not None))
  return arrays, static


# Module-level jitted programs, the modules (hashable, compared by their
# fields) and the call's options static: the same modules, shapes and
# options in several tests reuse one trace and compilation.
@functools.partial(jax.jit, static_argnums=0)
def _init(module, key, *args):
  # Op by op, init runs (and compiles) every primitive of a call alone.
  return module.init(key, *args)


def _apply_and_grads(module, variables, args, arrays, static):
  """The output of the call and the gradients of sum(sin(output)) with
  respect to the variables."""

  def loss(v):
    out = module.apply(v, *args, **arrays, **dict(static))
    return jnp.sum(jnp.sin(out)), out

  (_, out), grads = jax.value_and_grad(loss, has_aux=True)(variables)
  return out, grads


@functools.partial(jax.jit, static_argnums=(0, 1, 6, 7, 8))
def _both_apply_and_grads(stock, ours, variables, args, stock_arrays,
                          ours_arrays, stock_static, ours_static, kernels):
  """_apply_and_grads of both modules, in one program (each program
  compiled costs ~0.4 s of CPU besides its size); with `kernels`, ours's
  forward alone as well: the kernels' forward pass without residuals."""
  results = (
      _apply_and_grads(stock, variables, args, stock_arrays, stock_static),
      _apply_and_grads(ours, variables, args, ours_arrays, ours_static))
  if kernels:
    results += (ours.apply(variables, *args, **ours_arrays,
                           **dict(ours_static)),)
  return results


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

  def _assert_same(self, stock, ours, variables, args, stock_kwargs,
                   ours_kwargs=None, *, kernels=WIRING is KERNELS, tol=2e-5):
    """stock.apply(variables, *args, **stock_kwargs) and the same call of
    ours (with ours_kwargs, default the same) agree: outputs, and the
    gradients of sum(sin(output)) with respect to the variables.

    Both modules' outputs and gradients come from one jitted program. With
    `kernels` (ours runs the kernels: KERNELS, and WIRING on a GPU), ours
    also runs its forward alone, the kernels' forward pass without
    residuals. Returns the stock module's output.
    """
    ours_kwargs = stock_kwargs if ours_kwargs is None else ours_kwargs
    stock_arrays, stock_static = _split_options(stock_kwargs)
    ours_arrays, ours_static = _split_options(ours_kwargs)
    (out_stock, grads_stock), (out_ours, grads_ours), *forward = (
        _both_apply_and_grads(stock, ours, variables, args, stock_arrays,
                              ours_arrays, stock_static, ours_static,
                              kernels))
    outs_ours = [out_ours, *forward]
    for out in outs_ours:
      chex.assert_trees_all_close(out, out_stock, rtol=tol, atol=tol)
    chex.assert_trees_all_close(grads_ours, grads_stock, rtol=tol, atol=tol)
    return out_stock

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
    # Self-attention: the key inputs default to x.
    args = (x, _inputs(2, length=17)) if "out_features" in kwargs else (x,)
    variables = _init(stock, jax.random.key(0), *args)
    # Same parameter tree: the stock module's variables load unchanged.
    self.assertEqual(jax.tree.structure(variables), jax.tree.structure(
        jax.eval_shape(ours.init, jax.random.key(1), *args)))
    mask = nn.make_causal_mask(x[..., 0]) if is_causal else None
    self._assert_same(stock, ours, variables, args, dict(mask=mask),
                      dict(is_causal=is_causal), kernels=backend is KERNELS)

  def test_segment_ids_match_stock_segment_mask(self):
    stock, ours = nn.MultiHeadDotProductAttention(num_heads=4), self._ours(
        num_heads=4)
    x = _inputs(9)
    ids = jnp.array([[0] * 7 + [1] * 11 + [2] * 6, [4] * 19 + [3] * 5])
    mask = nn.make_attention_mask(ids, ids, pairwise_fn=jnp.equal)
    variables = _init(stock, jax.random.key(0), x)
    self._assert_same(stock, ours, variables, (x,), dict(mask=mask),
                      dict(q_segment_ids=ids, kv_segment_ids=ids))

  def test_attention_fn_in_stock_module(self):
    stock = nn.MultiHeadDotProductAttention(num_heads=4)
    plugged = nn.MultiHeadDotProductAttention(
        num_heads=4, attention_fn=jflash.linen.attention_fn(**WIRING))
    x = _inputs(3)
    variables = _init(stock, jax.random.key(0), x)
    # The same programs as the self-attention parity case's (jflash's module
    # and the stock one with jflash's attention_fn give the same program).
    unmasked = self._assert_same(stock, plugged, variables, (x,), {})
    # linen filters keywords by signature: the mask must reach jflash, never
    # be silently dropped (here it changes the result).
    mask = nn.make_causal_mask(x[..., 0])
    masked = self._assert_same(stock, plugged, variables, (x,),
                               dict(mask=mask))
    self.assertGreater(float(jnp.max(jnp.abs(unmasked - masked))), 1e-2)

  def test_decode_matches_full_causal_attention(self):
    # The interpreted kernels end to end on CPU (the decode steps').
    stock = nn.MultiHeadDotProductAttention(num_heads=4)
    ours = self._ours(KERNELS, num_heads=4, decode=True)
    x = _inputs(4, length=10)
    params = _init(stock, jax.random.key(0), x)["params"]
    # Only the cache out of init: its attention pass (the interpreted
    # kernels, ~2 s of compilation) is dead code then, never compiled.
    cache = jax.jit(lambda key, x: ours.init(key, x)["cache"])(
        jax.random.key(0), x)
    step = jax.jit(lambda params, cache, token: ours.apply(
        {"params": params, "cache": cache}, token, mutable=["cache"]))
    steps = []
    for t in range(10):
      out, updates = step(params, cache, x[:, t:t + 1])
      cache = updates["cache"]
      steps.append(out)
    # Jitted: op by op, each primitive compiles alone.
    expected = jax.jit(lambda params: stock.apply(
        {"params": params}, x, mask=nn.make_causal_mask(x[..., 0])))(params)
    chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), expected,
                                rtol=2e-5, atol=2e-5)
    chex.assert_trees_all_equal(cache["cache_index"], jnp.array([10, 10]))

  def test_jit_and_vmap_of_apply(self):
    ours = self._ours(num_heads=4)
    xs = jnp.stack([_inputs(5), _inputs(6)])
    variables = _init(ours, jax.random.key(0), xs[0])
    apply = lambda v, x: ours.apply(v, x, is_causal=True)
    # Op by op: the reference of the jitted calls.
    expected = jnp.stack([apply(variables, x) for x in xs])
    # The call and its vmap in one jitted program.
    jitted, vmapped = jax.jit(lambda v, xs: (
        apply(v, xs[0]), jax.vmap(apply, in_axes=(None, 0))(v, xs)))(
            variables, xs)
    chex.assert_trees_all_close(jitted, expected[0], rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(vmapped, expected, rtol=1e-5, atol=1e-5)

  def test_mixed_precision(self):
    kwargs = dict(num_heads=4, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    stock, ours = nn.MultiHeadDotProductAttention(**kwargs), self._ours(
        **kwargs)
    x = _inputs(7)
    variables = _init(stock, jax.random.key(0), x)
    # Both calls in one jitted program (op by op, each primitive compiles
    # alone).
    out, expected = jax.jit(lambda v: (ours.apply(v, x), stock.apply(v, x)))(
        variables)
    self.assertEqual(out.dtype, jnp.bfloat16)
    chex.assert_trees_all_close(out.astype(jnp.float32),
                                expected.astype(jnp.float32), rtol=0.05,
                                atol=0.05)

  def test_unsupported_options_raise(self):
    ours = self._ours(num_heads=4)
    x = _inputs(8)
    variables = _init(ours, jax.random.key(0), x)
    with self.assertRaisesRegex(NotImplementedError, "sow"):
      ours.apply(variables, x, sow_weights=True)
    with self.assertRaisesRegex(ValueError, "attention_fn"):
      self._ours(num_heads=4, attention_fn=jax.nn.dot_product_attention
                 ).init(jax.random.key(0), x)


if __name__ == "__main__":
  absltest.main()
