"""jflash.decode_attention: the split-K kernel and the XLA path against a
plain NumPy float64 reference written from the documented semantics."""

import functools
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import jflash
from jflash._src.backends.triton import decode as triton_decode
from jflash._src.backends.triton import decode_backend
from tests import test_util
from tests import tolerances

# Both implementations; the kernel through the interpreter on CPU.
IMPLEMENTATIONS = (("decode", dict(implementation="decode",
                                   interpret=test_util.INTERPRET)),
                   ("xla", dict(implementation="xla")))


def reference(q, k, v, lengths, *, is_causal=True, window=None,
              soft_cap=None, sinks=None, slopes=None, scale=None):
  """out [B, T, N, H] and natural lse [B, T, N], float64, by definition:
  token t of sequence b sits at position L - T + t."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  batch, num_tokens, num_heads, head_dim = q.shape
  kv_seq, num_kv_heads = k.shape[1:3]
  group = num_heads // num_kv_heads
  scale = head_dim ** -0.5 if scale is None else scale
  out = np.zeros(q.shape)
  lse = np.full((batch, num_tokens, num_heads), -np.inf)
  cols = np.arange(kv_seq)
  if isinstance(window, int):
    window = (window, window)
  for b in range(batch):
    length = int(lengths[b])
    for t in range(num_tokens):
      position = length - num_tokens + t
      seen = cols < length
      if is_causal:
        seen &= cols <= position
      if window is not None:
        seen &= (cols >= position - window[0]) & (cols <= position + window[1])
      for n in range(num_heads):
        logits = scale * (k[b, :, n // group] @ q[b, t, n])
        if soft_cap is not None:
          logits = soft_cap * np.tanh(logits / soft_cap)
        if slopes is not None:
          logits = logits - slopes[n] * np.abs(position - cols)
        logits = np.where(seen, logits, -np.inf)
        if sinks is not None:
          logits = np.append(logits, sinks[n])
        if not np.isfinite(logits).any():
          continue
        top = logits.max()
        weights = np.exp(logits - top)
        lse[b, t, n] = top + np.log(weights.sum())
        probs = weights[:kv_seq] / weights.sum()
        out[b, t, n] = probs @ v[b, :, n // group]
  return out, lse


def _inputs(seed, *, batch=3, num_tokens=2, num_heads=4, num_kv_heads=2,
            kv_seq=96, head_dim=32, dtype="float32"):
  # Drawn with NumPy (test_util.random_inputs): jax.random would compile a
  # sampler for every new shape.
  return test_util.random_inputs(
      seed, batch=batch, q_len=num_tokens, kv_len=kv_seq,
      num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
      dtype=dtype)[:3]


class DecodeTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    # 16-key tiles: the short test caches cross several tiles and splits.
    self.enter_context(mock.patch.object(
        decode_backend, "DEFAULT_LAUNCH", decode_backend.DecodeLaunch(block_k=16)))

  def _check(self, options, q, k, v, lengths, **kwargs):
    # Jitted: run eagerly, each operation of the call compiles apart.
    out, lse = jax.jit(lambda q, k, v, lengths: jflash.decode_attention(
        q, k, v, lengths, return_residual=True, residual_dtype=jnp.float32,
        **options, **kwargs))(q, k, v, lengths)
    return self._check_results(out, lse, q, k, v, lengths, **kwargs)

  def _check_results(self, out, lse, q, k, v, lengths, **kwargs):
    """out and lse of decode_attention(q, k, v, lengths, **kwargs) against
    the float64 reference."""
    names = dict(is_causal="is_causal", local_window_size="window",
                 logits_soft_cap="soft_cap", sinks="sinks",
                 alibi_slopes="slopes")
    ref_out, ref_lse = reference(
        q, k, v, np.asarray(lengths),
        **{names[key]: (np.asarray(value) if key in ("sinks", "alibi_slopes")
                        else value)
           for key, value in kwargs.items() if key in names})
    self.assertEqual(out.shape, q.shape)
    self.assertEqual(out.dtype, q.dtype)
    tolerance = tolerances.direct(q.dtype, float32=2e-5)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref_out,
                               atol=tolerance, rtol=tolerance)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite],
                               atol=tolerance, rtol=tolerance)
    return out, lse

  # (tokens, heads, kv heads). On CPU: one token without a GQA group (1
  # packed row, padded to a 16-row tile) and 5 tokens x a group of 8 (40
  # rows, padded to 64); the interpreter packs and masks the other shapes'
  # rows through the same lines.
  @parameterized.product(
      implementation=IMPLEMENTATIONS,
      shape=test_util.sweep(((1, 4, 4), (2, 8, 2), (5, 8, 1), (16, 2, 2)),
                            cpu_cases=((1, 4, 4), (5, 8, 1))),
      is_causal=(True, False))
  def test_tokens_groups_and_causality(self, implementation, shape,
                                       is_causal):
    num_tokens, num_heads, num_kv_heads = shape
    q, k, v = _inputs(1, num_tokens=num_tokens, num_heads=num_heads,
                      num_kv_heads=num_kv_heads)
    # Ragged: full, one entry, empty, and fewer entries than tokens.
    lengths = np.array([96, 1, 0, max(1, num_tokens - 1)], np.int32)[:3]
    self._check(implementation[1], q, k, v, lengths, is_causal=is_causal)

  @parameterized.named_parameters(*IMPLEMENTATIONS)
  def test_window_soft_cap_sinks_alibi(self, options):
    q, k, v = _inputs(2, num_tokens=3, num_heads=8, num_kv_heads=2)
    lengths = jnp.array([96, 50, 7], jnp.int32)
    sinks = np.linspace(-1.0, 2.0, 8, dtype=np.float32)
    slopes = np.linspace(0.05, 0.4, 8, dtype=np.float32)
    for kwargs in (dict(local_window_size=(20, 0)),
                   dict(local_window_size=(5, 3), is_causal=False),
                   dict(logits_soft_cap=3.0, sinks=sinks),
                   dict(alibi_slopes=slopes, local_window_size=40)):
      with self.subTest(**{k: str(v)[:20] for k, v in kwargs.items()}):
        self._check(options, q, k, v, lengths, **kwargs)

  # Pages of one 16-key tile (16) and of several (48, 64). On CPU: pages of
  # 16 with 5 tokens and pages of 48 with 1; the interpreter gathers pages
  # of 64 through the same lines as pages of 48.
  @parameterized.parameters(*[
      dict(implementation=implementation, page_size=page_size,
           num_tokens=num_tokens)
      for implementation in IMPLEMENTATIONS
      for page_size, num_tokens in test_util.sweep(
          ((16, 1), (16, 5), (48, 1), (48, 5), (64, 1), (64, 5)),
          cpu_cases=((16, 5), (48, 1)))])
  def test_paged_cache_equals_the_dense_one(self, implementation, page_size,
                                            num_tokens):
    # The dense caches cut into pages, stored in a shuffled order with
    # spare pages in between; the block table maps them back.
    q, k, v = _inputs(8, num_tokens=num_tokens, num_heads=8, num_kv_heads=2,
                      kv_seq=192)
    lengths = jnp.array([192, 70, 0], jnp.int32)
    batch, kv_seq = k.shape[:2]
    max_pages = kv_seq // page_size
    num_pages = 2 * batch * max_pages
    order = np.random.default_rng(page_size).permutation(num_pages)
    block_table = order[:batch * max_pages].reshape(batch, max_pages)

    def paged(cache):
      pages = np.zeros((num_pages, page_size, *cache.shape[2:]),
                       np.float32)
      pages[block_table.reshape(-1)] = np.asarray(cache).reshape(
          -1, page_size, *cache.shape[2:])
      return jnp.asarray(pages)

    kwargs = dict(local_window_size=(60, 0),
                  alibi_slopes=np.full((8,), 0.1, np.float32))
    options = implementation[1]
    # Jitted: run eagerly, each operation of the call compiles apart.
    out_paged = jax.jit(lambda q, k, v, lengths, block_table: (
        jflash.decode_attention(q, k, v, lengths, block_table=block_table,
                                num_splits=3, **options, **kwargs)))(
                                    q, paged(k), paged(v), lengths,
                                    block_table)
    out_dense = self._check(options, q, k, v, lengths, **kwargs)[0]
    np.testing.assert_allclose(out_paged, out_dense, atol=2e-6, rtol=2e-6)

  @parameterized.named_parameters(
      ("decode_gathered_tiles", "decode", 16, 5),
      ("decode_tiles_in_one_page", "decode", 64, 1),
      ("xla", "xla", 16, 5))
  def test_nothing_past_the_lengths_is_read(self, implementation, page_size,
                                            num_tokens):
    # NaN wherever a sequence has no entry: in the dense cache's rows past
    # its length, in the rest of its last page, and in the page that the
    # table names past its pages. With 32-key tiles, pages of 16
    # make tiles gather rows from two pages; pages of 64 hold whole tiles.
    # Nothing of it may reach the output (a masked product would still give
    # 0 * NaN).
    self.enter_context(mock.patch.object(
        decode_backend, "DEFAULT_LAUNCH", decode_backend.DecodeLaunch(block_k=32)))
    options = dict(IMPLEMENTATIONS)[implementation]
    # One jitted function for every call: the clean and the poisoned dense
    # caches share one program (one interpreted kernel), the pages another.
    attend = jax.jit(lambda q, k, v, lengths, **table: (
        jflash.decode_attention(q, k, v, lengths, num_splits=2,
                                return_residual=True,
                                residual_dtype=jnp.float32, **options,
                                **table)))
    q, k, v = _inputs(9, num_tokens=num_tokens, num_heads=8, num_kv_heads=2,
                      kv_seq=192)
    lengths = np.array([192, 70, 0], np.int32)
    expected = self._check_results(*attend(q, k, v, lengths), q, k, v,
                                   lengths)[0]
    written = (np.arange(k.shape[1])[None, :]
               < np.asarray(lengths)[:, None])[:, :, None, None]
    k, v = (np.where(written, np.asarray(x), np.nan) for x in (k, v))
    out = attend(q, k, v, lengths)[0]
    np.testing.assert_allclose(out, expected, atol=2e-6, rtol=2e-6)

    batch, kv_seq = k.shape[:2]
    max_pages = kv_seq // page_size
    order = np.random.default_rng(page_size).permutation(batch * max_pages)
    poison = batch * max_pages  # The last page: all NaN.
    used = -(-np.asarray(lengths) // page_size)
    block_table = np.where(np.arange(max_pages)[None] < used[:, None],
                           order.reshape(batch, max_pages), poison)

    def paged(cache):
      pages = np.full((poison + 1, page_size, *cache.shape[2:]), np.nan,
                      np.float32)
      pages[order] = cache.reshape(-1, page_size, *cache.shape[2:])
      return jnp.asarray(pages)

    out = attend(q, paged(k), paged(v), lengths,
                 block_table=jnp.asarray(block_table))[0]
    np.testing.assert_allclose(out, expected, atol=2e-6, rtol=2e-6)

  def test_every_split_count_gives_the_same_result(self):
    q, k, v = _inputs(3, num_tokens=2)
    lengths = jnp.array([96, 40, 0], jnp.int32)
    # All counts in one jitted program (one XLA compilation; eager, each
    # operation around the kernels compiled apart).
    results = jax.jit(lambda q, k, v, lengths: [jflash.decode_attention(
        q, k, v, lengths, implementation="decode",
        interpret=test_util.INTERPRET, num_splits=splits,
        return_residual=True, residual_dtype=jnp.float32)
               # 1: no split (six tiles in one split's loop); 6: one 16-key
               # tile each; 7: more splits than tiles (an empty one). On CPU
               # 2 (three tiles per split) is left out: its loop runs as 1's
               # and its merge of splits as 6's, in the same interpreted
               # lines, and each count is a kernel of its own.
               for splits in test_util.sweep((1, 2, 7, 6), (1, 7, 6))])(
                   q, k, v, lengths)
    for result in results[1:]:
      np.testing.assert_allclose(result[0], results[0][0], atol=2e-6,
                                 rtol=2e-6)
    # The 7 splits' call (computed above) against the reference.
    self._check_results(*results[-2], q, k, v, lengths)

  def test_bfloat16_cache(self):
    q, k, v = _inputs(4, dtype="bfloat16", num_tokens=1, num_heads=8,
                      num_kv_heads=1)
    self._check(dict(implementation="decode", interpret=test_util.INTERPRET,
                     num_splits=3), q, k, v,
                jnp.array([96, 33, 64], jnp.int32))

  def test_matches_flash_attention_bottom_right(self):
    q, k, v = _inputs(5, num_tokens=4)
    lengths = jnp.array([96, 20, 4], jnp.int32)
    # Jitted, both in one program: eager, each operation compiles apart.
    expected, ours = jax.jit(lambda q, k, v, lengths: (
        jflash.flash_attention(
            q, k, v, is_causal=True, causal_alignment="bottom_right",
            key_value_seq_lengths=lengths, implementation="xla"),
        jflash.decode_attention(q, k, v, lengths, implementation="decode",
                                interpret=test_util.INTERPRET)))(
                                    q, k, v, lengths)
    np.testing.assert_allclose(ours, expected, atol=2e-5, rtol=2e-5)

  def test_rows_split_over_several_launches(self):
    # More packed rows (tokens x GQA group) than one launch takes: the rows
    # go to launches of MAX_ROWS_PER_LAUNCH rows (16 here, so the small
    # test shapes cross launches), each with its row offset; ALiBi slopes
    # and windows depend on the row's token, so an offset error shows.
    self.enter_context(mock.patch.object(
        triton_decode, "MAX_ROWS_PER_LAUNCH", 16))
    q, k, v = _inputs(11, num_tokens=5, num_heads=8, num_kv_heads=2)
    lengths = jnp.array([96, 40, 3], jnp.int32)
    with test_util.spy(triton_decode, "decode_call") as calls:
      self._check(IMPLEMENTATIONS[0][1], q, k, v, lengths,
                  alibi_slopes=np.linspace(0.05, 0.4, 8, dtype=np.float32),
                  local_window_size=(30, 0),
                  sinks=np.linspace(-1, 1, 8, dtype=np.float32))
    # 5 tokens x 4 heads = 20 rows, padded to 32: two launches of 16.
    self.assertEqual([c.kwargs["row_offset"] for c in calls.call_args_list],
                     [0, 16])

  def test_split_count_heuristic(self):
    # No split once B x K programs fill the GPU; else as many as fit one
    # wave of 2 programs per multiprocessor (264 on a GPU of 132), at least
    # four key tiles each.
    self.enter_context(mock.patch.object(
        decode_backend.platform, "multiprocessor_count", return_value=132))
    self.assertEqual(decode_backend.default_num_splits(64, 8, 4096, 64), 1)
    self.assertEqual(decode_backend.default_num_splits(1, 8, 32768, 64), 33)
    self.assertEqual(decode_backend.default_num_splits(1, 8, 256, 64), 1)
    self.assertEqual(decode_backend.default_num_splits(8, 8, 8192, 64), 4)
    # 4 x 8 = 32 programs: 8 splits (256 programs), not 9 (288).
    self.assertEqual(decode_backend.default_num_splits(4, 8, 16384, 64), 8)

  def test_fp8_split_count_cuts_the_tail_of_few_waves(self):
    # FP8 caches, 3 programs per multiprocessor (396 on a GPU of 132):
    # below 2.5 waves of one-split programs (990), at least 4 splits; the
    # bf16 rule's count where it is larger; never more than `most`.
    self.enter_context(mock.patch.object(
        decode_backend.platform, "multiprocessor_count", return_value=132))
    splits = functools.partial(decode_backend.default_num_splits, fp8=True)
    self.assertEqual(splits(64, 8, 2048, 64), 4)  # 1.29 waves
    self.assertEqual(decode_backend.default_num_splits(64, 8, 2048, 64), 1)
    self.assertEqual(splits(96, 8, 2048, 64), 4)  # 1.94 waves
    self.assertEqual(splits(48, 8, 4096, 64), 4)  # 0.97 waves
    self.assertEqual(splits(123, 8, 2048, 64), 4)  # 984 programs
    self.assertEqual(splits(124, 8, 2048, 64), 1)  # 992: 2.5 waves
    self.assertEqual(splits(128, 8, 1024, 64), 1)  # 2.59 waves
    self.assertEqual(splits(64, 8, 512, 64), 2)  # 8 key tiles: 2 at most
    self.assertEqual(splits(64, 8, 128, 64), 1)  # 2 key tiles
    # Fewer programs: the bf16 rule's count where it is larger.
    self.assertEqual(splits(16, 8, 8192, 64), 4)  # bf16: 2
    self.assertEqual(splits(1, 8, 32768, 64), 33)  # bf16: 33

  def test_wide_tile_launch_where_it_was_measured(self):
    # WIDE_TILE_LAUNCH first for a 16-row tile of 16-bit elements at head
    # dim 128, dense or pages a multiple of 128 keys, with one split or
    # splits of at least WIDE_TILE_MIN_KEYS_PER_SPLIT keys; DEFAULT_LAUNCH
    # alone elsewhere.
    wide, default = (decode_backend.WIDE_TILE_LAUNCH,
                     decode_backend.DEFAULT_LAUNCH)
    least = decode_backend.WIDE_TILE_MIN_KEYS_PER_SPLIT
    prefer = lambda **kw: decode_backend.preferred_launches(**{
        **dict(num_splits=1, kv_seq=512, rows_padded=16, head_dim=128,
               itemsize=2), **kw})
    self.assertEqual(prefer(), (wide, default))
    self.assertEqual(prefer(head_dim=96), (wide, default))
    self.assertEqual(prefer(page_size=256), (wide, default))
    self.assertEqual(prefer(num_splits=3, kv_seq=3 * least), (wide, default))
    for changes in (dict(num_splits=2), dict(num_splits=3,
                                              kv_seq=3 * least - 1),
                    dict(rows_padded=32), dict(head_dim=256),
                    dict(head_dim=64), dict(itemsize=4),
                    dict(page_size=64)):
      self.assertEqual(prefer(**changes), (default,), msg=f"{changes}")
    with mock.patch.object(decode_backend, "WIDE_TILE_LAUNCH", None):
      self.assertEqual(prefer(), (default,))
    # FP8 caches (1-byte elements): FP8_LAUNCH first, whatever the rest.
    # (The kernel's own default launch, DecodeLaunch(): the suite's
    # DEFAULT_LAUNCH may have smaller tiles.)
    fp8, stock = decode_backend.FP8_LAUNCH, decode_backend.DecodeLaunch()
    self.assertEqual((fp8.block_k, fp8.num_warps, fp8.num_stages),
                     (stock.block_k, stock.num_warps, stock.num_stages - 1))
    for changes in (dict(), dict(num_splits=2), dict(head_dim=256),
                    dict(rows_padded=64), dict(page_size=16)):
      self.assertEqual(prefer(itemsize=1, **changes), (fp8, default),
                       msg=f"{changes}")
    with mock.patch.object(decode_backend, "FP8_LAUNCH", None):
      self.assertEqual(prefer(itemsize=1), (default,))

  @parameterized.named_parameters(("dense", None, 1),
                                  ("pages_of_128", 128, 1),
                                  ("two_splits", None, 2))
  def test_wide_tile_launch_matches_the_reference(self, page_size,
                                                  num_splits):
    # bfloat16, head dim 128, one token x a GQA group of 4 (4 rows of a
    # 16-row tile): 128-key tiles over caches that end inside a tile, ALiBi
    # (the slopes of 4 rows) and sinks; in one split, or in two (each
    # 192 keys long here: the threshold lowered so that a short test cache
    # takes the wide tiles).
    self.enter_context(mock.patch.object(
        decode_backend, "WIDE_TILE_MIN_KEYS_PER_SPLIT", 128))
    q, k, v = _inputs(12, batch=3, num_tokens=1, num_heads=8,
                      num_kv_heads=2, kv_seq=384, head_dim=128,
                      dtype="bfloat16")
    lengths = jnp.array([384, 131, 0], jnp.int32)
    extra = {}
    if page_size:
      pages = lambda x: x.reshape(-1, page_size, *x.shape[2:])
      extra["block_table"] = np.arange(9, dtype=np.int32).reshape(3, 3)
    options = dict(implementation="decode", interpret=test_util.INTERPRET,
                   num_splits=num_splits)
    kwargs = dict(alibi_slopes=np.linspace(0.01, 0.1, 8, dtype=np.float32),
                  sinks=np.linspace(-1, 1, 8, dtype=np.float32))
    with test_util.spy(triton_decode, "decode_call") as calls:
      out, lse = jax.jit(lambda q, k, v, lengths: jflash.decode_attention(
          q, pages(k) if page_size else k, pages(v) if page_size else v,
          lengths, return_residual=True, residual_dtype=jnp.float32,
          **options, **extra, **kwargs))(q, k, v, lengths)
    self.assertEqual(calls.call_args.kwargs["block_k"],
                     decode_backend.WIDE_TILE_LAUNCH.block_k)
    self._check_results(out, lse, q, k, v, lengths, **kwargs)
    if page_size:
      return  # A paged cache is read in the forward pass only.
    # A dense cache is differentiable: the default route runs the forward
    # on the decode kernel (wide tiles, as above) and the backward on
    # another backend from its out and lse; against the XLA path's.
    out_cotangent = _inputs(13, batch=3, num_tokens=1, num_heads=8,
                            num_kv_heads=2, head_dim=128,
                            dtype="bfloat16")[0]
    lse_cotangent = np.linspace(-1.0, 1.0, 3 * 8,
                                dtype=np.float32).reshape(3, 1, 8)

    def gradients(**call_options):
      def loss(q, k, v):
        out, lse = jflash.decode_attention(
            q, k, v, lengths, return_residual=True,
            residual_dtype=jnp.float32, **call_options, **kwargs)
        lse = jnp.where(jnp.isinf(lse), 0.0, lse)
        return (jnp.sum(out.astype(jnp.float32) * out_cotangent)
                + jnp.sum(lse * lse_cotangent))
      return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    # (num_splits names the decode backend, which has no backward: the
    # route's split count is set instead.)
    with test_util.spy(triton_decode, "decode_call") as calls, \
        mock.patch.object(decode_backend, "default_num_splits",
                          return_value=num_splits):
      grads = gradients(interpret=test_util.INTERPRET)
    self.assertEqual(
        (calls.call_args.kwargs["block_k"], calls.call_args.kwargs[
            "num_splits"]),
        (decode_backend.WIDE_TILE_LAUNCH.block_k, num_splits))
    tolerance = tolerances.direct(jnp.bfloat16)
    chex.assert_trees_all_close(grads, gradients(implementation="xla"),
                                atol=tolerance, rtol=tolerance)

  def test_gradients_of_a_dense_cache_paged_raises(self):
    # decode_attention is flash_attention's call: a dense cache is
    # differentiable (the forward on the decode kernel, the backward on
    # another backend); a paged cache is read in the forward only.
    q, k, v = _inputs(6, batch=1, num_tokens=2, num_heads=4, num_kv_heads=2)
    lengths = jnp.array([50])
    loss = lambda q, k, v, **kw: jflash.decode_attention(
        q, k, v, lengths, **kw).sum()
    # Jitted: eager, each operation of the passes compiles apart.
    grads = jax.jit(jax.grad(functools.partial(loss, implementation="xla"),
                             argnums=(0, 1, 2)))(q, k, v)
    expected = jax.jit(jax.grad(lambda q, k, v: jflash.flash_attention(
        q, k, v, is_causal=True, causal_alignment="bottom_right",
        key_value_seq_lengths=lengths, implementation="xla").sum(),
                                argnums=(0, 1, 2)))(q, k, v)
    chex.assert_trees_all_close(grads, expected, atol=1e-6, rtol=1e-6)
    pages = np.asarray(k).reshape(6, 16, 2, 32)
    table = np.arange(6)[None]
    with self.assertRaisesRegex(NotImplementedError,
                                "paged cache.*forward pass only"):
      jax.jit(jax.grad(lambda q: loss(q, pages, pages, block_table=table))
              ).trace(q)  # Raised while tracing.

  def test_deprecated_spellings_warn_and_keep_working(self):
    q, k, v = _inputs(14, num_tokens=1)
    lengths = jnp.array([96, 30, 5], jnp.int32)
    # Jitted (the warnings come while tracing): eager, each operation of
    # the call compiles apart.
    decode = lambda **kw: jax.jit(lambda q, k, v, lengths: (
        jflash.decode_attention(q, k, v, lengths, **kw)))(q, k, v, lengths)
    with self.assertWarnsRegex(DeprecationWarning, "return_residuals"):
      out, lse = decode(return_residuals=True)
    self.assertEqual(lse.dtype, jnp.float32)
    ours = decode(return_residual=True)
    chex.assert_trees_all_equal((out, lse), ours)
    with self.assertWarnsRegex(DeprecationWarning, "'decode'"):
      old = decode(implementation="triton", interpret=test_util.INTERPRET)
    new = decode(implementation="decode", interpret=test_util.INTERPRET)
    chex.assert_trees_all_equal(old, new)

  def test_window_without_causality_sits_at_the_end_in_both_functions(self):
    # One window semantics: bottom-right alignment places the window at
    # the end of the cache also without the causal mask.
    q, k, v = _inputs(15, num_tokens=2)
    lengths = jnp.array([96, 30, 5], jnp.int32)
    # Jitted: eager, each operation of the calls compiles apart.
    ours = jax.jit(lambda q, k, v, lengths: jflash.decode_attention(
        q, k, v, lengths, is_causal=False, local_window_size=(10, 0),
        implementation="xla"))(q, k, v, lengths)
    theirs = jax.jit(lambda q, k, v, lengths: jflash.flash_attention(
        q, k, v, causal_alignment="bottom_right", local_window_size=(10, 0),
        key_value_seq_lengths=lengths, implementation="xla"))(
            q, k, v, lengths)
    chex.assert_trees_all_equal(ours, theirs)
    ref, _ = reference(q, k, v, np.asarray(lengths), is_causal=False,
                       window=(10, 0))
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=2e-5)

  @parameterized.named_parameters(
      ("too_many_tokens", dict(num_tokens=17), {}, ValueError,
       "1 to 16 new tokens.*flash_attention"),
      ("lengths_shape", {}, dict(lengths=jnp.zeros((2,), jnp.int32)),
       ValueError, "key_value_seq_lengths must be an integer array of "
       "shape \\(3,\\)"),
      ("lengths_dtype", {}, dict(lengths=jnp.zeros((3,))), ValueError,
       "key_value_seq_lengths must be an integer"),
      ("table_shape", {}, dict(block_table=jnp.zeros((2, 4), jnp.int32)),
       ValueError, "block_table must be an integer array \\[batch, "
       "max_pages\\] = \\[3, max_pages\\]"),
      ("table_dtype", {}, dict(block_table=jnp.zeros((3, 4))), ValueError,
       "block_table must be an integer array"),
      ("page_size", dict(kv_seq=40), dict(block_table=jnp.zeros((3, 4),
                                                                jnp.int32)),
       ValueError, "page_size a multiple of 16"),
      ("splits", {}, dict(num_splits=0), ValueError, "num_splits"),
      ("implementation", {}, dict(implementation="bogus"), ValueError,
       "implementation must be one of"),
      ("three_d", dict(batch=None), {}, ValueError, "decode_attention takes"),
  )
  def test_bad_input(self, shape, kwargs, error, message):
    kwargs = dict(kwargs)
    if shape.get("batch", 1) is None:
      q = jnp.ones((2, 4, 32))
      k = v = jnp.ones((96, 2, 32))
    else:
      q, k, v = _inputs(7, **shape)
    lengths = kwargs.pop("lengths", np.full((3,), 5, np.int32))
    with self.assertRaisesRegex(error, message):
      jflash.decode_attention(q, k, v, lengths, **kwargs)


class FlashAttentionDecodeBackendTest(parameterized.TestCase):
  """flash_attention(implementation="decode"): the split-K kernel with
  flash_attention's semantics, against the Triton training kernel."""

  def setUp(self):
    super().setUp()
    self.enter_context(mock.patch.object(
        decode_backend, "DEFAULT_LAUNCH", decode_backend.DecodeLaunch(block_k=16)))

  _TRAINING_KERNEL_CASES = (
      ("causal_top_left", dict(is_causal=True)),
      ("bottom_right_lengths_alibi", dict(
          is_causal=True, causal_alignment="bottom_right",
          query_seq_lengths=np.array([3, 1, 0], np.int32),
          key_value_seq_lengths=np.array([96, 40, 7], np.int32),
          alibi_slopes=np.linspace(0.1, 0.8, 8, dtype=np.float32))),
      ("window_soft_cap_sinks", dict(
          local_window_size=(8, 4), logits_soft_cap=4.0,
          sinks=np.linspace(-1.0, 1.0, 8, dtype=np.float32))),
      ("alibi_bottom_right", dict(
          is_causal=True, causal_alignment="bottom_right",
          alibi_slopes=np.linspace(0.1, 0.8, 8, dtype=np.float32))),
  )

  # On CPU, ALiBi bottom-right runs only with the lengths (in the same
  # interpreted lines, the slopes the same): each case is two kernels.
  @parameterized.named_parameters(*test_util.sweep(
      _TRAINING_KERNEL_CASES, cpu_cases=_TRAINING_KERNEL_CASES[:3]))
  def test_same_as_the_training_kernel(self, options):
    q, k, v = _inputs(9, num_tokens=3, num_heads=8, num_kv_heads=2)
    kernels = dict(interpret=test_util.INTERPRET, return_residual=True,
                   residual_dtype=jnp.float32, **options)
    # Jitted, both in one program: eager, each operation compiles apart.
    ours, expected = jax.jit(lambda q, k, v: tuple(
        jflash.flash_attention(q, k, v, implementation=implementation,
                               **kernels)
        for implementation in ("decode", "triton")))(q, k, v)
    for x, y in zip(ours, expected):
      np.testing.assert_array_equal(np.isinf(x), np.isinf(y))
      np.testing.assert_allclose(np.where(np.isinf(y), 0, x),
                                 np.where(np.isinf(y), 0, y), atol=2e-5,
                                 rtol=2e-5)

  @parameterized.named_parameters(
      ("bottom_right_window_lengths", dict(
          is_causal=True, causal_alignment="bottom_right",
          local_window_size=(20, 0),
          query_seq_lengths=np.array([3, 1, 0], np.int32),
          key_value_seq_lengths=np.array([96, 40, 7], np.int32))),
      ("sinks_soft_cap", dict(logits_soft_cap=4.0,
                              sinks=np.linspace(-1.0, 1.0, 8,
                                                dtype=np.float32))),
  )
  def test_default_route_gradients(self, options):
    # implementation=None: the decode kernel runs the forward and another
    # backend the backward, from the decode kernel's residuals (out and
    # lse); output, lse and all gradients against the XLA path.
    q, k, v = _inputs(11, num_tokens=3, num_heads=8, num_kv_heads=2)
    cotangents = _inputs(12, num_tokens=3, num_heads=8, num_kv_heads=2)[0]
    lse_cotangent = np.random.default_rng(13).standard_normal(
        (3, 3, 8), np.float32)

    def value_and_grads(implementation, **kwargs):
      def loss(q, k, v):
        out, lse = jflash.flash_attention(
            q, k, v, implementation=implementation, return_residual=True,
            residual_dtype=jnp.float32, **options, **kwargs)
        lse = jnp.where(jnp.isinf(lse), 0.0, lse)
        return (jnp.sum(out * cotangents) + jnp.sum(lse * lse_cotangent),
                (out, lse))
      # Jitted: run eagerly, each operation compiles apart.
      return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(
          q, k, v)

    with test_util.decode_kernel_spy() as kernel_calls:
      grads, (out, lse) = value_and_grads(None,
                                          interpret=test_util.INTERPRET)
    self.assertGreater(kernel_calls.call_count, 0)
    expected_grads, (expected_out, expected_lse) = value_and_grads("xla")
    for got, want in ((out, expected_out), (lse, expected_lse),
                      *zip(grads, expected_grads)):
      np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)

  def test_forward_only_and_its_limits(self):
    q, k, v = _inputs(10, num_tokens=2)
    run = lambda q, **kw: jflash.flash_attention(
        q, k, v, implementation="decode", interpret=test_util.INTERPRET,
        **kw)
    with self.assertRaisesRegex(NotImplementedError, "decode has no "
                                "backward pass"):
      # Raised while tracing (eager, the forward kernel would run first).
      jax.jit(jax.grad(lambda q: run(q).sum())).trace(q)
    q17 = jnp.ones((3, 17, 4, 32))
    with self.assertRaisesRegex(NotImplementedError, "decode takes at most "
                                "16 query rows per sequence; got q_len=17"):
      run(q17)


if __name__ == "__main__":
  absltest.main()
