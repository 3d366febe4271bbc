"""Attention sinks (gpt-oss): forward, gradients (sinks included), the lse.

The reference is written out in jnp: a softmax over each row's logits with
the sink appended as one more column, that column dropped before the product
with V. Runs per backend (tests/test_base.py): the Pallas kernels and the XLA
path.
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


def _sink_attention(q, k, v, sinks, *, is_causal=False, q_lens=None,
                    kv_lens=None):
  """Attention with sinks, in plain jnp (GQA by repeating K/V)."""
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  k, v = (jnp.repeat(x, num_heads // num_kv_heads, axis=2) for x in (k, v))
  logits = jnp.einsum("btnd,bsnd->bnts", q, k,
                      preferred_element_type=jnp.float32) / np.sqrt(head_dim)
  rows = jnp.arange(q_len)[None, None, :, None]
  cols = jnp.arange(kv_len)[None, None, None, :]
  visible = jnp.ones((batch, 1, q_len, kv_len), bool)
  if is_causal:
    visible &= cols <= rows
  if kv_lens is not None:
    visible &= cols < kv_lens[:, None, None, None]
  logits = jnp.where(visible, logits, -jnp.inf)
  sink_column = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None],
                                 (batch, num_heads, q_len, 1))
  with_sink = jnp.concatenate([logits, sink_column], axis=-1)
  probs = jnp.exp(with_sink - jax.nn.logsumexp(with_sink, -1, keepdims=True))
  out = jnp.einsum("bnts,bsnd->btnd", probs[..., :-1].astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  if q_lens is not None:  # Rows past the query length are empty: 0.
    out = jnp.where((jnp.arange(q_len)[None, :, None, None]
                     < q_lens[:, None, None, None]), out, 0.0)
  return out.astype(q.dtype)


class SinksTest(test_base.BackendTestCase):

  # On CPU gqa_causal_bfloat16 is left out: the same inputs' query-head
  # groups run in lengths_fully_masked_rows, and causal sinks (dsinks
  # included) in test_lse_includes_the_sink; the interpreter runs the same
  # lines in either dtype.
  # A sink of -inf is checked on the reference check's inputs: the sinks
  # are an operand, not part of the program, so the compiled call with
  # sinks serves both checks (the -inf check was a test of its own with
  # its own two programs); the key-less rows and rows past the query length
  # it needs are here (and causal ones in the GPU's gqa_causal_bfloat16).
  @parameterized.named_parameters(*test_util.sweep(
      [("gqa_causal_bfloat16", "bfloat16", True, None),
       # Batch 0: kv length 0, so rows 0-29 see only their sink and rows
       # from 30 on are empty. Batch 1: keys from 23 on masked.
       ("lengths_fully_masked_rows", "float32", False,
        ([30, 48], [0, 23]))],
      cpu_cases=[("lengths_fully_masked_rows", "float32", False,
                  ([30, 48], [0, 23]))]))
  def test_matches_reference_and_minus_infinity_sink_is_no_sink(
      self, dtype, is_causal, lengths):
    q, k, v, dout = test_util.random_inputs(
        80, q_len=48, kv_len=57, num_heads=2, num_kv_heads=1, dtype=dtype)
    sinks = 2.0 * jax.random.normal(jax.random.key(81), (2,))
    options = dict(is_causal=is_causal)
    reference_options = dict(is_causal=is_causal)
    if lengths is not None:
      q_lens, kv_lens = (jnp.asarray(x, jnp.int32) for x in lengths)
      options.update(query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens)
      reference_options.update(q_lens=q_lens, kv_lens=kv_lens)
    names = ("out", "dq", "dk", "dv", "dsinks")
    args = (q, k, v, sinks)
    reference = functools.partial(_sink_attention, **reference_options)
    flash = self.flash(**options)
    fn = lambda q, k, v, sinks: flash(q, k, v, sinks=sinks)
    results = test_util.ALL_GRADS_STEP(
        fn, dout, *args)
    test_util.assert_close_to_function(self, results, reference, args, dout,
                                       names)
    if lengths is not None and lengths[1][0] == 0:
      # Rows without keys: 0, with 0 gradient.
      out, dq = results[:2]
      np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
      np.testing.assert_array_equal(np.asarray(dq[0]), 0.0)
    # A sink of -inf is no sink: the results of the call without sinks, and
    # a zero sink gradient.
    no_sinks = jnp.full_like(sinks, -jnp.inf)
    with_sinks = test_util.ALL_GRADS_STEP(fn, dout, q, k, v, no_sinks)
    without = test_util.STEP(flash, q, k, v, dout)
    chex.assert_trees_all_close(with_sinks[:4], without, rtol=1e-6,
                                atol=1e-6)
    np.testing.assert_array_equal(with_sinks[4], 0.0)

  def test_lse_includes_the_sink(self):
    q, k, v, dout = test_util.random_inputs(82, q_len=40, kv_len=24,
                                            num_heads=2)
    sinks = jnp.array([0.5, -1.5])
    q_lens, kv_lens = jnp.array([40, 33], jnp.int32), jnp.array([0, 24])
    dlse = jax.random.normal(jax.random.key(83), q.shape[:3])

    def results(flash):
      fn = lambda *args: flash(*args[:3], sinks=args[3], is_causal=True,
                               causal_alignment="bottom_right",
                               query_seq_lengths=q_lens,
                               key_value_seq_lengths=kv_lens,
                               return_residual=True, residual_dtype=jnp.float32)
      return test_util.ALL_GRADS_STEP(
          fn, (dout, dlse), q, k, v, sinks)

    ours = results(self.flash())
    xla = functools.partial(jflash.flash_attention, implementation="xla")
    with jax.default_matmul_precision("highest"):
      expected = results(xla)
    chex.assert_tree_all_finite(ours[2:])
    tolerance = tolerances.direct(q.dtype)
    chex.assert_trees_all_close(ours, expected, rtol=tolerance,
                                atol=tolerance)
    lse = np.asarray(ours[1])
    # Batch 0 sees no key: lse is the sink. Batch 1, bottom-right with
    # 24 keys for 33 rows: rows 0-8 see no key; rows past 33 are empty.
    np.testing.assert_allclose(lse[0], np.broadcast_to(sinks, (40, 2)),
                               rtol=1e-6)
    np.testing.assert_allclose(lse[1, :9], np.broadcast_to(sinks, (9, 2)),
                               rtol=1e-6)
    np.testing.assert_array_equal(lse[1, 33:], -np.inf)
    # Rows 9-32 of batch 1: logsumexp of the visible logits and the sink.
    logits = np.einsum("tnd,snd->tns", np.asarray(q[1], np.float32),
                       np.asarray(k[1], np.float32)) / np.sqrt(q.shape[-1])
    for t in (9, 20, 32):
      row = np.concatenate([logits[t, :, :t - 8], np.asarray(sinks)[:, None]],
                           axis=-1)
      np.testing.assert_allclose(lse[1, t], jax.nn.logsumexp(row, -1),
                                 rtol=tolerances.direct(q.dtype,
                                                        float32=1e-5))

  def test_no_keys_at_all(self):
    q, k, v, _ = test_util.random_inputs(85, q_len=8, kv_len=0)
    sinks = jnp.array([0.25, 3.0])
    flash = self.flash(sinks=sinks, return_residual=True,
                       residual_dtype=jnp.float32,
                       query_seq_lengths=jnp.array([8, 5]))
    # Jitted: eagerly, every operation compiles apart.
    out, lse = jax.jit(flash)(q, k, v)
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(lse[0], np.broadcast_to(sinks, (8, 2)))
    np.testing.assert_array_equal(lse[1, 5:], -np.inf)

  def test_vmap_over_sinks(self):
    q, k, v, _ = test_util.random_inputs(86, batch=1, q_len=24, kv_len=24)
    sinks = jax.random.normal(jax.random.key(87), (3, 2))
    # Jitted: run eagerly, each operation compiles apart.
    mapped = jax.jit(jax.vmap(
        lambda s: self.flash(is_causal=True)(q, k, v, sinks=s)))(sinks)
    xla = jax.jit(lambda s: jflash.flash_attention(
        q, k, v, is_causal=True, sinks=s, implementation="xla"))
    for i in range(3):
      # HIGHEST: on a GPU the XLA path's float32 matmuls default to TF32.
      with jax.default_matmul_precision("highest"):
        expected = xla(sinks[i])
      tolerance = tolerances.direct(q.dtype, float32=2e-6)
      chex.assert_trees_all_close(mapped[i], expected, rtol=tolerance,
                                  atol=tolerance)

  @parameterized.named_parameters(
      ("shape", jnp.zeros((3,)), "sinks must have shape \\(num_heads,\\)"),
      ("rank", jnp.zeros((2, 4)), r"sinks.shape=\(2, 4\)"),
      ("dtype", jnp.zeros((4,), jnp.int32), "sinks must be a float"),
  )
  def test_bad_sinks(self, sinks, message):
    q, k, v, _ = test_util.random_inputs(88, q_len=8, kv_len=8, num_heads=4,
                                         num_kv_heads=2)
    with self.assertRaisesRegex(ValueError, message):
      jflash.flash_attention(q, k, v, sinks=sinks,
                             implementation=self.implementation,
                             **self.options)


test_base.for_each_backend(globals(), SinksTest)

if __name__ == "__main__":
  absltest.main()
