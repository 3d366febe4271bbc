"""Dense `bias` and `mask`, forward and gradients (dbias too).

Against jax.nn.dot_product_attention (which has both) wherever every row sees
a key; against jflash's pure-JAX path where rows are empty or for options
jax.nn lacks. Runs per backend (tests/test_base.py): the Pallas kernels and
the XLA path.
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

B, T, S, N, K = 2, 40, 56, 4, 2


def _bias_and_mask(shape, dtype="float32", seed=0):
  """A random bias and a random mask that keeps the diagonal visible."""
  keys = jax.random.split(jax.random.key(seed))
  bias = 2.0 * jax.random.normal(keys[0], shape, jnp.dtype(dtype))
  diagonal = jnp.broadcast_to(jnp.eye(shape[-2], shape[-1], dtype=bool),
                              shape)
  mask = jnp.logical_or(jax.random.uniform(keys[1], shape) > 0.3, diagonal)
  return bias, mask


_NAMES = ("out", "dq", "dk", "dv", "dbias")


class DenseTest(test_base.BackendTestCase):

  def _results(self, q, k, v, bias, dout, **kwargs):
    return test_util.ALL_GRADS_STEP(
        self.flash(**kwargs), dout, q, k, v, bias)

  def _assert_close(self, results, q, k, v, bias, dout, *, xla=False,
                    **kwargs):
    """Within the tolerance table of jax.nn (or of jflash's XLA path)."""
    if xla:
      fn = functools.partial(jflash.flash_attention, implementation="xla",
                             **kwargs)
    else:
      fn = functools.partial(jax.nn.dot_product_attention, **kwargs)
    test_util.assert_close_to_function(self, results, fn, (q, k, v, bias),
                                       dout, _NAMES)

  # On CPU only rank_2 runs: it becomes a bias shared by every batch
  # element and head (the same kernel operand as "shared"); a per_head
  # bias and mask run in test_bfloat16_with_lengths_window_and_mqa (against
  # jax.nn too), and per_batch ones in
  # test_soft_cap_segments_bottom_right_and_fully_masked_rows, all with
  # their dbias checked (shape included) against a reference: together they
  # run every line of a full bias's index maps and dbias reduction in the
  # interpreter.
  @parameterized.named_parameters(*test_util.sweep(
      [("shared", (1, 1, T, S)), ("per_batch", (B, 1, T, S)),
       ("per_head", (1, N, T, S)), ("full", (B, N, T, S)),
       ("rank_2", (T, S))],
      cpu_cases=[("rank_2", (T, S))]))
  def test_broadcast_shapes_match_jax_nn(self, shape):
    q, k, v, dout = test_util.random_inputs(
        90, batch=B, q_len=T, kv_len=S, num_heads=N, num_kv_heads=K)
    bias, mask = _bias_and_mask(shape)
    results = self._results(q, k, v, bias, dout, mask=mask, is_causal=True)
    chex.assert_shape(results[-1], shape)
    self._assert_close(results, q, k, v, bias, dout, mask=mask,
                       is_causal=True)

  def test_bfloat16_with_lengths_window_and_mqa(self):
    q, k, v, dout = test_util.random_inputs(
        91, batch=B, q_len=T, kv_len=S, num_heads=N, num_kv_heads=1,
        dtype="bfloat16")
    # Every valid row keeps a visible key (as jax.nn needs) with this seed's
    # mask, the window and the key lengths.
    bias, mask = _bias_and_mask((1, N, T, S), dtype="bfloat16", seed=2)
    kwargs = dict(mask=mask, is_causal=True, local_window_size=(13, 0),
                  query_seq_lengths=jnp.array([T, 23], jnp.int32),
                  key_value_seq_lengths=jnp.array([31, S], jnp.int32))
    results = self._results(q, k, v, bias, dout, **kwargs)
    self.assertEqual(results[-1].dtype, jnp.bfloat16)
    self._assert_close(results, q, k, v, bias, dout, **kwargs)

  def test_soft_cap_segments_bottom_right_and_fully_masked_rows(self):
    # jax.nn has neither soft cap nor bottom-right alignment, nor outputs 0
    # on a row that sees nothing: against jflash's XLA path (bias after the
    # cap). Rows 5..20 of batch 0 are masked out entirely (batch 1's rows
    # stay visible): output 0, zero gradients (dbias included), everything
    # finite. One call for both checks: each kernel program costs seconds
    # of compilation on CPU.
    q, k, v, dout = test_util.random_inputs(
        92, batch=B, q_len=T, kv_len=S, num_heads=N, num_kv_heads=K)
    bias, mask = _bias_and_mask((B, 1, T, S), seed=3)
    mask = mask.at[0, :, 5:21].set(False)
    ids = jnp.asarray(np.repeat([[0, 1, 2, 3]], B, 0).repeat(14, 1))
    kwargs = dict(mask=mask, logits_soft_cap=2.0, is_causal=True,
                  causal_alignment="bottom_right",
                  q_segment_ids=ids[:, :T], kv_segment_ids=ids[:, :S])
    out, dq, dk, dv, dbias = results = self._results(q, k, v, bias, dout,
                                                     **kwargs)
    chex.assert_tree_all_finite(results)
    for name, x in (("out", out[0, 5:21]), ("dq", dq[0, 5:21]),
                    ("dbias", dbias[0, :, 5:21])):
      np.testing.assert_array_equal(np.asarray(x), 0.0, err_msg=name)
    self._assert_close(results, q, k, v, bias, dout, xla=True, **kwargs)

  @absltest.skipIf(not test_util.ON_GPU, "shared memory limits the tiles "
                   "only on a GPU; the interpreter has no such limit")
  def test_default_tiles_with_a_long_bias_and_mask(self):
    # 128x128 bf16 forward tiles plus bias tiles asked 288 KiB of shared
    # memory (of 227) on an H100: the heuristic now counts them.
    q, k, v, dout = test_util.random_inputs(
        93, batch=1, q_len=2560, kv_len=2560, num_heads=2, head_dim=128,
        dtype="bfloat16")
    bias, mask = _bias_and_mask((1, 2, 2560, 2560), dtype="bfloat16")
    results = self._results(q, k, v, bias, dout, mask=mask,
                            block_sizes=None)
    self._assert_close(results, q, k, v, bias, dout, mask=mask)

  def test_mask_alone_and_unbatched(self):
    q, k, v, dout = test_util.random_inputs(
        94, batch=1, q_len=T, kv_len=S, num_heads=N, num_kv_heads=K)
    _, mask = _bias_and_mask((N, T, S), seed=4)
    fn = self.flash(mask=mask)
    results = test_util.STEP(
        fn, q[0], k[0], v[0], dout[0])
    test_util.assert_close_to_jax_nn(
        self, tuple(x[None] for x in results), q, k, v, dout, mask=mask)

  def test_vmap_with_a_dense_bias(self):
    # The kernels fold a vmapped axis into the batch, a bias's too (shared
    # slices stay shared: the index maps divide by the batch span).
    q, k, v, dout = test_util.random_inputs(95, q_len=8, kv_len=8)
    bias = jax.random.normal(jax.random.key(96), (8, 8))
    flash = jax.vmap(lambda q, k, v: self.flash(bias=bias)(q, k, v))
    results = test_util.STEP(
        flash, q, k, v, dout)
    test_util.assert_close_to_jax_nn(self, results, q, k, v, dout,
                                     bias=bias)

  @parameterized.named_parameters(
      ("bias_rank_5", "bias", jnp.zeros((1, 2, 4, 16, 24)),
       "at most 4 dimensions"),
      ("bias_heads", "bias", jnp.zeros((2, 3, 16, 24)),
       r"broadcastable to \[B, N, T, S\] = \(2, 4, 16, 24\)"),
      ("bias_int", "bias", jnp.zeros((16, 24), jnp.int32),
       "bias must be a floating-point array"),
      ("mask_length", "mask", jnp.ones((16, 23), bool),
       r"mask.shape=\(16, 23\)"),
      ("mask_float", "mask", jnp.ones((16, 24)),
       "mask must be a boolean array"),
  )
  def test_bad_bias_or_mask(self, name, value, message):
    q, k, v = (jnp.ones((2, 16, 4, 32)), jnp.ones((2, 24, 2, 32)),
               jnp.ones((2, 24, 2, 32)))
    with self.assertRaisesRegex(ValueError, message):
      jax.jit(functools.partial(
          jflash.flash_attention, implementation=self.implementation,
          **self.options, **{name: value})).lower(q, k, v)


test_base.for_each_backend(globals(), DenseTest)

if __name__ == "__main__":
  absltest.main()
