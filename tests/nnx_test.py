"""jflash.nnx against flax.nnx.MultiHeadAttention, by copying parameters."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import jflash
import jflash.nnx
from tests import test_util

FEATURES = 32

# The backend options of the modules under test. The kernels have their own
# tests, per backend (tests/test_base.py targets); these test the modules
# around them (parameters, masks, the decode cache, transforms), which hand
# every backend the same call. On a GPU every test runs the compiled
# kernels. On CPU the kernels run in the Pallas interpreter, ~2 s of
# compilation per call (fwd + bwd): there the tests that pass KERNELS (a
# parity case, the decode steps) run them end to end, the others jflash's
# plain-JAX path.
KERNELS = dict(interpret=test_util.INTERPRET)
WIRING = KERNELS if test_util.ON_GPU else dict(implementation="xla")


def _inputs(seed, batch=2, length=24, features=FEATURES, dtype=jnp.float32):
  # Drawn with NumPy: jax.random compiles a sampler for every new shape.
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal((batch, length, features),
                                         np.float32), dtype)


def _split_options(kwargs):
  """A call's keyword arguments: (arrays, the rest as hashable pairs)."""
  arrays = {k: v for k, v in kwargs.items()
            if isinstance(v, (jax.Array, np.ndarray))}
  static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))
  return arrays, static


def _forward_and_grads(module, args, arrays, cotangent, static):
  """The output of the call and the parameter gradients of
  sum(output * cotangent)."""

  def loss(m):
    out = m(*args, **arrays, **dict(static))
    return jnp.sum(out * cotangent), out

  (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(module)
  return out, grads


@functools.partial(nnx.jit,
                   static_argnames=("stock_static", "ours_static", "kernels"))
def _both_forward_and_grads(stock, ours, args, stock_arrays, ours_arrays,
                            cotangent, stock_static, ours_static, kernels):
  """_forward_and_grads of both modules, in one program (each program
  compiled costs ~0.4 s of CPU besides its size); with `kernels`, ours's
  forward alone as well: the kernels' forward pass without residuals."""
  results = (
      _forward_and_grads(stock, args, stock_arrays, cotangent, stock_static),
      _forward_and_grads(ours, args, ours_arrays, cotangent, ours_static))
  if kernels:
    results += (ours(*args, **ours_arrays, **dict(ours_static)),)
  return results


class NnxTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    # The stock modules' float32 matmuls default to TF32 on GPUs (~1e-3
    # relative); jflash's float32 kernels are IEEE fp32. Compare both exact.
    self.enter_context(jax.default_matmul_precision("highest"))

  def _pair(self, backend=WIRING, **kwargs):
    """A stock module and a jflash module (on `backend`: KERNELS or
    WIRING) holding the same parameters."""
    kwargs = dict(num_heads=4, in_features=FEATURES, decode=False) | kwargs
    stock = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
    ours = jflash.nnx.FlashMultiHeadAttention(**kwargs, **backend,
                                              rngs=nnx.Rngs(1))
    self.assertEqual(
        jax.tree.structure(nnx.state(stock, nnx.Param)),
        jax.tree.structure(nnx.state(ours, nnx.Param)))
    nnx.update(ours, nnx.state(stock, nnx.Param))
    return stock, ours

  def _assert_same_outputs_and_grads(self, stock, ours, args, stock_kwargs,
                                     ours_kwargs=None, *, keep=None,
                                     kernels=WIRING is KERNELS, tol=2e-5):
    """stock(*args, **stock_kwargs) and ours(*args, **ours_kwargs) (default:
    the same keywords) give the same outputs and parameter gradients.

    Both modules' outputs and gradients come from one jitted program (op by
    op, the stock module's gradient alone costs ~3 s of CPU). With
    `kernels` (ours runs the kernels: KERNELS, and WIRING on a GPU), ours
    also runs its forward alone, the kernels' forward pass without
    residuals. `keep` (0/1, broadcast to the output) selects what is
    compared: outputs times keep, and the gradients that keep * output
    induces.
    """
    ours_kwargs = stock_kwargs if ours_kwargs is None else ours_kwargs
    stock_arrays, stock_static = _split_options(stock_kwargs)
    ours_arrays, ours_static = _split_options(ours_kwargs)
    shape = (*args[0].shape[:-1], stock.out_features)
    cotangent = jnp.asarray(
        np.random.default_rng(9).standard_normal(shape, np.float32))
    if keep is not None:
      cotangent = cotangent * keep
    (out_stock, grads_stock), (out_ours, grads_ours), *forward = (
        _both_forward_and_grads(stock, ours, args, stock_arrays, ours_arrays,
                                cotangent, stock_static, ours_static,
                                kernels))
    outs_ours = [out_ours, *forward]
    masked = (lambda out: out) if keep is None else (lambda out: out * keep)
    for out in outs_ours:
      chex.assert_trees_all_close(masked(out), masked(out_stock), rtol=tol,
                                  atol=tol)
    chex.assert_trees_all_close(nnx.state(grads_ours), nnx.state(grads_stock),
                                rtol=tol, atol=tol)

  @parameterized.named_parameters(
      ("mha", {}, False, False, WIRING),
      ("mha_causal", {}, True, False, WIRING),
      # The interpreted kernels end to end on CPU.
      ("gqa_causal_kernels", dict(num_kv_heads=2), True, False, KERNELS),
      ("mqa", dict(num_kv_heads=1, qkv_features=64), False, False, WIRING),
      ("normalize_qk_no_bias", dict(normalize_qk=True, use_bias=False), True,
       False, WIRING),
      ("cross_attention", dict(in_kv_features=16, out_features=8), False,
       True, WIRING),
  )
  def test_parity_with_stock_module(self, kwargs, is_causal, cross, backend):
    stock, ours = self._pair(backend, **kwargs)
    args = (_inputs(1),)
    if cross:
      args += (_inputs(2, length=17, features=16),)
    self._assert_same_outputs_and_grads(
        stock, ours, args, dict(is_causal=is_causal),
        kernels=backend is KERNELS)

  def test_padding_lengths_match_stock_padding_mask(self):
    stock, ours = self._pair(num_kv_heads=2)
    x = _inputs(3)
    q_lens, kv_lens = jnp.array([24, 9]), jnp.array([20, 9])
    positions = jnp.arange(24)
    q_valid = positions[None] < q_lens[:, None]
    kv_valid = positions[None] < kv_lens[:, None]
    mask = nnx.make_attention_mask(q_valid, kv_valid)
    # Rows past q_len: jflash outputs 0, the stock module averages all
    # values; compare the valid rows (and the gradients they induce).
    keep = q_valid[..., None].astype(jnp.float32)
    self._assert_same_outputs_and_grads(
        stock, ours, (x,), dict(mask=mask),
        dict(query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens),
        keep=keep)

  def test_segment_ids_match_stock_segment_mask(self):
    # Two packed batch elements, segments of odd lengths, causal within each.
    stock, ours = self._pair(num_kv_heads=2)
    x = _inputs(13)
    ids = jnp.array([[0] * 7 + [1] * 11 + [2] * 6, [4] * 19 + [3] * 5])
    mask = nnx.combine_masks(
        nnx.make_attention_mask(ids, ids, pairwise_fn=jnp.equal),
        nnx.make_causal_mask(x[..., 0]))
    self._assert_same_outputs_and_grads(
        stock, ours, (x,), dict(mask=mask),
        dict(is_causal=True, q_segment_ids=ids, kv_segment_ids=ids))
    ours.init_cache(x.shape)
    with self.assertRaisesRegex(ValueError, "Segment ids.*decode"):
      ours(x[:, :1], decode=True, q_segment_ids=ids[:, :1],
           kv_segment_ids=ids)

  def test_dense_mask_matches_stock_module(self):
    # A random mask per (batch, head) that leaves every row a visible key
    # (rows without one differ by design: jflash gives 0, Flax the mean).
    # The interpreted kernels end to end on CPU: their dense-mask tiles.
    stock, ours = self._pair(KERNELS, num_kv_heads=2)
    x = _inputs(14)
    mask = np.random.default_rng(15).random((2, 4, 24, 24)) < 0.7
    mask[..., 0] = True
    self._assert_same_outputs_and_grads(stock, ours, (x,),
                                        dict(mask=jnp.asarray(mask)),
                                        kernels=True)

  def test_attention_fn_in_stock_module(self):
    stock = nnx.MultiHeadAttention(num_heads=4, in_features=FEATURES,
                                   num_kv_heads=2, decode=False,
                                   rngs=nnx.Rngs(0))
    plugged = nnx.MultiHeadAttention(
        num_heads=4, in_features=FEATURES, num_kv_heads=2, decode=False,
        attention_fn=jflash.nnx.attention_fn(**WIRING),
        rngs=nnx.Rngs(0))
    self._assert_same_outputs_and_grads(stock, plugged, (_inputs(4),),
                                        dict(is_causal=True))

  @parameterized.named_parameters(("mha", 4), ("gqa", 2))
  def test_decode_matches_full_causal_attention(self, num_kv_heads):
    _, ours = self._pair(num_kv_heads=num_kv_heads)
    x = _inputs(5, length=12)
    full = nnx.jit(lambda m, x: m(x, is_causal=True))(ours, x)
    ours.init_cache(x.shape)
    step = nnx.jit(lambda m, token: m(token, decode=True))
    steps = [step(ours, x[:, t:t + 1]) for t in range(12)]
    chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), full,
                                rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(ours.cache_index[...], [12, 12])

  def test_decode_steps_run_on_the_decode_kernel(self):
    # implementation=None sends a decode step to the split-K decode kernel
    # (here from any cache length: its 2048-key threshold lowered), with the
    # same results as full causal attention (the kernels'). The interpreted
    # kernels end to end on CPU.
    _, ours = self._pair(KERNELS, num_kv_heads=2)
    x = _inputs(6, length=12)
    full = nnx.jit(lambda m, x: m(x, is_causal=True))(ours, x)
    ours.init_cache(x.shape)
    with test_util.decode_kernel_spy() as kernel_calls:
      step = nnx.jit(lambda m, token: m(token, decode=True))
      steps = [step(ours, x[:, t:t + 1]) for t in range(12)]
    self.assertGreater(kernel_calls.call_count, 0)
    chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), full,
                                rtol=2e-5, atol=2e-5)

  def test_decode_cache_has_a_length_per_batch_element(self):
    _, ours = self._pair()
    x = _inputs(6, length=8)
    ours.init_cache((2, 8, FEATURES))
    step = nnx.jit(lambda m, token: m(token, decode=True))
    for t in range(5):
      step(ours, x[:, t:t + 1])
    # Element 1 rolls back to 3 tokens (e.g. a rejected draft); element 0
    # keeps its 5. The next token must see 6 and 4 positions respectively.
    ours.cache_index[...] = jnp.array([5, 3], jnp.int32)
    token = _inputs(7, length=1)
    step = step(ours, token)
    lengths = (5, 3)
    sequences = [jnp.concatenate([x[b:b + 1, :length], token[b:b + 1]], 1)
                 for b, length in enumerate(lengths)]
    # Both full forward passes in one jitted program (op by op, each
    # primitive compiles alone).
    expected = nnx.jit(lambda m, sequences: [
        m(sequence, is_causal=True, decode=False)[:, -1]
        for sequence in sequences])(ours, sequences)
    for b in range(len(lengths)):
      chex.assert_trees_all_close(step[b:b + 1, 0], expected[b], rtol=2e-5,
                                  atol=2e-5)

  def test_transforms(self):
    _, ours = self._pair(num_kv_heads=2)
    xs = jnp.stack([_inputs(8), _inputs(9)])  # [2, batch, length, features]
    call = lambda m, x: m(x, is_causal=True)
    # Op by op: the reference of the jitted call.
    expected = jnp.stack([call(ours, x) for x in xs])
    loss = lambda m, x: jnp.sum(call(m, x) ** 2)
    # The call, vmap, grad and remat in one jitted program (op by op, vmap,
    # grad and remat compiled ~130 primitives alone).
    jitted, vmapped, grads, remat_grads = nnx.jit(lambda m, xs: (
        call(m, xs[0]), nnx.vmap(call, in_axes=(None, 0))(m, xs),
        nnx.grad(loss)(m, xs[0]), nnx.grad(nnx.remat(loss))(m, xs[0])))(
            ours, xs)
    chex.assert_trees_all_close(jitted, expected[0], rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(vmapped, expected, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(nnx.state(remat_grads), nnx.state(grads),
                                rtol=1e-5, atol=1e-5)
    chex.assert_tree_all_finite(nnx.state(grads))

  def test_mixed_precision(self):
    stock, ours = self._pair(dtype=jnp.bfloat16, param_dtype=jnp.float32)
    x = _inputs(10)
    # Both calls in one jitted program (op by op, each primitive compiles
    # alone).
    out, expected = nnx.jit(lambda ours, stock: (
        ours(x, is_causal=True), stock(x, is_causal=True)))(ours, stock)
    self.assertEqual(out.dtype, jnp.bfloat16)
    self.assertEqual(ours.query.kernel.dtype, jnp.float32)
    chex.assert_trees_all_close(out.astype(jnp.float32),
                                expected.astype(jnp.float32), rtol=0.05,
                                atol=0.05)

  def test_soft_cap_matches_the_function(self):
    _, ours = self._pair()
    capped = jflash.nnx.FlashMultiHeadAttention(
        num_heads=4, in_features=FEATURES, decode=False, logits_soft_cap=0.5,
        **WIRING, rngs=nnx.Rngs(1))
    nnx.update(capped, nnx.state(ours, nnx.Param))
    x = _inputs(13)
    # All three in one jitted program (op by op, each primitive compiles
    # alone).
    got, uncapped, expected = nnx.jit(lambda capped, m: (
        capped(x, is_causal=True), m(x, is_causal=True),
        m.out(jflash.flash_attention(
            m.query(x), m.key(x), m.value(x), is_causal=True,
            logits_soft_cap=0.5, implementation="xla"))))(capped, ours)
    chex.assert_trees_all_close(got, expected, rtol=2e-5, atol=2e-5)
    # The cap changes the result (0.5 is far below these logits).
    self.assertGreater(float(jnp.max(jnp.abs(uncapped - expected))), 1e-3)

  def test_sliding_window_decode_matches_full_attention(self):
    _, ours = self._pair(num_kv_heads=2)
    windowed = jflash.nnx.FlashMultiHeadAttention(
        num_heads=4, in_features=FEATURES, num_kv_heads=2, decode=False,
        local_window_size=(3, 0), **WIRING, rngs=nnx.Rngs(1))
    nnx.update(windowed, nnx.state(ours, nnx.Param))
    x = _inputs(14, length=10)
    # With the reference, in one jitted program (op by op, each primitive
    # compiles alone).
    full, expected = nnx.jit(lambda windowed, m: (
        windowed(x, is_causal=True),
        m.out(jax.nn.dot_product_attention(
            m.query(x), m.key(x), m.value(x), is_causal=True,
            local_window_size=(3, 0)))))(windowed, ours)
    chex.assert_trees_all_close(full, expected, rtol=2e-5, atol=2e-5)
    windowed.init_cache(x.shape)
    step = nnx.jit(lambda m, token: m(token, decode=True))
    steps = [step(windowed, x[:, t:t + 1]) for t in range(10)]
    chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), full,
                                rtol=2e-5, atol=2e-5)

  def test_unsupported_options_raise(self):
    _, ours = self._pair()
    x = _inputs(11)
    with self.assertRaisesRegex(NotImplementedError, "sow"):
      ours(x, sow_weights=True)
    with self.assertRaisesRegex(NotImplementedError, "input_positions"):
      ours(x, input_positions=jnp.arange(24)[None])
    with self.assertRaisesRegex(ValueError, "init_cache"):
      ours(x[:, :1], decode=True)
    ours.init_cache(x.shape)
    with self.assertRaisesRegex(ValueError, "one token"):
      ours(x[:, :2], decode=True)
    with self.assertRaisesRegex(NotImplementedError, "dense mask"):
      ours(x[:, :1], decode=True, mask=jnp.ones((2, 1, 1, 24), bool))
    with self.assertRaisesRegex(ValueError, "attention_fn"):
      jflash.nnx.FlashMultiHeadAttention(
          num_heads=4, in_features=FEATURES, attention_fn=lambda *a: a,
          rngs=nnx.Rngs(0))

  def test_stock_module_with_attention_fn_does_not_drop_the_mask(self):
    stock, _ = self._pair()
    plugged = nnx.MultiHeadAttention(
        num_heads=4, in_features=FEATURES, decode=False,
        attention_fn=jflash.nnx.attention_fn(**WIRING),
        rngs=nnx.Rngs(0))
    nnx.update(plugged, nnx.state(stock, nnx.Param))
    x = _inputs(12)
    mask = nnx.make_causal_mask(x[..., 0])
    # The three calls in one jitted program (op by op, each primitive
    # compiles alone).
    with jax.default_matmul_precision("highest"):
      expected, unmasked, got = nnx.jit(lambda stock, plugged: (
          stock(x, mask=mask), stock(x), plugged(x, mask=mask)))(stock,
                                                                 plugged)
    chex.assert_trees_all_close(got, expected, rtol=2e-5, atol=2e-5)
    # The mask matters here, so a dropped mask could not pass the check.
    self.assertGreater(float(jnp.max(jnp.abs(unmasked - expected))), 1e-2)
    with self.assertRaisesRegex(NotImplementedError, "sow"):
      plugged(x, sow_weights=True)


if __name__ == "__main__":
  absltest.main()
