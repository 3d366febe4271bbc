"""Logit soft-capping and bottom-right causal alignment, forward and grads.

jax.nn has neither option: the reference is jflash's pure-JAX path (itself
checked against jax.nn without these options in dispatch_test.py), on
float32 inputs at HIGHEST precision. Runs per backend (tests/test_base.py):
the Pallas kernels and the XLA path.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import jflash
from tests import test_base
from tests import test_util


class ModifiersTest(test_base.BackendTestCase):

  def _check(self, seed, lengths=None, **options):
    shape = {k: options.pop(k) for k in list(options)
             if k in ("q_len", "kv_len", "num_heads", "num_kv_heads",
                      "dtype", "batch")}
    q, k, v, dout = test_util.random_inputs(seed, **shape)
    if lengths is not None:
      options.update(
          query_seq_lengths=jnp.asarray(lengths[0], jnp.int32),
          key_value_seq_lengths=jnp.asarray(lengths[1], jnp.int32))
    fn = self.flash(**options)
    results = test_util.STEP(
        fn, q, k, v, dout)
    test_util.assert_close_to_reference(self, results, q, k, v, dout,
                                        **options)
    return results

  # On CPU one case: the cap's lines depend on neither the dtype nor the
  # causality, and test_bottom_right_with_lengths_and_soft_cap runs a cap
  # in float32 (both kernels' cap lines, forward and backward).
  @parameterized.parameters(list(test_util.sweep(
      [dict(dtype=dtype, is_causal=is_causal)
       for dtype in ("float32", "bfloat16") for is_causal in (False, True)],
      cpu_cases=[dict(dtype="bfloat16", is_causal=True)])))
  def test_soft_cap(self, dtype, is_causal):
    self.require_independent_reference()
    # A small cap with large logits: the tanh saturates for many entries.
    self._check(50, dtype=dtype, is_causal=is_causal, logits_soft_cap=2.0,
                scale=1.0, q_len=40, kv_len=70)

  # On CPU "equal" is left out: with as many queries as keys bottom-right
  # is top-left (test_bottom_right_equals_top_left_for_square_inputs, and
  # top-left is checked against jax.nn in attention_test); the interpreter
  # runs the same lines for the three. "fewer_queries" is left out too:
  # the kernels take the offset (kv_len - q_len) in the same lines whether
  # the shapes or the lengths give it, and positive offsets (fewer queries
  # than keys) run forward and backward, against the same reference, in
  # test_bottom_right_with_lengths_and_soft_cap (48 queries, 64 keys;
  # lengths 10 and 33) and forward in test_bottom_right_is_kv_cache_prefill.
  # "more_queries" keeps the negative offset and its key-less rows.
  @parameterized.named_parameters(*test_util.sweep(
      [("fewer_queries", 24, 70), ("more_queries", 70, 24),
       ("equal", 40, 40)],
      cpu_cases=[("more_queries", 70, 24)]))
  def test_bottom_right_causal(self, q_len, kv_len):
    out = self._check(51, q_len=q_len, kv_len=kv_len, num_heads=4,
                      num_kv_heads=2, is_causal=True,
                      causal_alignment="bottom_right")[0]
    if q_len > kv_len:  # The first q_len - kv_len rows see no key.
      np.testing.assert_array_equal(np.asarray(out[:, :q_len - kv_len]), 0.0)

  def test_bottom_right_with_lengths_and_soft_cap(self):
    self.require_independent_reference()
    self._check(52, q_len=48, kv_len=64, is_causal=True,
                causal_alignment="bottom_right", logits_soft_cap=5.0,
                lengths=([48, 10], [64, 33]))

  def test_bottom_right_equals_top_left_for_square_inputs(self):
    q, k, v, _ = test_util.random_inputs(53, q_len=33, kv_len=33)
    fn = lambda alignment: self.flash(
        is_causal=True, causal_alignment=alignment)

    # Jitted: one XLA program for both calls (eagerly, every operation
    # around the kernels compiles apart).
    @jax.jit
    def both(q, k, v):
      return fn("bottom_right")(q, k, v), fn("top_left")(q, k, v)

    chex.assert_trees_all_equal(*both(q, k, v))

  def test_bottom_right_is_kv_cache_prefill(self):
    # 8 new tokens after 24 cached ones: the new rows of full causal
    # attention over all 32 tokens.
    # The backend's default tiles (block_sizes=None), not the small ones.
    q, k, v, _ = test_util.random_inputs(54, q_len=32, kv_len=32)

    @jax.jit  # One XLA program for both calls, as above.
    def full_and_prefill(q, k, v):
      full = self.flash(is_causal=True, block_sizes=None)(q, k, v)
      prefill = self.flash(is_causal=True, causal_alignment="bottom_right",
                           block_sizes=None)(q[:, 24:], k, v)
      return full, prefill

    full, prefill = full_and_prefill(q, k, v)
    chex.assert_trees_all_close(prefill, full[:, 24:], rtol=1e-5, atol=1e-5)

  def test_bad_options(self):
    q, k, v, _ = test_util.random_inputs(55, q_len=8, kv_len=8)
    for cap in (0.0, -1.0, float("inf"), "1"):
      with self.subTest(cap=cap), self.assertRaisesRegex(ValueError,
                                                         "logits_soft_cap"):
        jflash.flash_attention(q, k, v, logits_soft_cap=cap,
                               implementation=self.implementation,
                               **self.options)
    with self.assertRaisesRegex(ValueError, "causal_alignment"):
      jflash.flash_attention(q, k, v, causal_alignment="top-left",
                             implementation=self.implementation,
                             **self.options)


test_base.for_each_backend(globals(), ModifiersTest)

if __name__ == "__main__":
  absltest.main()
