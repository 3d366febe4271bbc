"""The Mosaic kernels' masking and tiling, checked numerically on CPU.

No interpreter runs the Mosaic GPU kernels, so these tests run a model of
their tile walks (tests/mosaic_model.py: forward, dQ and dK/dV in NumPy
float64, every decision taken from the `pipeline.py` helpers the kernels
call; its docstring says what it models and checks) and compare out, lse2,
dq, dk, dv and dsinks with a dense float64 reference:

- `MosaicMaskingTest`: the model matches the reference on CASES (masks,
  lengths, segments, GQA, sinks, soft cap, head dims, tiles), and the
  reference matches jax.nn.dot_product_attention where jax.nn has the
  options;
- `ModelSensitivityTest`: a broken decision (a helper replaced by a wrong
  one, or the persistent grid's mapping) makes the model fail.
"""

from __future__ import annotations

import functools
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jflash._src import spec
from jflash._src.backends.mosaic import config as mosaic_config
from jflash._src.backends.mosaic import pipeline
from jflash._src.backends.mosaic.config import MosaicBlockSizes
from tests import mosaic_model as model
from tests import test_util

# Lengths that are not multiples of the tiles (nor of model.TMA_ROWS), T < S
# and T > S, default tiles unless stated (forward 64x128 at D <= 128, 64x64
# at D=256; backward 64x64).
CASES = (
    # Causal top-left, T < S, GQA (2 kv heads of 2 query heads), soft cap.
    ("causal_gqa_soft_cap",
     model.make_case(1, 100, 300, 4, 2, 128, is_causal=True,
                     soft_cap=20.0)),
    # Bottom-right with T > S: rows 0-169 see no key, only their sink.
    ("bottom_right_empty_rows_gqa_sinks",
     model.make_case(2, 300, 130, 2, 1, 64, is_causal=True,
                     bottom_right=True, soft_cap=5.0, sinks=True)),
    ("causal_window",
     model.make_case(1, 260, 261, 2, 2, 64, is_causal=True,
                     window=(70, 0))),
    ("two_sided_window_gqa_lengths_sinks",
     model.make_case(2, 200, 250, 4, 1, 64, window=(50, 30), sinks=True,
                     lengths=((200, 64), (100, 250)))),
    # Batch 1 has no keys, batch 2 no queries.
    ("causal_lengths_empty",
     model.make_case(3, 200, 260, 4, 2, 64, is_causal=True,
                     lengths=((200, 37, 0), (260, 0, 91)))),
    ("bottom_right_window_lengths_sinks",
     model.make_case(2, 190, 270, 2, 2, 128, is_causal=True,
                     bottom_right=True, window=(40, 10), soft_cap=30.0,
                     sinks=True, lengths=((150, 190), (270, 100)))),
    # D=256: the backward's two warpgroups share one row tile, one
    # computing the probabilities (and dV), the other taking them over
    # (dK, dQ); `test_d256_column_split` runs the column split.
    ("d256_gqa_causal_lengths",
     model.make_case(2, 140, 200, 4, 1, 256, is_causal=True,
                     lengths=((140, 77), (200, 150)))),
    # No mask and no lengths: the tile ranges are known when the kernels
    # are traced (pipeline.consumer_runs' static runs, empty runs left
    # out); T and S not tile multiples leave a masked last key tile.
    ("no_mask_static_runs_gqa_sinks",
     model.make_case(2, 150, 200, 4, 2, 128, soft_cap=10.0, sinks=True)),
    # Head dim 64: 256-key forward tiles, two of them in batch 0.
    ("no_mask_lengths_soft_cap",
     model.make_case(2, 70, 300, 2, 1, 64, soft_cap=10.0,
                     lengths=((70, 1), (300, 64)))),
    # T > S with a deeper forward ring and 64-key tiles, 128-row backward
    # tiles.
    ("causal_t_gt_s_other_tiles",
     model.make_case(1, 325, 199, 2, 2, 128, is_causal=True,
                     block_sizes=MosaicBlockSizes(
                         block_kv=64, num_stages=3, block_kv_dq=128,
                         block_q_dkv=128, backward_stages=2))),
    # Segments. With the default tiles a forward block is 128 query rows
    # (two row groups of 64) streaming 128-key tiles (64 at D=256), a
    # backward block two row groups of 64 rows (one at D=256) streaming
    # 128-row tiles at D=64, 64-row ones above: a segment edge on a
    # multiple of 128 takes whole tiles out of a block's range (the
    # producer's), one elsewhere out of one row group's only ("skip" runs),
    # or cuts a tile (element-wise).
    # Packed self-attention: batch 0's edges at 50, 128 and 228, batch 1's
    # at 200.
    ("packed_causal_gqa",
     model.make_case(
         2, 300, 300, 4, 2, 64, is_causal=True,
         segments=((model.id_runs((0, 50), (1, 78), (2, 100), (3, 72)),
                    model.id_runs((5, 200), (6, 100))),) * 2)),
    # Cross-attention, ids not sorted along the sequence and different on
    # the two sides, with lengths: batch 0's query segment 7 has no key
    # (rows 130-199 see none), batch 1's key segments come in the other
    # order.
    ("cross_unsorted_lengths_gqa_soft_cap",
     model.make_case(
         2, 200, 330, 2, 1, 128, soft_cap=10.0,
         lengths=((200, 150), (330, 260)),
         segments=((model.id_runs((3, 40), (1, 60), (3, 30), (7, 70)),
                    model.id_runs((0, 100), (2, 100))),
                   (model.id_runs((1, 128), (3, 100), (5, 102)),
                    model.id_runs((2, 130), (0, 200)))))),
    # D=256 (forward 64x64 tiles; the backward's warpgroups share each
    # row group, splitting its products), bottom-right with lengths (offset
    # 110, then 90), a window and sinks: batch 1's query segment 9 has no
    # key (rows 90-99: only their sink).
    ("d256_segments_bottom_right_window_sinks_lengths",
     model.make_case(
         2, 150, 260, 2, 1, 256, is_causal=True, bottom_right=True,
         window=(60, 10), sinks=True, lengths=((150, 140), (260, 230)),
         segments=((model.id_runs((0, 18), (1, 132)),
                    model.id_runs((4, 90), (9, 10), (5, 50))),
                   (model.id_runs((0, 128), (1, 132)),
                    model.id_runs((4, 150), (5, 110)))))),
)


@functools.cache
def _inputs_and_expected(case: model.Case):
  """A case's inputs (seed 0) and their reference results, computed once
  for the tests of both classes (NumPy arrays: not to be changed)."""
  inputs = model.random_inputs(case, seed=0)
  return inputs, model.reference(case, *inputs)


class MosaicMaskingTest(parameterized.TestCase):

  @parameterized.named_parameters(*CASES)
  def test_model_matches_reference(self, case):
    inputs, expected = _inputs_and_expected(case)
    model.assert_close(model.run_model(case, *inputs), expected)

  def test_d256_column_split(self):
    # config.BWD_SHARED_ROW_SPLIT = "columns" (an option): each warpgroup
    # of the shared row tile computes its probabilities and accumulates
    # half of the head-dim columns.
    case = dict(CASES)["d256_gqa_causal_lengths"]
    inputs, expected = _inputs_and_expected(case)
    model.clear_host_caches()
    try:
      with mock.patch.object(mosaic_config, "BWD_SHARED_ROW_SPLIT",
                             "columns"):
        model.assert_close(model.run_model(case, *inputs), expected)
    finally:
      model.clear_host_caches()

  def assert_reference_matches_jax_nn(self, case: model.Case, **options):
    """The reference against jax.nn.dot_product_attention(**options), on
    the rows that see a key."""
    q, k, v, dout, _ = model.random_inputs(case, seed=1)
    # jax.nn gives rows without keys the mean of the values (jflash and the
    # reference: 0): compare the rows that see a key, with no cotangent on
    # the others.
    seen = np.swapaxes(model.visible(case).any(-1), 1, 2)[..., None]
    self.assertTrue(seen.any() and not seen.all())
    dout = np.where(seen, dout, 0.0)
    attention = functools.partial(
        jax.nn.dot_product_attention,
        query_seq_lengths=jnp.asarray(case.lengths[0], jnp.int32),
        key_value_seq_lengths=jnp.asarray(case.lengths[1], jnp.int32),
        **options)

    with jax.default_matmul_precision("highest"):
      results = jax.jit(test_util.value_and_grads, static_argnums=0)(
          attention, *(jnp.asarray(x, jnp.float32) for x in (q, k, v, dout)))
    out, _, dq, dk, dv, _ = model.reference(case, q, k, v, dout, None)
    results = (np.where(seen, results[0], 0.0), *results[1:])
    for name, x, ref in zip(("out", "dq", "dk", "dv"), results,
                            (out, dq, dk, dv)):
      chex.assert_trees_all_close(
          np.asarray(x, np.float64), ref, rtol=0.0,
          atol=model.TOLERANCE * max(1.0, np.abs(ref).max()),
          custom_message=name)

  def test_reference_matches_jax_nn(self):
    # With the options jax.nn has: causal top-left, a window, lengths
    # (batch 1: rows 22-39 see no key), GQA.
    case = model.make_case(2, 40, 57, 4, 2, 64, is_causal=True,
                           window=(9, 0), lengths=((40, 40), (57, 13)))
    self.assert_reference_matches_jax_nn(case, is_causal=True,
                                         local_window_size=(9, 0))

  def test_reference_matches_jax_nn_segments(self):
    # Segments as jax.nn's dense mask, with causal top-left, lengths and
    # GQA: batch 0's query segment 2 and batch 1's 5 have no key, batch 1's
    # rows 0-9 (segment 3) none before them.
    case = model.make_case(
        2, 40, 57, 4, 2, 64, is_causal=True, lengths=((40, 34), (57, 50)),
        segments=((model.id_runs((0, 15), (1, 17), (2, 8)),
                   model.id_runs((3, 10), (4, 20), (5, 10))),
                  (model.id_runs((1, 10), (0, 20), (1, 27)),
                   model.id_runs((4, 25), (3, 32)))))
    q_ids, kv_ids = (np.asarray(x) for x in case.segments)
    self.assert_reference_matches_jax_nn(
        case, is_causal=True,
        mask=jnp.asarray(q_ids[:, None, :, None] == kv_ids[:, None, None, :]))


# Breakers: each takes a `pipeline` helper and returns a wrong one.


def _full_runs(consumer_runs):
  """consumer_runs, with every "masked" run marked "full"."""

  def broken(runs, lo, hi):
    return [(a, b, "full" if kind == "masked" else kind)
            for a, b, kind in consumer_runs(runs, lo, hi)]

  return broken


def _short_union(query_block):
  """query_block, with the producer's range one key tile short."""

  def broken(*args, **kwargs):
    block = query_block(*args, **kwargs)
    return block._replace(steps_hi=jnp.maximum(block.steps_hi - 1,
                                               block.steps_lo))

  return broken


def _unshifted_columns(key_tile_visible):
  """key_tile_visible, with the tile's columns not shifted to the tile."""
  return lambda mask, rows, columns, kv_step, block_kv, kv_len, offset, *ids: (
      key_tile_visible(mask, rows, columns, 0, block_kv, kv_len, offset,
                       *ids))


def _next_slot(group_slot):
  """group_slot, one slot further than the producer's."""
  return lambda head_step, q_tile_index, block, stages: lax.rem(
      group_slot(head_step, q_tile_index, block, stages) + 1, stages)


def _head_without_group(group_step_rows):
  """group_step_rows, loading query head kv_head + i for the group's i-th
  (not kv_head * group + i)."""

  def broken(step, block, group, block_q):
    head, q_start = group_step_rows(step, block, group, block_q)
    return head - block.kv_head * (group - 1), q_start

  return broken


def _same_rows(row_group_start):
  """row_group_start, giving every row group the block's first rows."""
  return lambda block_start, row_group, rows: row_group_start(
      block_start, 0 * row_group, rows)


def _shifted_ranges(segment_range):
  """segment_range, its (first, stop) one tile further (the table read at
  the wrong offset)."""

  def broken(ranges_ref, batch):
    read = segment_range(ranges_ref, batch)
    return None if read is None else (
        lambda tile: tuple(x + 1 for x in read(tile)))

  return broken


def _ids_not_compared(positions: int):
  """A breaker of key_tile_visible / query_tile_visible (`positions`
  arguments before the ids tiles) that drops the ids: no segment mask."""
  return lambda visible: lambda *args: visible(*args[:positions])


class GridOrderTest(parameterized.TestCase):
  """`pipeline.tile_grid`: which causal grids start longest-first."""

  def test_tail_of_a_small_grid(self):
    # Two blocks of work 3 and 2 (2 tiles, +1 each) on two slots: the ideal
    # is 2.5, the makespan 3.
    self.assertAlmostEqual(pipeline.tile_last_tail(2, 1, 2), 0.2)

  def test_tail_is_never_above_its_bound(self):
    for tiles, pairs in ((16, 32), (16, 128), (64, 8), (64, 32), (256, 16)):
      work = [tiles - t + 1 for t in range(tiles)]
      bound = work[0] / (pairs * sum(work) / 132)
      self.assertLessEqual(pipeline.tile_last_tail(tiles, pairs, 132),
                           bound + 1e-9)

  @parameterized.named_parameters(
      # (tiles, heads, batch, streamed MB, causal, order)
      ("under_the_bytes", 64, 16, 1, 67, True, "longest_first"),
      ("gqa_dkv_2x8192", 64, 4, 2, 134, True, "longest_first"),  # tail 23%
      ("gqa_dkv_8x2048", 16, 4, 8, 134, True, "longest_first"),  # 27%
      ("mha_2x8192", 64, 16, 2, 134, True, "batch_major"),  # 6%
      ("mha_8x2048", 16, 16, 8, 134, True, "batch_major"),  # 7%
      ("mha_1x32768", 256, 16, 1, 268, True, "tile_last"),  # ~0%
      ("mha_2x32768", 256, 16, 2, 536, True, "tile_last"),  # 268 MB each
      ("not_causal", 64, 4, 2, 134, False, "tile_last"),
  )
  def test_order(self, tiles, heads, batch, megabytes, causal, order):
    mask = spec.MaskSpec(is_causal=causal, has_lengths=False)
    with mock.patch.object(pipeline, "sm_count", lambda: 132):
      grid = pipeline.tile_grid(tiles, heads, batch, tile_axis="kv_tiles",
                                mask=mask, streamed_bytes=megabytes * 2**20)
    expected = {
        "longest_first": ((tiles, heads, batch),
                          ("kv_tiles", "heads", "batch")),
        "batch_major": ((batch, tiles, heads), ("batch", "kv_tiles", "heads")),
        "tile_last": ((batch, heads, tiles), ("batch", "heads", "kv_tiles")),
    }[order]
    self.assertEqual((grid["grid"], grid["grid_names"]), expected)

  def test_batch_major_can_be_switched_off(self):
    mask = spec.MaskSpec(is_causal=True, has_lengths=False)
    with mock.patch.object(pipeline, "sm_count", lambda: 132), \
        mock.patch.object(pipeline, "BATCH_MAJOR_LONGEST_FIRST", False):
      grid = pipeline.tile_grid(64, 16, 2, tile_axis="q_tiles", mask=mask,
                                streamed_bytes=134 * 2**20)
    self.assertEqual(grid["grid"], (2, 16, 64))


class ModelSensitivityTest(parameterized.TestCase):
  """The model fails when a decision the kernels take is broken."""

  @parameterized.named_parameters(
      ("masked_runs_unmasked", "consumer_runs", _full_runs,
       "causal_gqa_soft_cap"),
      ("producer_range_short", "query_block", _short_union,
       "causal_window"),
      ("tile_columns_unshifted", "key_tile_visible", _unshifted_columns,
       "no_mask_lengths_soft_cap"),
      ("dkv_ring_slot", "group_slot", _next_slot, "causal_gqa_soft_cap"),
      ("gqa_head_of_step", "group_step_rows", _head_without_group,
       "causal_gqa_soft_cap"),
      ("row_group_rows", "row_group_start", _same_rows,
       "no_mask_lengths_soft_cap"),
      ("segment_ranges_shifted", "segment_range", _shifted_ranges,
       "packed_causal_gqa"),
      # Only dK and dV see this one (transposed tiles).
      ("query_tile_ids_dropped", "query_tile_visible", _ids_not_compared(6),
       "cross_unsorted_lengths_gqa_soft_cap"),
  )
  def test_model_fails(self, helper, breaker, case_name):
    case = dict(CASES)[case_name]
    inputs, expected = _inputs_and_expected(case)
    broken = breaker(getattr(pipeline, helper))
    # None of the helpers above is one of these (for time: each costs the
    # launches' tracing again), but a break of one must trace again.
    if helper in model.HOST_HELPERS:
      model.clear_host_caches()
      self.addCleanup(model.clear_host_caches)
    with mock.patch.object(pipeline, helper, broken):
      with self.assertRaises(AssertionError):
        # Reads past the segment ranges are no failure here: the break must
        # show in the results or the walk.
        model.assert_close(model.run_model(case, *inputs, []), expected)

  @parameterized.named_parameters(
      # A causal pair's second block on the first tile again: a repeated
      # block and a missing one.
      ("pair_repeats_its_tile", "causal_t_gt_s_other_tiles",
       lambda position, grid, j: position(grid._replace(pairs=False),
                                          lax.div(j, jnp.int32(2)))),
      # Items handed out in the wrong stride: blocks missing.
      ("items_strided_wrong", "no_mask_static_runs_gqa_sinks",
       lambda position, grid, j: position(
           grid._replace(programs=grid.programs + 1), j)),
  )
  def test_model_fails_persistent(self, case_name, breaker):
    # The persistent forward's (program, block) -> position mapping.
    case = dict(CASES)[case_name]
    inputs, expected = _inputs_and_expected(case)
    original = pipeline.PersistentGrid.position
    broken = lambda grid, j: breaker(original, grid, j)
    with mock.patch.object(pipeline.PersistentGrid, "position", broken):
      with self.assertRaises(AssertionError):
        model.assert_close(model.run_model(case, *inputs), expected)


if __name__ == "__main__":
  absltest.main()
