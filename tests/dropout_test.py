"""Attention dropout: the in-kernel mask, its statistics, gradients, keys.

The flash_attention tests run per backend (tests/test_base.py): the Pallas
kernels and the XLA path; the mask's statistics are backend-free.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import jflash
from jflash._src import dropout
from tests import test_base
from tests import test_util


def _within_binomial(test, kept, n, keep_prob, sigmas=5.0):
  """kept successes of n trials is within `sigmas` of Binomial(n, p)."""
  bound = sigmas * np.sqrt(n * keep_prob * (1.0 - keep_prob))
  test.assertLessEqual(abs(kept - n * keep_prob), bound,
                       msg=f"kept {kept} of {n}, expected {n * keep_prob}")


class DropoutMaskTest(parameterized.TestCase):
  """dropout.py's keep mask itself (no backend)."""

  @parameterized.parameters(0.1, 0.5, 0.9)
  def test_keep_rate_statistics(self, rate):
    seeds = dropout.seeds(jax.random.key(101), 2, 4, broadcast=False)
    mask = np.asarray(dropout.keep_mask(seeds, 64, 64, rate))
    _within_binomial(self, int(mask.sum()), mask.size, 1.0 - rate)
    # broadcast_dropout: one mask for all batch elements and heads.
    shared = dropout.keep_mask(
        dropout.seeds(jax.random.key(101), 2, 4, broadcast=True), 64, 64,
        rate)
    np.testing.assert_array_equal(shared, jnp.broadcast_to(shared[:1, :1],
                                                           shared.shape))
    # Each row and each column keeps about the same share (no position
    # pattern), within a looser bound for 4096 rows / columns.
    for axis in (2, 3):
      share = mask.mean(axis=axis)
      self.assertLess(np.abs(share.mean() - (1.0 - rate)), 0.01)
    # Adjacent entries are uncorrelated.
    for axis in (2, 3):
      a = np.take(mask, np.arange(63), axis=axis).ravel()
      b = np.take(mask, np.arange(1, 64), axis=axis).ravel()
      self.assertLess(abs(np.corrcoef(a, b)[0, 1]), 0.03)


_LENGTHS = dict(query_seq_lengths=jnp.array([40, 19]),
                key_value_seq_lengths=jnp.array([0, 50]))
_EVERY_MODIFIER = dict(
    is_causal=True, causal_alignment="bottom_right", logits_soft_cap=5.0,
    sinks=jnp.array([0.5, -1.0]), alibi_slopes=jnp.array([0.5, 0.125]))
_GRADIENT_CASES = (
    ("causal_gqa_lengths", "float32", dict(is_causal=True, **_LENGTHS)),
    ("bfloat16_with_every_modifier", "bfloat16", _EVERY_MODIFIER),
    ("bfloat16_with_every_modifier_and_lengths", "bfloat16",
     dict(_EVERY_MODIFIER, **_LENGTHS)),
)

class DropoutTest(test_base.BackendTestCase):

  def test_forward_and_backward_masks_are_the_shared_function(self):
    # q = 0: every probability is 1/S. V = I: out[t, d] = Z[t, d] / S.
    # dO = I: dV[s, d] = (p * Z)[d, s]. Both read the backend's masks.
    batch, length, heads, rate = 2, 32, 2, 0.3
    eye = jnp.broadcast_to(jnp.eye(length)[None, :, None, :],
                           (batch, length, heads, length))
    q = jnp.zeros_like(eye)
    key = jax.random.key(100)
    fn = self.flash(dropout_rate=rate, dropout_rng=key)
    out, dq, dk, dv = test_util.STEP(
        fn, q, eye, eye, eye)
    chex.assert_tree_all_finite((out, dq, dk, dv))
    scale = length * (1.0 - rate)
    forward_mask = np.moveaxis(np.asarray(out) * scale, 2, 1) > 0.5
    backward_mask = np.moveaxis(np.asarray(dv) * scale, (1, 2), (3, 1)) > 0.5
    expected = dropout.keep_mask(
        dropout.seeds(key, batch, heads, broadcast=False), length, length,
        rate)
    np.testing.assert_array_equal(forward_mask, expected)
    np.testing.assert_array_equal(backward_mask, expected)
    # Each (batch, head) has its own mask.
    self.assertFalse(np.all(expected == expected[:1, :1]))
    _within_binomial(self, int(forward_mask[0, 0].sum()), length * length,
                     1.0 - rate)

  # On CPU the last case only: one interpreted program (each costs seconds
  # to compile) with the lengths of the first (an empty key sequence, a
  # short query) and every modifier of the second, in bfloat16. GQA is in
  # every case. The mask is a hash of absolute (row, column) (dropout.py):
  # no causal alignment moves it; the float32 kernels' masks are checked
  # exactly by test_forward_and_backward_masks_are_the_shared_function.
  @parameterized.named_parameters(*test_util.sweep(_GRADIENT_CASES,
                                                   _GRADIENT_CASES[2:]))
  def test_gradients_match_the_xla_path_with_the_same_mask(self, dtype,
                                                           options):
    self.require_independent_reference()
    q, k, v, dout = test_util.random_inputs(102, q_len=40, kv_len=56,
                                            num_heads=2, num_kv_heads=1,
                                            dtype=dtype)
    options = dict(options, dropout_rate=0.25,
                   dropout_rng=jax.random.key(103))
    fn = self.flash(**options)
    results = test_util.STEP(
        fn, q, k, v, dout)
    test_util.assert_close_to_reference(self, results, q, k, v, dout,
                                        **options)

  def test_keys_rates_and_the_lse(self):
    q, k, v, _ = test_util.random_inputs(104, q_len=24, kv_len=24)
    flash = functools.partial(test_util.CALL, self._flash_with_lse())
    key1, key2 = jax.random.key(1), jax.random.key(2)
    out1, lse1 = flash(q, k, v, dropout_rate=0.5, dropout_rng=key1)
    chex.assert_trees_all_equal(
        (out1, lse1), flash(q, k, v, dropout_rate=0.5, dropout_rng=key1))
    out2, lse2 = flash(q, k, v, dropout_rate=0.5, dropout_rng=key2)
    self.assertGreater(float(jnp.max(jnp.abs(out1 - out2))), 0.1)
    plain, lse = flash(q, k, v)
    # Rate 0 is no dropout, with or without a key; the lse never drops.
    chex.assert_trees_all_equal(
        (plain, lse), flash(q, k, v, dropout_rate=0.0, dropout_rng=key1))
    chex.assert_trees_all_close((lse1, lse2), (lse, lse), rtol=1e-6,
                                atol=1e-6)
    self.assertGreater(float(jnp.max(jnp.abs(out1 - plain))), 0.1)

  def _flash_with_lse(self):
    return self.flash(is_causal=True, return_residual=True,
                      residual_dtype=jnp.float32)

  def test_vmap_over_keys_is_a_loop(self):
    # The call and shapes of test_keys_rates_and_the_lse: the loop's
    # program (test_util.CALL) is compiled once for both tests.
    q, k, v, _ = test_util.random_inputs(105, q_len=24, kv_len=24)
    keys = jax.random.split(jax.random.key(106), 2)
    fn = self._flash_with_lse()
    mapped = jax.jit(jax.vmap(
        lambda key: fn(q, k, v, dropout_rate=0.5, dropout_rng=key)))(keys)
    for i in range(2):
      single = test_util.CALL(fn, q, k, v, dropout_rate=0.5,
                              dropout_rng=keys[i])
      chex.assert_trees_all_close(jax.tree.map(lambda x: x[i], mapped),
                                  single, rtol=1e-6, atol=1e-6)
    outs, _ = mapped
    self.assertGreater(float(jnp.max(jnp.abs(outs[0] - outs[1]))), 0.1)

  def test_bad_options(self):
    q, k, v, _ = test_util.random_inputs(107, q_len=8, kv_len=8)
    key = jax.random.key(0)
    cases = [
        (dict(dropout_rate=-0.1, dropout_rng=key), r"dropout_rate must be"),
        (dict(dropout_rate=1.0, dropout_rng=key), r"in \[0, 1\)"),
        (dict(dropout_rate="0.1", dropout_rng=key), "dropout_rate"),
        (dict(dropout_rate=0.1), "dropout_rng .* is required"),
        (dict(dropout_rate=0.1, dropout_rng=jax.random.split(key, 2)),
         r"dropout_rng.shape=\(2,\)"),
        (dict(dropout_rate=0.1, dropout_rng=jnp.zeros(2, jnp.float32)),
         "dropout_rng.dtype=float32"),
        (dict(dropout_rate=0.1, dropout_rng=key, broadcast_dropout=None),
         "broadcast_dropout must be a bool"),
    ]
    for kwargs, message in cases:
      with self.subTest(message=message):
        with self.assertRaisesRegex(ValueError, message):
          jflash.flash_attention(q, k, v, implementation=self.implementation,
                                 **self.options, **kwargs)
    with self.assertRaisesRegex(ValueError, "dropout_rate must be a Python"):
      jax.jit(lambda rate: jflash.flash_attention(
          q, k, v, dropout_rate=rate, dropout_rng=key,
          implementation=self.implementation, **self.options))(0.5)


test_base.for_each_backend(globals(), DropoutTest)

if __name__ == "__main__":
  absltest.main()
