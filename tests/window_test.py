"""Local (sliding) windows, against jax.nn; per backend (test_base.py)."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import jflash
from tests import test_base
from tests import test_util


class WindowTest(test_base.BackendTestCase):

  def _results(self, q, k, v, dout, **kwargs):
    fn = self.flash(**kwargs)
    return test_util.STEP(
        fn, q, k, v, dout)

  # The window's tile ranges are traced arithmetic, the same lines for any
  # window: on CPU left_right (a non-causal window given as a pair, as
  # zero_window's), causal_sliding (a causal window, as causal_wide's) and
  # symmetric (a non-causal int window, as test_rows_outside_every_window's;
  # jax_nn_compat_test checks an int window against jax.nn) are left out.
  @parameterized.named_parameters(*test_util.sweep(
      [("symmetric", 9, False, 70, 70),
       ("left_right", (20, 3), False, 64, 100),
       ("causal_sliding", (17, 0), True, 90, 90),
       ("causal_wide", (100, 5), True, 40, 72),
       ("zero_window", (0, 0), False, 33, 33)],
      cpu_cases=[("causal_wide", (100, 5), True, 40, 72),
                 ("zero_window", (0, 0), False, 33, 33)]))
  def test_matches_jax_nn(self, window, is_causal, q_len, kv_len):
    q, k, v, dout = test_util.random_inputs(
        70, q_len=q_len, kv_len=kv_len, num_heads=4, num_kv_heads=2)
    kwargs = dict(local_window_size=window, is_causal=is_causal)
    results = self._results(q, k, v, dout, **kwargs)
    test_util.assert_close_to_jax_nn(self, results, q, k, v, dout, **kwargs)

  def test_with_lengths_and_bottom_right(self):
    # jax.nn has no bottom-right alignment: compare with jflash's XLA path.
    self.require_independent_reference()
    q, k, v, dout = test_util.random_inputs(71, q_len=40, kv_len=90)
    kwargs = dict(local_window_size=(12, 0), is_causal=True,
                  causal_alignment="bottom_right",
                  query_seq_lengths=jnp.array([40, 17], jnp.int32),
                  key_value_seq_lengths=jnp.array([90, 61], jnp.int32))
    results = self._results(q, k, v, dout, **kwargs)
    test_util.assert_close_to_reference(self, results, q, k, v, dout,
                                        **kwargs)

  def test_rows_outside_every_window_are_zero(self):
    # 60 queries, 20 keys, window (5, 5): rows 25.. see no key at all.
    q, k, v, dout = test_util.random_inputs(72, q_len=60, kv_len=20)
    out, dq, _, _ = self._results(q, k, v, dout, local_window_size=5)
    np.testing.assert_array_equal(np.asarray(out[:, 25:]), 0.0)
    np.testing.assert_array_equal(np.asarray(dq[:, 25:]), 0.0)
    self.assertTrue(np.all(np.asarray(jnp.abs(out[:, :25]).max(-1)) > 0))

  def test_far_tiles_are_not_visited(self):
    # The same result whatever lies outside the band: poison keys and
    # values far from every row's window with NaN. Rows 0-31 see keys up to
    # 40; the poison starts at 256, past the key tiles of a query tile of
    # up to 128 rows (the Mosaic forward's) with key tiles of up to 128.
    self.require_kernels("tile skipping; the XLA path reads every element "
                         "by design")
    q, k, v, _ = test_util.random_inputs(73, batch=1, q_len=32, kv_len=384)
    poisoned_k = k.at[:, 256:].set(jnp.nan)
    poisoned_v = v.at[:, 256:].set(jnp.nan)
    # Jitted: one program for both calls (eagerly each lowers its own).
    flash = jax.jit(self.flash(local_window_size=(8, 8)))
    np.testing.assert_array_equal(flash(q, poisoned_k, poisoned_v),
                                  flash(q, k, v))

  @parameterized.named_parameters(
      ("negative", -1), ("one_element", (3,)), ("three", (1, 2, 3)),
      ("float", 2.5), ("bool", (True, 1)), ("string", "4"))
  def test_bad_window(self, window):
    q, k, v, _ = test_util.random_inputs(74, q_len=8, kv_len=8)
    with self.assertRaisesRegex(ValueError, "local_window_size"):
      jflash.flash_attention(q, k, v, local_window_size=window,
                             implementation=self.implementation,
                             **self.options)


test_base.for_each_backend(globals(), WindowTest)

if __name__ == "__main__":
  absltest.main()
