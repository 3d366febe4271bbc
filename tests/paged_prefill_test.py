"""Paged prefill: flash_attention over a paged KV cache with any number of
new tokens (a chunk of a prompt), against the same call on the dense cache
and a NumPy float64 reference written from the documented semantics.

Runs per backend (tests/test_base.py): the Triton forward reads K/V tiles
through the block table (interpreted on CPU, compiled on a GPU), the XLA
path and the Mosaic forward (GPU suite) gather the pages first. Every case
shuffles the pages among spare ones, has ragged query and cache lengths
(0 included), and poisons what no sequence owns: NaN in every page row past
a sequence's length, and table entries past its pages naming a NaN page or
no page at all.
"""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from jflash._src import api
from jflash._src import platform
from jflash._src import registry
from tests import test_base
from tests import test_util
from tests import tolerances


def reference(q, k, v, q_lengths, kv_lengths, *, window=None, soft_cap=None,
              sinks=None):
  """float64 out [B, T, N, H] of bottom-right causal attention by
  definition: row t < q_len of sequence b sits at position kv_len - q_len +
  t and sees the keys c <= position (and within the window) below kv_len;
  other rows, and rows that see nothing (and have no sink), are 0."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  batch, num_tokens, num_heads, head_dim = q.shape
  group = num_heads // k.shape[2]
  k, v = (np.repeat(x, group, axis=2) for x in (k, v))
  logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(head_dim)
  if soft_cap is not None:
    logits = soft_cap * np.tanh(logits / soft_cap)
  q_lengths, kv_lengths = (np.asarray(x)[:, None, None]
                           for x in (q_lengths, kv_lengths))
  rows = np.arange(num_tokens)[None, :, None]
  cols = np.arange(k.shape[1])[None, None, :]
  position = kv_lengths - q_lengths + rows
  seen = (rows < q_lengths) & (cols < kv_lengths) & (cols <= position)
  if window is not None:
    seen &= (cols >= position - window[0]) & (cols <= position + window[1])
  seen = np.broadcast_to(seen[:, None], logits.shape)
  logits = np.where(seen, logits, -np.inf)
  if sinks is not None:
    sink = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None],
                           (*logits.shape[:3], 1))
    logits = np.concatenate([logits, np.where(
        (rows < q_lengths)[:, None], sink, -np.inf)], axis=-1)
  top = np.max(logits, axis=-1, keepdims=True)
  top = np.where(np.isfinite(top), top, 0.0)
  weights = np.exp(logits - top)
  total = weights.sum(-1, keepdims=True)
  probs = np.where(total > 0, weights / np.where(total > 0, total, 1), 0.0)
  probs = probs[..., :k.shape[1]]
  return np.einsum("bnts,bsnh->btnh", probs, v)


def paged_cache(key, value, kv_lengths, page_size: int, seed: int):
  """The dense caches [B, S, K, H] cut into pages, shuffled among as many
  spare pages, every row past a sequence's length NaN, and the table's
  entries past a sequence's pages alternately naming an all-NaN page and a
  page id out of range.

  Returns:
    (key_pages, value_pages, block_table).
  """
  batch, kv_seq = key.shape[:2]
  max_pages = kv_seq // page_size
  num_pages = 2 * batch * max_pages + 1
  poison = num_pages - 1  # All NaN.
  order = np.random.default_rng(seed).permutation(num_pages - 1)
  table = order[:batch * max_pages].reshape(batch, max_pages)
  written = (np.arange(kv_seq)[None, :]
             < np.asarray(kv_lengths)[:, None])[:, :, None, None]
  used = -(-np.asarray(kv_lengths) // page_size)
  past = np.arange(max_pages)[None, :] >= used[:, None]
  unowned = np.where(np.arange(max_pages)[None, :] % 2 == 0, poison,
                     num_pages + 7)
  block_table = np.where(past, unowned, table).astype(np.int32)

  def cut(cache):
    poisoned = np.where(written, np.asarray(cache, np.float32), np.nan)
    pages = np.full((num_pages, page_size, *cache.shape[2:]), np.nan,
                    np.float32)
    pages[table.reshape(-1)] = poisoned.reshape(-1, page_size,
                                                *cache.shape[2:])
    return jnp.asarray(pages, cache.dtype)

  return cut(key), cut(value), jnp.asarray(block_table)


# (name, page size, new tokens T, query heads, kv heads, cache length S,
#  options). With the suite's 32-key tiles, pages of 16 make every tile
# gather its rows from two pages; pages of 64 and 128 hold whole tiles.
CASES = (
    ("pages16_gqa_window_soft_cap", 16, 37, 8, 2, 96,
     dict(local_window_size=(40, 0), logits_soft_cap=3.0)),
    ("pages64_mha_long_chunk_sinks", 64, 300, 2, 2, 384,
     dict(sinks=np.array([0.5, -1.0], np.float32))),
    ("pages128_mqa_one_token", 128, 1, 4, 1, 256, {}),
)


class PagedPrefillTest(test_base.BackendTestCase):

  @parameterized.named_parameters(*CASES)
  def test_matches_the_dense_cache_and_the_reference(
      self, page_size, num_tokens, num_heads, num_kv_heads, kv_seq,
      options):
    q, k, v, _ = test_util.random_inputs(
        page_size + num_tokens, batch=3, q_len=num_tokens, kv_len=kv_seq,
        num_heads=num_heads, num_kv_heads=num_kv_heads)
    # A full chunk on a full cache, a shorter chunk on a partial cache (its
    # last page partly written), and a sequence with nothing yet.
    q_lengths = np.array([num_tokens, (num_tokens + 1) // 2, 0], np.int32)
    kv_lengths = np.array([kv_seq, kv_seq // 2 + 3, 0], np.int32)
    key_pages, value_pages, block_table = paged_cache(
        k, v, kv_lengths, page_size, seed=page_size)
    kwargs = dict(is_causal=True, causal_alignment="bottom_right",
                  query_seq_lengths=jnp.asarray(q_lengths),
                  key_value_seq_lengths=jnp.asarray(kv_lengths), **options)
    attend = self.flash_forward(**kwargs)
    # One program for both calls (the suite's CPU time is compilation); the
    # dense call's cache entries past the lengths are masked, as jax.nn's,
    # not guarded against NaN: they hold the random inputs.
    out, dense = jax.jit(lambda q, k, v, kp, vp, table: (
        attend(q, kp, vp, block_table=table), attend(q, k, v)))(
            q, k, v, key_pages, value_pages, block_table)
    self.assertEqual((out.shape, out.dtype), (q.shape, q.dtype))
    self.assertTrue(np.all(np.isfinite(np.asarray(out, np.float32))))
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(dense, np.float32),
                               **self._tolerance(q.dtype))
    expected = reference(
        q, k, v, q_lengths, kv_lengths,
        window=options.get("local_window_size"),
        soft_cap=options.get("logits_soft_cap"), sinks=options.get("sinks"))
    np.testing.assert_allclose(np.asarray(out, np.float64), expected,
                               **self._tolerance(q.dtype))
    # Rows past a sequence's query length are zeros (indexed in NumPy: a
    # jax.Array's eager indexing compiles a program per index).
    out = np.asarray(out)
    np.testing.assert_array_equal(out[1, q_lengths[1]:], 0.0)
    np.testing.assert_array_equal(out[2], 0.0)

  def _tolerance(self, dtype):
    tolerance = tolerances.direct(dtype)
    return dict(atol=tolerance, rtol=tolerance)

  def test_differentiating_raises(self):
    q, k, v, _ = test_util.random_inputs(5, batch=1, q_len=20, kv_len=32)
    key_pages, value_pages, block_table = paged_cache(
        k, v, [32], page_size=16, seed=5)
    fn = lambda q: jnp.sum(self.flash_forward(is_causal=True)(
        q, key_pages, value_pages, block_table=block_table))
    with self.assertRaisesRegex(
        NotImplementedError, "reads a paged cache \\(block_table\\) in the "
        "forward pass only"):
      jax.jit(jax.grad(fn)).trace(q)  # Raised while tracing.


test_base.for_each_backend(globals(), PagedPrefillTest)


class PagedPrefillRouteTest(parameterized.TestCase):

  def test_chunks_go_to_the_training_kernels_and_tokens_to_decode(self):
    # On a Hopper GPU (mocked): a few new tokens read the pages in the
    # split-K decode kernel; a chunk of a prompt runs the Mosaic forward
    # (pages gathered); no backward is planned (it would raise).
    with mock.patch.object(registry, "current_platform",
                           return_value="cuda"), \
        mock.patch.object(platform, "cuda_compute_capability",
                          return_value="9.0"):
      for q_len, head_dim, expected in ((1, 128, "decode"),
                                        (16, 128, "decode"),
                                        (2048, 128, "mosaic"),
                                        (2048, 96, "triton")):
        q = jnp.ones((2, q_len, 8, head_dim), jnp.bfloat16)
        pages = jnp.ones((64, 64, 2, head_dim), jnp.bfloat16)
        call = api.describe(
            q, pages, pages, is_causal=True, causal_alignment="bottom_right",
            key_value_seq_lengths=jnp.array([3000, 100], jnp.int32),
            block_table=jnp.zeros((2, 64), jnp.int32))
        plan = registry.plan(call.spec, None, call.options)
        self.assertEqual((plan.forward, plan.backward), (expected, None),
                         msg=f"q_len={q_len}, head_dim={head_dim}")
        self.assertIn("forward pass only", plan.backward_error)


if __name__ == "__main__":
  absltest.main()
