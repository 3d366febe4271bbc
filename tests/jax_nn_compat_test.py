"""Code written for jax.nn.dot_product_attention runs unchanged on jflash.

Each case calls `jflash.flash_attention` exactly as it would call jax.nn
(positional bias and mask, jax.nn's keywords, its dtypes, under vmap and
grad), per backend (test_base.py), and compares with jax.nn where jax.nn is
right, or with a float32 formulation where jflash deliberately differs (the
lse's gradient, which jax.nn stops). The differences that remain are listed
in README.md ("Differences from jax.nn").
"""

import functools
from unittest import mock
import warnings

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import jflash
from jflash._src import registry
from tests import test_base
from tests import test_util

B, T, S, N, K, H = 2, 40, 48, 4, 2, 32


def _masks(seed: int):
  """A bias and a mask of jax.nn's shapes (mask keeps the diagonal)."""
  keys = jax.random.split(jax.random.key(seed))
  bias = jax.random.normal(keys[0], (B, N, T, S))
  mask = jnp.logical_or(jax.random.uniform(keys[1], (B, 1, T, S)) > 0.3,
                        jnp.eye(T, S, dtype=bool)[None, None])
  return bias, mask


def _exact_attention_with_lse(q, k, v, *, is_causal=False,
                              dtype=jnp.float32):
  """out and the natural lse [B, T, N] in `dtype` at HIGHEST: the reference
  for jflash's differentiable lse and for float64 (every row sees a key
  here)."""
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  group = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
  logits = jnp.einsum("btnh,bsnh->bnts", q, k,
                      precision=jax.lax.Precision.HIGHEST)
  logits = logits / np.sqrt(q.shape[-1])
  if is_causal:
    rows = jnp.arange(q.shape[1])[:, None]
    cols = jnp.arange(k.shape[1])[None, :]
    logits = jnp.where((cols <= rows)[None, None], logits, -jnp.inf)
  lse = jax.nn.logsumexp(logits, axis=-1)
  probs = jnp.exp(logits - lse[..., None])
  out = jnp.einsum("bnts,bsnh->btnh", probs, v,
                   precision=jax.lax.Precision.HIGHEST)
  return out, jnp.swapaxes(lse, 1, 2)


_KEYWORD_CASES = (
    ("plain", {}),
    ("causal", dict(is_causal=True)),
    ("lengths", dict(query_seq_lengths=jnp.array([40, 17], jnp.int32),
                     key_value_seq_lengths=jnp.array([48, 30], jnp.int32),
                     is_causal=True)),
    ("window", dict(local_window_size=(5, 3))),
    ("window_int_causal", dict(local_window_size=6, is_causal=True)),
    ("scale", dict(scale=0.2)),
    # jax.nn's bias and mask, passed positionally (the third element).
    ("positional_bias_and_mask", dict(is_causal=True), True),
    ("positional_bias_and_mask_window_int_causal",
     dict(local_window_size=20, is_causal=True), True),
)


class JaxNnCompatTest(test_base.BackendTestCase):

  def _same_as_jax_nn(self, q, k, v, dout, *args, **kwargs):
    """Forward and q/k/v gradients of the same call vs jax.nn's."""
    fn = lambda q, k, v: self.flash(**kwargs)(q, k, v, *args)
    results = test_util.STEP(
        fn, q, k, v, dout)
    if args:  # Positional bias / mask: bind them for jax.nn too.
      kwargs = dict(kwargs, **dict(zip(("bias", "mask"), args)))
    test_util.assert_close_to_jax_nn(self, results, q, k, v, dout, **kwargs)

  # On CPU only the last case runs, one interpreted program (each costs
  # seconds to compile) for the two checks this file alone makes: an int
  # window (causal) and a positional bias and mask. Its window of 20 keeps
  # most of the causal triangle (and tiles) under the bias and the mask.
  # The others pass the same keywords to the same interpreted lines as
  # tests that check them against jax.nn already (the interpreter's lines
  # do not depend on these shapes): "plain" and "causal" as
  # attention_test's, "lengths" (query and key lengths, causal) as
  # attention_test.test_sequence_length_masks, "window" (a tuple window,
  # not causal) as window_test's zero_window, and "scale" as
  # attention_test.test_dtypes_and_scale.
  @parameterized.named_parameters(*test_util.sweep(
      _KEYWORD_CASES, cpu_cases=_KEYWORD_CASES[-1:]))
  def test_keywords(self, kwargs, positional_bias_and_mask=False):
    """jax.nn's keywords (and, in the cases that say so, its bias and mask
    passed positionally) give jax.nn's results."""
    q, k, v, dout = test_util.random_inputs(
        160, batch=B, q_len=T, kv_len=S, num_heads=N, num_kv_heads=K,
        head_dim=H)
    args = _masks(162) if positional_bias_and_mask else ()
    self._same_as_jax_nn(q, k, v, dout, *args, **kwargs)

  def _assert_residual_as_jax_nns(self, ours, q, k, v):
    """(out, lse) of return_residual=True (causal) as jax.nn's: structure,
    shapes, dtypes, and the lse's values."""
    theirs = jax.jit(functools.partial(
        jax.nn.dot_product_attention, is_causal=True,
        return_residual=True))(q, k, v)
    self.assertIsInstance(ours, tuple)
    self.assertLen(ours, 2)
    chex.assert_trees_all_equal_shapes_and_dtypes(ours, theirs)
    # jax.nn rounds its lse to the input dtype: compare at that dtype.
    chex.assert_trees_all_close(
        ours[1].astype(jnp.float32), theirs[1].astype(jnp.float32),
        atol=0.05 if q.dtype == jnp.bfloat16 else 1e-5, rtol=0.01)

  def test_return_residual_structure_and_dtypes_unbatched(self):
    # Batched inputs: checked on the forward of
    # test_lse_gradient_with_a_cotangent_of_jax_nns_dtype (same call).
    q, k, v, _ = test_util.random_inputs(
        163, batch=1, q_len=T, kv_len=S, num_heads=N, num_kv_heads=K,
        head_dim=H, dtype="bfloat16")
    q, k, v = q[0], k[0], v[0]
    # Jitted: run eagerly, each operation compiles apart.
    ours = jax.jit(self.flash(is_causal=True, return_residual=True))(
        q, k, v)
    self._assert_residual_as_jax_nns(ours, q, k, v)

  def test_lse_gradient_with_a_cotangent_of_jax_nns_dtype(self):
    # jax.nn's lse has a zero gradient; jflash's is the true one: checked
    # against a float32 formulation. The cotangents have jax.nn's dtypes,
    # as code written for jax.nn passes them. The (out, lse) of the
    # forward is also jax.nn's return_residual, checked as such (batched
    # inputs: test_return_residual_structure_and_dtypes_unbatched has the
    # others).
    # On CPU bfloat16 only: its cotangents are cast where float32's are
    # already the residuals' dtype, through the same interpreted lines.
    for dtype in test_util.sweep(("float32", "bfloat16"), ("bfloat16",)):
      with self.subTest(dtype=dtype):
        q, k, v, dout = test_util.random_inputs(
            164, batch=B, q_len=T, kv_len=S, num_heads=N, num_kv_heads=K,
            head_dim=H, dtype=dtype)
        dlse = jax.random.normal(jax.random.key(165), (B, T, N), dtype)
        fn = lambda q, k, v: self.flash(is_causal=True,
                                        return_residual=True)(q, k, v)

        @jax.jit
        def results(q, k, v, dout, dlse, fn=fn):
          residual, vjp = jax.vjp(fn, q, k, v)
          return residual, vjp((dout, dlse)), vjp((dout, 0.0 * dlse))

        residual, grads, no_dlse = results(q, k, v, dout, dlse)
        self._assert_residual_as_jax_nns(residual, q, k, v)
        out, lse = residual
        @jax.jit
        def reference(q, k, v, dout, dlse):
          (out, lse), vjp = jax.vjp(
              functools.partial(_exact_attention_with_lse, is_causal=True),
              q, k, v)
          return out, lse, vjp((dout.astype(jnp.float32),
                                dlse.astype(jnp.float32)))

        ref_out, ref_lse, ref_grads = reference(q, k, v, dout, dlse)
        tolerance = 2e-5 if dtype == "float32" else 0.05
        for name, ours, ref in zip(
            ("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
            (ref_out, ref_lse, *ref_grads)):
          self.assertEqual(ours.dtype, jnp.dtype(dtype), msg=name)
          np.testing.assert_allclose(
              np.asarray(ours, np.float32), np.asarray(ref), err_msg=name,
              atol=tolerance, rtol=tolerance)
        # The lse's cotangent reaches the inputs: not jax.nn's zero.
        self.assertGreater(float(jnp.max(jnp.abs(
            grads[0].astype(jnp.float32) - no_dlse[0].astype(jnp.float32)))),
                           1e-3)

  def test_float64(self):
    # jax.nn takes float64 (x64 mode) but runs its softmax in float32;
    # jflash's XLA path keeps float64 throughout: exact to 1e-12 against a
    # float64 formulation, and jax.nn's within its float32 softmax.
    with jax.enable_x64(True):
      q, k, v, dout = test_util.random_inputs(
          166, batch=B, q_len=T, kv_len=T, num_heads=N, num_kv_heads=K,
          head_dim=H, dtype="float64")
      step = test_util.STEP
      results = step(self.flash(is_causal=True), q, k, v, dout)
      exact = lambda q, k, v: _exact_attention_with_lse(
          q, k, v, is_causal=True, dtype=jnp.float64)[0]
      for reference, tolerance in ((exact, 1e-12), (functools.partial(
          jax.nn.dot_product_attention, is_causal=True), 1e-5)):
        for name, ours, ref in zip(("out", "dq", "dk", "dv"), results,
                                   step(reference, q, k, v, dout)):
          self.assertEqual(ours.dtype, jnp.float64, msg=name)
          np.testing.assert_allclose(ours, ref, atol=tolerance,
                                     rtol=tolerance, err_msg=name)

  def test_vmap_over_every_operand(self):
    # An extra leading axis on q, k, v, bias, mask and the lengths, mapped
    # by jax.vmap, as jax.nn's own tests do; the gradients of the bias too.
    q, k, v, dout = test_util.random_inputs(
        167, batch=3 * B, q_len=T, kv_len=S, num_heads=N, num_kv_heads=K,
        head_dim=H)
    split = lambda x: x.reshape(3, B, *x.shape[1:])
    q, k, v, dout = (split(x) for x in (q, k, v, dout))
    bias, mask = _masks(168)
    bias = jnp.stack([bias, bias[::-1], 0.5 * bias])
    mask = jnp.stack([mask, mask[::-1], mask])
    q_lens = jnp.array([[40, 17], [9, 40], [40, 40]], jnp.int32)

    def value_and_grads(attention):
      def one(q, k, v, bias, mask, q_lens, dout):
        fn = lambda q, k, v, bias: attention(
            q, k, v, bias, mask, query_seq_lengths=q_lens, is_causal=True)
        return test_util.value_and_all_grads(fn, dout, q, k, v, bias)
      return jax.jit(jax.vmap(one))(q, k, v, bias, mask, q_lens, dout)

    ours = value_and_grads(self.flash())
    with jax.default_matmul_precision("highest"):
      theirs = value_and_grads(jax.nn.dot_product_attention)
    chex.assert_trees_all_close(ours, theirs, atol=2e-5, rtol=2e-5)

test_base.for_each_backend(globals(), JaxNnCompatTest)


class DefaultChoiceTest(absltest.TestCase):
  """implementation=None, as jax.nn code calls it."""

  def test_float64_runs_by_default(self):
    # The kernels take no float64: on a GPU the XLA path runs as a fallback
    # and says so; elsewhere it is the default anyway.
    with jax.enable_x64(True):
      q, k, v, _ = test_util.random_inputs(171, q_len=16, kv_len=16,
                                           dtype="float64")
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = jflash.flash_attention(q, k, v, is_causal=True)
      expected = jflash.flash_attention(q, k, v, is_causal=True,
                                        implementation="xla")
    self.assertEqual(out.dtype, jnp.float64)
    chex.assert_trees_all_equal(out, expected)
    fallback = [w for w in caught if "fallback" in str(w.message)]
    self.assertLen(fallback, 2 if test_util.ON_GPU else 0)  # Both passes.


class CudnnTest(absltest.TestCase):
  """implementation="cudnn", as jax.nn code names it."""

  def test_named_only_and_needs_a_gpu(self):
    q, k, v, _ = test_util.random_inputs(169, batch=1, q_len=16, kv_len=16,
                                         head_dim=64, dtype="bfloat16")
    names = [b["name"] for b in jflash.implementations()]
    self.assertIn("cudnn", names)
    listing = {b["name"]: b for b in jflash.implementations()}
    self.assertEqual(listing["cudnn"]["role_here"], "named only")
    if test_util.ON_GPU:
      ours = jflash.flash_attention(q, k, v, is_causal=True,
                                    implementation="cudnn")
      theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                            implementation="cudnn")
      chex.assert_trees_all_equal(ours, theirs)
      return
    # jax.nn raises a RuntimeError without cuDNN; jflash says so first.
    with self.assertRaisesRegex(NotImplementedError,
                                "cudnn needs a CUDA GPU"):
      jflash.flash_attention(q, k, v, implementation="cudnn")

  def test_refuses_jflash_only_options(self):
    q, k, v, _ = test_util.random_inputs(170, q_len=16, kv_len=16)
    # On a GPU (mocked where there is none) the reason is the option.
    self.enter_context(mock.patch.object(registry, "current_platform",
                                         return_value="cuda"))
    with self.assertRaisesRegex(NotImplementedError,
                                "cudnn does not support soft_cap"):
      jflash.flash_attention(q, k, v, implementation="cudnn",
                             logits_soft_cap=5.0)


if __name__ == "__main__":
  absltest.main()
