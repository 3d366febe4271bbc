"""Every mask and modifier at once, in both kernels, against the XLA path.

Each option is tested on its own (and against jax.nn where it has it) in its
own file; here they are combined, so that the forward, dK/dV and dQ kernels
must agree on one mask description with all of them on. The reference is
jflash's pure-JAX path on float32-upcast inputs at HIGHEST precision (it
regenerates the very same dropout mask).

Runs per backend (tests/test_base.py): the Pallas kernels and the XLA path
(there against itself on upcast inputs; and, for a bias with ALiBi or
dropout, which the kernels reject, against a jnp reference).
"""

import functools
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from jflash._src import dropout
from jflash._src.backends.triton import forward
from tests import test_base
from tests import test_util

Q_LEN, KV_LEN, HEADS, KV_HEADS = 40, 56, 4, 2


def _segments():
  # Three packed segments per row, queries and keys at the same positions;
  # the second batch element's segments are shifted.
  q_ids = np.stack([np.arange(Q_LEN) // 13, (np.arange(Q_LEN) + 5) // 13])
  kv_ids = np.stack([np.arange(KV_LEN) // 13, (np.arange(KV_LEN) + 5) // 13])
  return dict(q_segment_ids=jnp.asarray(q_ids, jnp.int32),
              kv_segment_ids=jnp.asarray(kv_ids, jnp.int32))


def _biased_attention(q, k, v, bias, *, alibi_slopes=None, dropout_rate=0.0,
                      dropout_rng=None):
  """Dense bias plus ALiBi (as one more dense bias) or dropout, in jnp; the
  dropout mask is dropout.py's, the one every backend draws."""
  batch, q_len, num_heads, head_dim = q.shape
  kv_len = k.shape[1]
  logits = jnp.einsum("btnd,bsnd->bnts", q, k,
                      preferred_element_type=jnp.float32) / np.sqrt(head_dim)
  logits = logits + jnp.broadcast_to(bias.astype(jnp.float32), logits.shape)
  if alibi_slopes is not None:
    distance = jnp.abs(jnp.arange(q_len)[:, None]
                       - jnp.arange(kv_len)[None, :]).astype(jnp.float32)
    logits = logits - (alibi_slopes[None, :, None, None]
                       * distance[None, None])
  probs = jax.nn.softmax(logits, axis=-1)
  if dropout_rate:
    keep = dropout.keep_mask(
        dropout.seeds(dropout_rng, batch, num_heads, broadcast=False),
        q_len, kv_len, dropout_rate)
    probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
  return jnp.einsum("bnts,bsnd->btnd", probs.astype(v.dtype), v,
                    preferred_element_type=jnp.float32).astype(q.dtype)


class CombinationsTest(test_base.BackendTestCase):

  def _check(self, dtype, **options):
    q, k, v, dout = test_util.random_inputs(
        120, q_len=Q_LEN, kv_len=KV_LEN, num_heads=HEADS,
        num_kv_heads=KV_HEADS, dtype=dtype)
    # Every caller passes array options, so self.flash gives a new function
    # per call: jit must trace again (see the launch order test, which
    # patches a module constant read at trace time).
    fn = self.flash(**options)
    results = test_util.STEP(
        fn, q, k, v, dout)
    test_util.assert_close_to_reference(self, results, q, k, v, dout,
                                        **options)
    return results

  # On CPU float32 only: the interpreter runs the same lines in either
  # dtype, and dropout_test runs dropout with every modifier in bfloat16.
  @parameterized.parameters(list(test_util.sweep(("float32", "bfloat16"),
                                                 ("float32",))))
  def test_masks_and_modifiers_together(self, dtype):
    self.require_independent_reference()
    self._check(
        dtype, is_causal=True, local_window_size=(24, 0),
        query_seq_lengths=jnp.array([40, 31]),
        key_value_seq_lengths=jnp.array([56, 45]), logits_soft_cap=5.0,
        sinks=jnp.array([0.5, -1.0, 0.0, 1.5]),
        alibi_slopes=jnp.array([0.25, 0.125, 0.0625, 0.5]),
        dropout_rate=0.2, dropout_rng=jax.random.key(121), **_segments())

  def test_dense_bias_and_mask_with_segments_and_sinks(self):
    self.require_independent_reference()
    keys = jax.random.split(jax.random.key(122), 2)
    bias = jax.random.normal(keys[0], (1, HEADS, Q_LEN, KV_LEN))
    mask = jax.random.bernoulli(keys[1], 0.8, (2, 1, Q_LEN, KV_LEN))
    self._check("float32", bias=bias, mask=mask, is_causal=True,
                causal_alignment="bottom_right",
                key_value_seq_lengths=jnp.array([56, 30]),
                sinks=jnp.array([0.5, -1.0, 0.0, 1.5]), **_segments())

  def test_causal_launch_orders_agree(self):
    self.require_kernels("the kernels' launch order (patches "
                         "forward.CAUSAL_TILE_MAJOR_KV_LEN)")
    # Causal calls launch head-major below forward.CAUSAL_TILE_MAJOR_KV_LEN
    # keys and tile-major from there on (forward.query_tile_grid); the order
    # moves the optional operands' index maps, not the arithmetic. Lowering
    # the threshold sends these short calls down the long-sequence path.
    self.assertGreater(forward.CAUSAL_TILE_MAJOR_KV_LEN, KV_LEN)
    keys = jax.random.split(jax.random.key(124), 2)
    options = dict(
        is_causal=True, bias=jax.random.normal(keys[0], (1, HEADS, Q_LEN,
                                                          KV_LEN)),
        mask=jax.random.bernoulli(keys[1], 0.9, (2, 1, Q_LEN, KV_LEN)),
        query_seq_lengths=jnp.array([40, 31]), logits_soft_cap=5.0,
        sinks=jnp.array([0.5, -1.0, 0.0, 1.5]), **_segments())
    head_major = self._check("bfloat16", **options)
    with mock.patch.object(forward, "CAUSAL_TILE_MAJOR_KV_LEN", 1):
      tile_major = self._check("bfloat16", **options)
    for name, a, b in zip(("out", "dq", "dk", "dv"), head_major, tile_major):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                    err_msg=name)

  @parameterized.parameters(
      dict(alibi_slopes=jnp.ones((HEADS,))),
      dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)))
  def test_bias_with_alibi_or_dropout(self, **options):
    # The dbias kernel applies ALiBi and dropout as the other kernels do:
    # the bias gradient is checked against plain jnp.
    q, k, v, dout = test_util.random_inputs(123, q_len=8, kv_len=8,
                                            num_heads=HEADS)
    bias = jax.random.normal(jax.random.key(125), (8, 8))
    fn = self.flash(**options)
    results = test_util.ALL_GRADS_STEP(
        fn, dout, q, k, v, bias)
    test_util.assert_close_to_function(
        self, results, functools.partial(_biased_attention, **options),
        (q, k, v, bias), dout, ("out", "dq", "dk", "dv", "dbias"))


test_base.for_each_backend(globals(), CombinationsTest)

if __name__ == "__main__":
  absltest.main()
