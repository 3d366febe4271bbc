"""return_residual=True: the log-sum-exp, its dtypes and its gradient.

Runs per backend (tests/test_base.py): the Pallas kernels and the XLA path.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import jflash
from tests import test_base
from tests import test_util
from tests import tolerances


_LSE_CASES = (
    ("plain", {}), ("causal_gqa", dict(is_causal=True)),
    ("soft_cap_lengths", dict(
        logits_soft_cap=3.0,
        query_seq_lengths=jnp.array([40, 7], jnp.int32),
        key_value_seq_lengths=jnp.array([0, 19], jnp.int32))))


class ResidualsTest(test_base.BackendTestCase):

  def _flash(self, **kwargs):
    return self.flash(return_residual=True, residual_dtype=jnp.float32,
                      **kwargs)

  # On CPU "plain" is left out: its lse lines, forward and backward, run
  # in causal_gqa, and the non-causal mask's in soft_cap_lengths (same
  # shapes; the interpreter runs the same lines).
  @parameterized.named_parameters(*test_util.sweep(
      _LSE_CASES, cpu_cases=_LSE_CASES[1:]))
  def test_lse_and_its_gradient_match_the_reference(self, kwargs):
    q, k, v, dout = test_util.random_inputs(60, q_len=40, kv_len=56,
                                            num_heads=4, num_kv_heads=2)
    dlse = jax.random.normal(jax.random.key(61), q.shape[:3])

    results = test_util.ALL_GRADS_STEP
    ours = results(self._flash(**kwargs), (dout, dlse), q, k, v)
    reference = functools.partial(
        jflash.flash_attention, implementation="xla", return_residual=True,
        residual_dtype=jnp.float32, **kwargs)
    with jax.default_matmul_precision("highest"):
      expected = results(reference, (dout, dlse), q, k, v)
    names = ("out", "lse", "dq", "dk", "dv")
    for name, x, y in zip(names, ours, expected):
      self.assertEqual(x.shape, y.shape, msg=name)
      tolerance = tolerances.direct(q.dtype)
      np.testing.assert_allclose(x, y, rtol=tolerance, atol=tolerance,
                                 err_msg=name)
    self.assertEqual(ours[1].dtype, jnp.float32)
    self.assertEqual(ours[1].shape, (2, 40, 4))
    if "key_value_seq_lengths" in kwargs:  # Batch 0 sees no key.
      np.testing.assert_array_equal(ours[1][0], -np.inf)
      chex.assert_tree_all_finite(ours[2:])

  def test_lse_matches_jax_nn_logsumexp(self):
    # The call and shapes of test_lse_and_its_gradient_match_the_reference's
    # causal_gqa case (groups of 2 query heads per key head): one compiled
    # program for both tests, where a forward of its own compiled another.
    q, k, v, dout = test_util.random_inputs(62, q_len=40, kv_len=56,
                                            num_heads=4, num_kv_heads=2)
    dlse = jnp.ones(q.shape[:3], jnp.float32)
    _, lse, *_ = test_util.ALL_GRADS_STEP(self._flash(is_causal=True),
                                          (dout, dlse), q, k, v)
    # Query head h attends with key head h // 2, as in jax.nn.
    k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
    # HIGHEST: on a GPU the default precision of a float32 einsum is TF32.
    logits = jnp.einsum("btnd,bsnd->btns", q.astype(jnp.float32),
                        k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) / np.sqrt(
                            q.shape[-1])
    causal = jnp.tril(jnp.ones((40, 56), bool))[None, :, None, :]
    expected = jax.nn.logsumexp(jnp.where(causal, logits, -jnp.inf), -1)
    tolerance = tolerances.direct(q.dtype, float32=1e-5)
    chex.assert_trees_all_close(lse, expected, rtol=tolerance,
                                atol=tolerance)

  def test_merging_key_shards_is_full_attention(self):
    # Ring attention in miniature: two key shards, merged with their lse,
    # give full attention, and gradients flow through the merge.
    q, k, v, dout = test_util.random_inputs(63, q_len=24, kv_len=64)
    flash = self._flash()

    def merged(q, k, v):
      # Both shards in one call, stacked on the batch axis: one kernel
      # program to compile, not two of the same.
      shards = lambda x: jnp.concatenate([x[:, :32], x[:, 32:]])
      out, lse = flash(jnp.concatenate([q, q]), shards(k), shards(v))
      (out1, out2), (lse1, lse2) = jnp.split(out, 2), jnp.split(lse, 2)
      lse = jnp.logaddexp(lse1, lse2)[..., None]
      return (out1 * jnp.exp(lse1[..., None] - lse)
              + out2 * jnp.exp(lse2[..., None] - lse))

    # Full attention with the backend's default tiles.
    full = self.flash(block_sizes=None)
    chex.assert_trees_all_close(
        test_util.STEP(
            merged, q, k, v, dout),
        test_util.STEP(
            full, q, k, v, dout), rtol=tolerances.direct(q.dtype),
        atol=tolerances.direct(q.dtype))

  def test_unbatched_and_empty(self):
    q, k, v, _ = test_util.random_inputs(64, batch=1, q_len=8, kv_len=8)
    out, lse = self._flash()(q[0], k[0], v[0])
    self.assertEqual((out.shape, lse.shape), (q.shape[1:], (8, 2)))
    out, lse = self._flash()(q, k[:, :0], v[:, :0])
    np.testing.assert_array_equal(lse, -np.inf)

  def test_deprecated_spelling_is_the_float32_lse(self):
    q, k, v, _ = test_util.random_inputs(65, q_len=8, kv_len=8,
                                         dtype="bfloat16")
    with self.assertWarnsRegex(DeprecationWarning,
                               "return_residuals is deprecated"):
      old = self.flash(return_residuals=True)(q, k, v)
    new = self._flash()(q, k, v)
    self.assertEqual(old[1].dtype, jnp.float32)
    chex.assert_trees_all_equal(old, new)

  @parameterized.named_parameters(
      ("not_floating", dict(return_residual=True, residual_dtype=jnp.int32),
       "residual_dtype must be a floating dtype"),
      ("without_residual", dict(residual_dtype=jnp.float32),
       "applies only with return_residual=True"))
  def test_bad_residual_dtype(self, options, message):
    q, k, v, _ = test_util.random_inputs(66, q_len=8, kv_len=8)
    with self.assertRaisesRegex(ValueError, message):
      jflash.flash_attention(q, k, v, implementation=self.implementation,
                             **self.options, **options)


test_base.for_each_backend(globals(), ResidualsTest)

if __name__ == "__main__":
  absltest.main()
