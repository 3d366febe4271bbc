"""ALiBi (alibi_slopes): forward and gradients against a dense bias.

Runs per backend (tests/test_base.py): the Pallas kernels and the XLA path.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import jflash
from tests import test_base
from tests import test_util


def _alibi_bias(slopes, q_len, kv_len, offset=0):
  """Dense [batch or 1, num_heads, q_len, kv_len] bias."""
  rows = jnp.arange(q_len)[None, None, :, None]
  cols = jnp.arange(kv_len)[None, None, None, :]
  offset = jnp.asarray(offset).reshape(-1, 1, 1, 1)
  distance = jnp.abs(rows + offset - cols).astype(jnp.float32)
  slopes = slopes if slopes.ndim == 2 else slopes[None]
  return -slopes[:, :, None, None] * distance


def _capped_alibi_attention(q, k, v, slopes, *, cap, q_lens, kv_lens):
  """Soft cap, then ALiBi, bottom-right causal mask and lengths, in jnp."""
  batch, q_len, num_heads, head_dim = q.shape
  kv_len = k.shape[1]
  k, v = (jnp.repeat(x, num_heads // k.shape[2], axis=2) for x in (k, v))
  logits = jnp.einsum("btnd,bsnd->bnts", q, k,
                      preferred_element_type=jnp.float32) / np.sqrt(head_dim)
  offset = kv_lens - q_lens
  logits = cap * jnp.tanh(logits / cap) + _alibi_bias(slopes, q_len, kv_len,
                                                      offset)
  rows = jnp.arange(q_len)[None, :, None]
  cols = jnp.arange(kv_len)[None, None, :]
  visible = ((cols <= rows + offset[:, None, None])
             & (cols < kv_lens[:, None, None])
             & (rows < q_lens[:, None, None]))[:, None]
  logits = jnp.where(visible, logits, -jnp.inf)
  probs = jnp.exp(logits - jnp.max(logits, -1, keepdims=True))
  probs = jnp.where(visible, probs / jnp.sum(probs, -1, keepdims=True), 0.0)
  return jnp.einsum("bnts,bsnd->btnd", probs.astype(v.dtype), v,
                    preferred_element_type=jnp.float32).astype(q.dtype)


class AlibiTest(test_base.BackendTestCase):

  @parameterized.named_parameters(
      ("causal_gqa_float32", "float32", True, 40, 56, False),
      # Slopes per (batch, head), more queries than keys, lengths.
      ("not_causal_bfloat16", "bfloat16", False, 56, 40, True),
  )
  def test_matches_jax_nn_with_dense_bias(self, dtype, is_causal, q_len,
                                          kv_len, per_batch):
    q, k, v, dout = test_util.random_inputs(
        90, q_len=q_len, kv_len=kv_len, num_heads=2, num_kv_heads=1,
        dtype=dtype)
    slopes = 2.0 ** -jnp.arange(1.0, 5.0, 2.0)  # Geometric, as ALiBi's.
    options = dict(is_causal=is_causal)
    if per_batch:
      slopes = jnp.stack([slopes, slopes[::-1]])
      options.update(query_seq_lengths=jnp.array([q_len, 31]),
                     key_value_seq_lengths=jnp.array([17, kv_len]))
    bias = _alibi_bias(slopes, q_len, kv_len)
    fn = self.flash(alibi_slopes=slopes, **options)
    results = test_util.STEP(
        fn, q, k, v, dout)
    test_util.assert_close_to_jax_nn(
        self, results, q, k, v, dout,
        bias=jnp.broadcast_to(bias, (2, 2, q_len, kv_len)), **options)

  def test_soft_cap_bottom_right_and_lengths(self):
    q, k, v, dout = test_util.random_inputs(91, q_len=40, kv_len=64,
                                            num_heads=2, num_kv_heads=1)
    slopes = jnp.array([0.3, 0.05])
    q_lens, kv_lens = jnp.array([40, 29]), jnp.array([64, 50])
    reference = functools.partial(_capped_alibi_attention, slopes=slopes,
                                  cap=4.0, q_lens=q_lens, kv_lens=kv_lens)
    fn = self.flash(
        alibi_slopes=slopes, logits_soft_cap=4.0, is_causal=True,
        causal_alignment="bottom_right", query_seq_lengths=q_lens,
        key_value_seq_lengths=kv_lens)
    results = test_util.STEP(
        fn, q, k, v, dout)
    test_util.assert_close_to_function(self, results, reference, (q, k, v),
                                       dout, ("out", "dq", "dk", "dv"))

  def test_slopes_are_not_differentiable(self):
    q, k, v, _ = test_util.random_inputs(92, q_len=8, kv_len=8)
    slopes = jnp.array([0.5, 0.25])
    # The error is expected: flash_attention itself, not self.flash (which
    # checks the call first).
    flash = functools.partial(jflash.flash_attention,
                              implementation=self.implementation,
                              **self.options)
    loss = lambda s: jnp.sum(flash(q, k, v, alibi_slopes=s))
    with self.assertRaisesRegex(NotImplementedError,
                                "alibi_slopes are not differentiable"):
      jax.grad(loss)(slopes)
    # Stopped gradients are fine.
    stopped = lambda s: jnp.sum(self.flash(
        alibi_slopes=jax.lax.stop_gradient(s))(q, k, v))
    # Jitted: eagerly, every operation around the kernel compiles apart.
    jax.jit(jax.grad(stopped))(slopes)

  @parameterized.named_parameters(
      ("heads", (3,), r"alibi_slopes.shape=\(3,\)"),
      ("batch", (3, 4), r"\(4,\) or \(2, 4\)"),
      ("dtype", None, "alibi_slopes must be a float"),
  )
  def test_bad_slopes(self, shape, message):
    q, k, v, _ = test_util.random_inputs(93, q_len=8, kv_len=8, num_heads=4,
                                         num_kv_heads=2)
    slopes = (jnp.ones((4,), jnp.int32) if shape is None
              else jnp.ones(shape))
    with self.assertRaisesRegex(ValueError, message):
      jflash.flash_attention(q, k, v, alibi_slopes=slopes,
                             implementation=self.implementation,
                             **self.options)


test_base.for_each_backend(globals(), AlibiTest)

if __name__ == "__main__":
  absltest.main()
