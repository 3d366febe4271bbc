"""Which implementation runs, the XLA path, and the deprecation filter."""

import os
import warnings

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import jflash
from jflash._src import deprecation
from tests import test_util


def _has_pallas_call(fn, *args) -> bool:
  return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


class DispatchTest(absltest.TestCase):

  def test_default_implementation(self):
    q, k, v, _ = test_util.random_inputs(30, q_len=16, kv_len=16)
    uses_kernels = _has_pallas_call(jflash.flash_attention, q, k, v)
    self.assertEqual(uses_kernels, test_util.ON_GPU)

  def test_interpret_runs_the_kernels(self):
    q, k, v, _ = test_util.random_inputs(31, q_len=16, kv_len=16)
    fn = lambda q, k, v: jflash.flash_attention(q, k, v, interpret=True)
    self.assertTrue(_has_pallas_call(fn, q, k, v))

  def test_xla_path_matches_jax_nn(self):
    q, k, v, dout = test_util.random_inputs(32, q_len=37, kv_len=50,
                                            num_heads=4, num_kv_heads=2)
    lengths = dict(query_seq_lengths=jnp.array([37, 20], jnp.int32),
                   key_value_seq_lengths=jnp.array([9, 50], jnp.int32))
    fn = lambda q, k, v: jflash.flash_attention(
        q, k, v, is_causal=True, implementation="xla", **lengths)
    # Jitted: run eagerly, each operation compiles apart.
    results = test_util.STEP(
        fn, q, k, v, dout)
    test_util.assert_close_to_jax_nn(self, results, q, k, v, dout,
                                     is_causal=True, **lengths)

  def test_xla_path_zeroes_rows_without_keys(self):
    q, k, v, dout = test_util.random_inputs(33, q_len=8, kv_len=8)
    fn = lambda q, k, v: jflash.flash_attention(
        q, k, v, implementation="xla",
        key_value_seq_lengths=jnp.array([0, 8], jnp.int32))
    results = test_util.STEP(
        fn, q, k, v, dout)
    for x in results:
      np.testing.assert_array_equal(np.asarray(x[0]), 0.0)
      self.assertTrue(np.all(np.isfinite(np.asarray(x))))

  def test_empty_sequences(self):
    q, k, v, _ = test_util.random_inputs(34, q_len=4, kv_len=0)
    out = jflash.flash_attention(q, k, v, interpret=test_util.INTERPRET)
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    self.assertEqual(out.shape, q.shape)


class DeprecationFilterTest(absltest.TestCase):

  def _warns(self) -> bool:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("default")
      installed = deprecation.silence_triton_deprecation()
      warnings.warn("The Pallas Triton backend is deprecated and will be "
                    "removed", DeprecationWarning)
    return installed, bool(caught)

  def test_silenced_by_default(self):
    os.environ.pop(deprecation.SHOW_ENV_VAR, None)
    installed, warned = self._warns()
    self.assertTrue(installed)
    self.assertFalse(warned)

  def test_shown_on_request(self):
    os.environ[deprecation.SHOW_ENV_VAR] = "1"
    try:
      installed, warned = self._warns()
    finally:
      del os.environ[deprecation.SHOW_ENV_VAR]
    self.assertFalse(installed)
    self.assertTrue(warned)

  def test_other_deprecations_still_shown(self):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("default")
      deprecation.silence_triton_deprecation()
      warnings.warn("something else is deprecated", DeprecationWarning)
    self.assertLen(caught, 1)


if __name__ == "__main__":
  absltest.main()
