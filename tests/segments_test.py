"""Segment ids (packed sequences), forward and gradients, against jax.nn.

jax.nn has no segment ids: it gets the equivalent dense boolean mask
q_ids[b, t] == kv_ids[b, s]. Where rows may see no key at all (jax.nn
averages the values there, jflash outputs 0), or with options jax.nn lacks,
the reference is jflash's pure-JAX path, itself checked against jax.nn here
(on the XLA target). Runs per backend (tests/test_base.py): the Pallas
kernels and the XLA path; the host-side tile ranges are backend-free.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import jflash
from jflash._src import masks
from tests import test_base
from tests import test_util


def _ids(*runs):
  """Segment ids from (id, length) runs: _ids((0, 3), (1, 2)) = [0 0 0 1 1]."""
  return np.concatenate([np.full(n, i, np.int32) for i, n in runs])


def _batch(*rows):
  return jnp.asarray(np.stack(rows), jnp.int32)


def _dense_mask(q_ids, kv_ids):
  """jax.nn's equivalent of segment ids: bool [B, 1, T, S]."""
  return (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]


# Two batch elements of packed self-attention, segments of odd lengths.
PACKED = _batch(_ids((0, 13), (1, 30), (2, 27), (3, 1)),
                _ids((7, 40), (3, 5), (9, 26)))


class SegmentsTest(test_base.BackendTestCase):

  def _step(self, **kwargs):
    """Jitted (q, k, v, dout) -> (out, dq, dk, dv) of the backend."""
    fn = self.flash(**kwargs)
    return jax.jit(functools.partial(test_util.value_and_grads, fn))

  def _results(self, q, k, v, dout, **kwargs):
    return self._step(**kwargs)(q, k, v, dout)

  # On CPU float32_causal is left out: its mask lines run in bfloat16_causal
  # and its dtype's in float32 (the interpreter's lines do not depend on the
  # dtype).
  @parameterized.named_parameters(*test_util.sweep(
      [("float32", "float32", False), ("float32_causal", "float32", True),
       ("bfloat16_causal", "bfloat16", True)],
      cpu_cases=[("float32", "float32", False),
                 ("bfloat16_causal", "bfloat16", True)]))
  def test_packed_self_attention(self, dtype, is_causal):
    q, k, v, dout = test_util.random_inputs(
        80, q_len=71, kv_len=71, num_heads=4, num_kv_heads=2, dtype=dtype)
    kwargs = dict(is_causal=is_causal)
    if is_causal:
      # With a query length too: on the XLA target, the check against
      # jax.nn of the path the other tests use as their reference.
      kwargs.update(query_seq_lengths=jnp.array([71, 60], jnp.int32))
    results = self._results(q, k, v, dout, q_segment_ids=PACKED,
                            kv_segment_ids=PACKED, **kwargs)
    test_util.assert_close_to_jax_nn(self, results, q, k, v, dout,
                                     mask=_dense_mask(PACKED, PACKED),
                                     **kwargs)
    if not is_causal:
      # vmap over unbatched calls gives the batched results: the segment
      # ids fold into the batch too.
      flash = lambda q, k, v, ids: self.flash(
          q_segment_ids=ids, kv_segment_ids=ids)(q, k, v)
      vmapped = test_util.STEP(
          lambda q, k, v: jax.vmap(flash)(q, k, v, PACKED), q, k, v, dout)
      tolerance = 1e-6 if dtype == "float32" else 1e-2
      chex.assert_trees_all_close(vmapped, results, rtol=tolerance,
                                  atol=tolerance)

  def test_unsorted_ids_and_segments_without_keys(self):
    # Cross-attention (T != S), one call for two kinds of batch element (one
    # kernel program, not two: each costs seconds of compilation on CPU).
    # Elements 0 and 1: ids in no order, a segment split into several runs;
    # every query id occurs among the keys, so no row is empty and jax.nn
    # (which averages the values of an empty row) is their reference.
    q_ids = [_ids((2, 9), (0, 20), (2, 11), (-1, 24)),
             _ids((5, 30), (1, 34))]
    kv_ids = [_ids((0, 33), (2, 17), (-1, 30), (0, 20), (2, 5)),
              _ids((1, 3), (5, 60), (1, 40), (4, 2))]
    # Elements 2 and 3: query segment 4 (rows 20..44 of element 2,
    # mid-sequence, and rows 10.. of element 3) has no key: those rows
    # output 0 and pass zero, finite gradients; keys of segment 6 are seen
    # by no query and get zero dK/dV. Against jflash's XLA path.
    q_ids += [_ids((1, 20), (4, 25), (2, 19)), _ids((3, 10), (4, 54))]
    kv_ids += [_ids((1, 17), (6, 40), (2, 48)), _ids((3, 105))]
    q_ids, kv_ids = _batch(*q_ids), _batch(*kv_ids)
    q, k, v, dout = test_util.random_inputs(81, batch=4, q_len=64,
                                            kv_len=105)
    kwargs = dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    out, dq, dk, dv = results = self._results(q, k, v, dout, **kwargs)
    # The batch elements are independent: 0 and 1 alone against jax.nn.
    test_util.assert_close_to_jax_nn(
        self, tuple(x[:2] for x in results), q[:2], k[:2], v[:2], dout[:2],
        mask=_dense_mask(q_ids[:2], kv_ids[:2]))
    chex.assert_tree_all_finite(results)
    for name, x in (("out", out[2, 20:45]), ("dq", dq[2, 20:45]),
                    ("out_3", out[3, 10:]), ("dq_3", dq[3, 10:]),
                    ("dk", dk[2, 17:57]), ("dv", dv[2, 17:57])):
      np.testing.assert_array_equal(np.asarray(x), 0.0, err_msg=name)
    test_util.assert_close_to_reference(self, results, q, k, v, dout,
                                        **kwargs)

  @parameterized.named_parameters(
      ("causal_window_lengths_gqa", dict(
          is_causal=True, local_window_size=(20, 0),
          query_seq_lengths=jnp.array([71, 50], jnp.int32),
          key_value_seq_lengths=jnp.array([60, 71], jnp.int32))),
      ("bottom_right_window_soft_cap", dict(
          is_causal=True, causal_alignment="bottom_right",
          local_window_size=(9, 4), logits_soft_cap=3.0,
          query_seq_lengths=jnp.array([44, 71], jnp.int32),
          key_value_seq_lengths=jnp.array([71, 30], jnp.int32))),
  )
  def test_with_every_other_mask(self, options):
    self.require_independent_reference()
    q, k, v, dout = test_util.random_inputs(
        82, q_len=71, kv_len=71, num_heads=4, num_kv_heads=1)
    kwargs = dict(options, q_segment_ids=PACKED, kv_segment_ids=PACKED)
    results = self._results(q, k, v, dout, **kwargs)
    test_util.assert_close_to_reference(self, results, q, k, v, dout,
                                        **kwargs)

  @parameterized.named_parameters(("full", False), ("causal", True))
  def test_tiles_of_other_segments_are_never_read(self, is_causal):
    self.require_kernels("tile skipping; the XLA path reads every element "
                         "by design")
    # Keys 2t.. belong to a segment no query has, and queries t.. to a
    # segment with no key: poison them (and those rows' output cotangents)
    # with NaN. The edges (t, 2t) are multiples of every tile of the
    # target's kernels (t = tile_rows), so whole tiles are skipped in the
    # forward, dK/dV and dQ kernels; any read of them would turn the
    # results NaN.
    t = self.TARGET.tile_rows
    q, k, v, dout = test_util.random_inputs(
        84, batch=1, q_len=2 * t, kv_len=4 * t, num_heads=4, num_kv_heads=2)
    kwargs = dict(is_causal=is_causal,
                  q_segment_ids=_batch(_ids((1, t), (3, t))),
                  kv_segment_ids=_batch(_ids((1, 2 * t), (2, 2 * t))))
    step = self._step(**kwargs)
    clean = step(q, k, v, dout)
    poisoned = step(q.at[:, t:].set(jnp.nan), k.at[:, 2 * t:].set(jnp.nan),
                    v.at[:, 2 * t:].set(jnp.nan),
                    dout.at[:, t:].set(jnp.nan))
    chex.assert_tree_all_finite(poisoned)
    chex.assert_trees_all_equal(poisoned, clean)

  @parameterized.named_parameters(
      ("only_q", dict(q_segment_ids=jnp.zeros((2, 16), jnp.int32)),
       r"q_segment_ids \(shape \(2, 16\)\) was given without kv_segment_ids"),
      ("only_kv", dict(kv_segment_ids=jnp.zeros((2, 24), jnp.int32)),
       "kv_segment_ids .* was given without q_segment_ids"),
      ("q_wrong_length", dict(q_segment_ids=jnp.zeros((2, 24), jnp.int32),
                              kv_segment_ids=jnp.zeros((2, 24), jnp.int32)),
       r"q_segment_ids must have shape \[B, T\] = \(2, 16\); got "
       r"q_segment_ids.shape=\(2, 24\)"),
      ("kv_unbatched", dict(q_segment_ids=jnp.zeros((2, 16), jnp.int32),
                            kv_segment_ids=jnp.zeros((24,), jnp.int32)),
       r"kv_segment_ids must have shape \[B, S\] = \(2, 24\)"),
      ("float", dict(q_segment_ids=jnp.zeros((2, 16), jnp.float32),
                     kv_segment_ids=jnp.zeros((2, 24), jnp.int32)),
       "q_segment_ids must be an integer array; got "
       "q_segment_ids.dtype=float32"),
  )
  def test_bad_segment_ids(self, kwargs, message):
    q, k, v = (jnp.ones((2, 16, 4, 32)), jnp.ones((2, 24, 2, 32)),
               jnp.ones((2, 24, 2, 32)))
    with self.assertRaisesRegex(ValueError, message):
      # Validation runs at trace time, before any kernel is lowered.
      jax.jit(functools.partial(
          jflash.flash_attention, implementation=self.implementation,
          **self.options, **kwargs)).lower(q, k, v)

  def test_bad_unbatched_segment_ids(self):
    q, k, v = jnp.ones((16, 4, 32)), jnp.ones((24, 2, 32)), jnp.ones(
        (24, 2, 32))
    with self.assertRaisesRegex(ValueError, r"shape \[T\] = \(16,\)"):
      jflash.flash_attention(q, k, v, q_segment_ids=jnp.zeros((1, 16), int),
                             kv_segment_ids=jnp.zeros((24,), int),
                             implementation=self.implementation,
                             **self.options)


class SegmentTileRangesTest(parameterized.TestCase):
  """The host-side tile ranges, against brute force."""

  def _brute_force(self, ids, lengths, block, other_ids, other_lengths,
                   other_block):
    """Per tile pair (b, i, j): do they share a segment, and do their [min,
    max] id intervals meet (over valid positions)?"""
    tiles = lambda x, n, size, length: [
        x[i * size:min((i + 1) * size, length)]
        for i in range(-(-n // size))]
    shape = (ids.shape[0], -(-ids.shape[1] // block),
             -(-other_ids.shape[1] // other_block))
    shares, intervals_meet = np.zeros(shape, bool), np.zeros(shape, bool)
    for b in range(shape[0]):
      mine = tiles(ids[b], ids.shape[1], block, lengths[b])
      theirs = tiles(other_ids[b], other_ids.shape[1], other_block,
                     other_lengths[b])
      for i, j in np.ndindex(shape[1:]):
        if mine[i].size and theirs[j].size:
          shares[b, i, j] = bool(set(mine[i]) & set(theirs[j]))
          intervals_meet[b, i, j] = (theirs[j].max() >= mine[i].min()
                                     and theirs[j].min() <= mine[i].max())
    return shares, intervals_meet

  @parameterized.named_parameters(("sorted", True), ("unsorted", False))
  def test_ranges_hold_every_meeting_tile(self, is_sorted):
    rng = np.random.default_rng(7)
    # Few shapes (each compiles once), many random ids and lengths.
    ranges = jax.jit(masks.segment_tile_ranges, static_argnums=(2, 5))
    for seq, other_seq, block, other_block in (
        [(45, 37, 4, 8)] * 15 + [(9, 50, 16, 4)] * 15 + [(33, 33, 8, 8)] * 15):
      ids = rng.integers(-2, 5, (2, seq)).astype(np.int32)
      other_ids = rng.integers(-2, 5, (2, other_seq)).astype(np.int32)
      if is_sorted:
        ids, other_ids = np.sort(ids, axis=1), np.sort(other_ids, axis=1)
      lengths = rng.integers(0, seq + 1, 2).astype(np.int32)
      other_lengths = rng.integers(0, other_seq + 1, 2).astype(np.int32)
      first, stop = ranges(ids, lengths, block, other_ids, other_lengths,
                           other_block)
      shares, intervals_meet = self._brute_force(
          ids, lengths, block, other_ids, other_lengths, other_block)
      for b, i in np.ndindex(shares.shape[:2]):
        self.assertLessEqual(first[b, i], stop[b, i])
        needed = np.flatnonzero(shares[b, i])
        if needed.size:  # Every tile sharing a segment is in the range.
          self.assertLessEqual(first[b, i], needed[0])
          self.assertGreater(stop[b, i], needed[-1])
        if is_sorted:  # Tight: the first and last tiles whose intervals meet.
          meeting = np.flatnonzero(intervals_meet[b, i])
          if meeting.size:
            self.assertEqual((first[b, i], stop[b, i]),
                             (meeting[0], meeting[-1] + 1))
          else:
            self.assertEqual(first[b, i], stop[b, i])


test_base.for_each_backend(globals(), SegmentsTest)

if __name__ == "__main__":
  absltest.main()
