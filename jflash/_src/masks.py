"""The one mask description shared by the forward and backward kernels.

A query row `r` sees key column `c` when

    c < kv_len                                  (key/value length)
    and (not is_causal or c <= r + offset)      (causal; offset 0 top-left,
                                                 kv_len - q_len bottom-right)
    and (no window or r + offset - left <= c <= r + offset + right)
    and (no segments or q_ids[r] == kv_ids[c])  (packed sequences)
    and (no dense mask or mask[r, c])           (jax.nn's `mask`)

Rows `r >= q_len` see nothing. The same predicate decides, per tile, which
tiles are visited at all (loop bounds) and which tiles need the element-wise
mask (the ones the predicate cuts through), so the forward and the two
backward kernels can never disagree about what is masked.

Segments (`MaskSpec.has_segments`) cannot be bounded from a few scalars like
the other masks: the host computes, per tile, the range of tiles of the other
axis that its segment ids can meet (`segment_tile_ranges`, plain XLA), the
kernels read it and intersect it with the causal, window and length bounds.
Every visited tile is then masked element-wise, as it is with a dense mask
(whose tiles are read, never used to skip work).

Bounds are Python ints where everything they depend on is static, else
traced `int32` scalars (`lax.div` and `jnp.minimum` rather than Python
arithmetic). This module imports no Pallas backend: kernels pass in what
they read from memory (lengths, a segment range reader).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
from jax import lax
import jax.numpy as jnp

from jflash._src.spec import MaskSpec


# Bound arithmetic that stays in Python while every operand is static.
def _static(*xs) -> bool:
  return all(isinstance(x, int) for x in xs)


def _cdiv(a, b: int):
  return -(-a // b) if _static(a) else lax.div(a + (b - 1), b)


def _div(a, b: int):
  return a // b if _static(a) else lax.div(a, b)


def _minimum(a, b):
  return min(a, b) if _static(a, b) else jnp.minimum(a, b)


def _maximum(a, b):
  return max(a, b) if _static(a, b) else jnp.maximum(a, b)


def _is_zero(x) -> bool:
  return isinstance(x, int) and x == 0


def _select(cond, a, b):
  if isinstance(cond, bool):
    return a if cond else b
  return jnp.where(cond, a, b)


def causal_offset(mask: MaskSpec, q_len, kv_len):
  """How far right of the diagonal a row sees: 0 (top-left) or S - T
  (bottom-right: the causal mask, windows and ALiBi positions)."""
  if not mask.bottom_right:
    return 0
  return kv_len - q_len


def visible(mask: MaskSpec, rows: jax.Array, cols: jax.Array, kv_len,
            offset=0, *, q_ids: jax.Array | None = None,
            kv_ids: jax.Array | None = None,
            dense: jax.Array | None = None):
  """Element-wise visibility of a tile.

  Args:
    mask: the static mask description.
    rows: absolute query positions, shape [block_q, 1].
    cols: absolute key positions, shape [1, block_k].
    kv_len: key/value length of this batch element (traced int32 scalar).
    offset: `causal_offset(mask, q_len, kv_len)`.
    q_ids: with segments, the rows' segment ids, int32 [block_q, 1].
    kv_ids: with segments, the columns' segment ids, int32 [1, block_k].
    dense: with a dense mask, its tile, bool [block_q, block_k].

  Returns:
    bool [block_q, block_k]: True where row may attend to column. Rows past
    `q_len` are not masked here: the kernels zero them through the stored
    log-sum-exp (see forward.py).
  """
  result = cols < kv_len
  if mask.is_causal:
    limit = rows if _is_zero(offset) else rows + offset
    result = jnp.logical_and(result, cols <= limit)
  if mask.window is not None:
    left, right = mask.window
    diagonal = rows if _is_zero(offset) else rows + offset
    result = jnp.logical_and(result, cols >= diagonal - left)
    result = jnp.logical_and(result, cols <= diagonal + right)
  if mask.has_segments:
    result = jnp.logical_and(result, q_ids == kv_ids)
  if mask.has_dense_mask:
    result = jnp.logical_and(result, dense)
  return result


@dataclasses.dataclass(frozen=True)
class BlockRange:
  """Tiles to visit along one axis: [start, split) and [split, stop).

  Tiles in `[start, split)` are on one side of the mask boundary and tiles in
  `[split, stop)` on the other; which side needs element-wise masking is
  stated by the function that built the range.
  """

  start: jax.Array
  split: jax.Array
  stop: jax.Array
  masked_first: bool = False

  def runs(self):
    """[(lo, hi, needs_mask)]: the runs of tiles, in visiting order."""
    return [(self.start, self.split, self.masked_first),
            (self.split, self.stop, not self.masked_first)]


def _block_range(start, split, stop, masked_first: bool) -> BlockRange:
  """Bounds that are all Python ints, or all int32 scalars.

  A loop with constant bounds becomes a constant-trip-count loop; one with a
  traced bound must have all its bounds traced: on GPU, a `fori_loop` whose
  lower bound is a Python int and upper bound traced is not matched as a
  for-loop by the Pallas Triton lowering (it lost pipelining in the forward,
  and failed to lower inside the dK/dV kernel's loop over GQA heads).
  """
  if not _static(start, split, stop):
    start, split, stop = (jnp.asarray(x, jnp.int32)
                          for x in (start, split, stop))
  return BlockRange(start=start, split=split, stop=stop,
                    masked_first=masked_first)


def key_blocks_for_query_block(
    mask: MaskSpec, q_start, block_q: int, block_k: int, q_len, kv_len,
    offset=0,
) -> BlockRange:
  """Key tiles that a query tile must visit (forward and dQ kernels).

  Key tiles in `[0, split)` are fully visible to every row of the query tile
  (no element-wise mask needed); tiles in `[split, stop)` are cut by the mask.
  Key tiles at or past `stop` are invisible to every row and never visited.

  Args:
    mask: the static mask description.
    q_start: first query position of the tile (traced int32).
    block_q: query tile size.
    block_k: key tile size.
    q_len: query length of this batch element (int when static).
    kv_len: key/value length of this batch element (int when static).
    offset: `causal_offset(mask, q_len, kv_len)`.
  """
  visible_end = kv_len  # One past the last column any row of the tile sees.
  full_end = kv_len  # One past the last column every row of the tile sees.
  if mask.is_causal:
    if _is_zero(offset):
      visible_end = _minimum(visible_end, q_start + block_q)
      full_end = _minimum(full_end, q_start + 1)
    else:
      # Bottom-right: rows may see nothing at all (clamp at 0 tiles).
      visible_end = _maximum(_minimum(visible_end, q_start + block_q + offset),
                             0)
      full_end = _maximum(_minimum(full_end, q_start + 1 + offset), 0)
  stop = _cdiv(visible_end, block_k)
  if mask.has_lengths:
    # A query tile entirely past q_len has nothing to compute. (Without
    # lengths the grid holds no such tile.)
    stop = _select(q_start < q_len, stop, 0)
  split = _minimum(_div(full_end, block_k), stop)
  return _block_range(0, split, stop, masked_first=False)


def query_blocks_for_key_block(
    mask: MaskSpec, k_start, block_k: int, block_q: int, q_len, kv_len,
    offset=0,
) -> BlockRange:
  """Query tiles that a key tile must visit (dK/dV kernel).

  Query tiles in `[start, split)` are cut by the mask (element-wise masking
  needed); tiles in `[split, stop)` see every column of the key tile. Query
  tiles outside `[start, stop)` see none of it and are never visited.

  Args:
    mask: the static mask description.
    k_start: first key position of the tile (traced int32).
    block_k: key tile size.
    block_q: query tile size.
    q_len: query length of this batch element (int when static).
    kv_len: key/value length of this batch element (int when static).
    offset: `causal_offset(mask, q_len, kv_len)`.
  """
  # Always traced bounds here (the dK/dV kernel reads the lengths from
  # memory): with static or literal bounds, this loop, nested in the loop over
  # GQA heads, hit a Pallas Triton lowering failure on JAX 0.11.2 ('i1' vs
  # 'i32' in the while-loop body). See RECORD.md, 2026-11-22, Triton round 2.
  stop = _cdiv(q_len, block_q)
  if mask.is_causal:
    # Row r sees column c only if r + offset >= c: rows before
    # k_start - offset see nothing of the tile, rows from
    # k_start + block_k - 1 - offset on see all of it.
    first_row = k_start if _is_zero(offset) else jnp.maximum(
        k_start - offset, 0)
    start = jnp.minimum(lax.div(first_row, block_q), stop)
    last_col = k_start + block_k - 1
    split = _cdiv(last_col if _is_zero(offset) else jnp.maximum(
        last_col - offset, 0), block_q)
  else:
    start = jnp.int32(0)
    split = start
  # A key tile that crosses kv_len needs the element-wise mask everywhere; one
  # entirely past kv_len is visited by no query tile.
  split = jnp.where(k_start + block_k <= kv_len, split, stop)
  split = jnp.clip(split, start, stop)
  start = jnp.where(k_start < kv_len, start, stop)
  split = jnp.maximum(split, start)
  return _block_range(start, split, stop, masked_first=True)


@dataclasses.dataclass(frozen=True)
class WindowedRange:
  """Tiles to visit with a local window: masked, unmasked, masked.

  `[start, full_start)` and `[full_end, stop)` are cut by the mask;
  `[full_start, full_end)` is fully visible. Tiles outside `[start, stop)`
  are never visited.
  """

  start: jax.Array
  full_start: jax.Array
  full_end: jax.Array
  stop: jax.Array

  def runs(self):
    """[(lo, hi, needs_mask)]: the runs of tiles, in visiting order."""
    return [(self.start, self.full_start, True),
            (self.full_start, self.full_end, False),
            (self.full_end, self.stop, True)]


def _windowed_range(any_start, any_end, full_start, full_end, size: int,
                    empty) -> WindowedRange:
  """Tile range from element ranges [any_start, any_end) (seen by some) and
  [full_start, full_end) (seen by all); `empty`: nothing to visit."""
  clamp = lambda x: jnp.maximum(x, 0)
  start = lax.div(clamp(any_start), size)
  stop = jnp.maximum(_cdiv(clamp(any_end), size), start)
  stop = jnp.where(empty, start, stop)
  first_full = jnp.clip(_cdiv(clamp(full_start), size), start, stop)
  end_full = jnp.clip(lax.div(clamp(full_end), size), first_full, stop)
  return WindowedRange(start=start, full_start=first_full,
                       full_end=end_full, stop=stop)


def _window_bounds(mask: MaskSpec):
  """(left, right) reach of a row around its diagonal, causal included."""
  left, right = mask.window
  return left, (min(right, 0) if mask.is_causal else right)


def key_blocks_windowed(mask: MaskSpec, q_start, block_q: int, block_k: int,
                        q_len, kv_len, offset=0) -> WindowedRange:
  """Key tiles of a query tile under a local window (forward and dQ).

  Row r sees columns [r + offset - left, r + offset + right] within
  [0, kv_len): the tile's rows together see [q_start + offset - left,
  q_start + block_q - 1 + offset + right], and every row sees
  [q_start + block_q - 1 + offset - left, q_start + offset + right].
  """
  left, right = _window_bounds(mask)
  q_start = jnp.asarray(q_start, jnp.int32)
  diagonal = q_start + offset
  last_diagonal = diagonal + block_q - 1
  empty = q_start >= q_len if mask.has_lengths else jnp.bool_(False)
  return _windowed_range(
      any_start=diagonal - left,
      any_end=jnp.minimum(last_diagonal + right + 1, kv_len),
      full_start=last_diagonal - left,
      full_end=jnp.minimum(diagonal + right + 1, kv_len),
      size=block_k, empty=empty)


def query_blocks_windowed(mask: MaskSpec, k_start, block_k: int,
                          block_q: int, q_len, kv_len,
                          offset=0) -> WindowedRange:
  """Query tiles of a key tile under a local window (dK/dV).

  Row r sees column c iff c - offset - right <= r <= c - offset + left. A
  key tile that crosses kv_len is masked everywhere; one past it is skipped.
  """
  left, right = _window_bounds(mask)
  last_col = k_start + block_k - 1
  crosses_end = k_start + block_k > kv_len
  full_end = jnp.minimum(k_start - offset + left + 1, q_len)
  return _windowed_range(
      any_start=k_start - offset - right,
      any_end=jnp.minimum(last_col - offset + left + 1, q_len),
      full_start=last_col - offset - right,
      full_end=jnp.where(crosses_end, 0, full_end),
      size=block_q, empty=k_start >= kv_len)


# A kernel's reader of the host's segment tile ranges: tile index -> (first,
# stop) of the other axis's tiles its segments can meet (traced int32).
SegmentRange = Callable[[jax.Array], tuple[jax.Array, jax.Array]]


def key_blocks(mask: MaskSpec, q_start, block_q: int, block_k: int, q_len,
               kv_len, offset=0, segment_range: SegmentRange | None = None):
  """Key tiles of a query tile (forward and dQ kernels).

  A BlockRange, or a WindowedRange with a local window; with segments, a
  MaskedRange: those tiles intersected with `segment_range(query tile)`,
  all masked; with a dense mask, a MaskedRange of the same tiles.
  """
  if mask.window is None:
    blocks = key_blocks_for_query_block(mask, q_start, block_q, block_k,
                                        q_len, kv_len, offset)
  else:
    blocks = key_blocks_windowed(mask, q_start, block_q, block_k, q_len,
                                 kv_len, offset)
  if mask.has_segments:
    blocks = _restrict_to_segments(blocks, segment_range,
                                   _div(q_start, block_q))
  elif mask.has_dense_mask:
    blocks = _all_masked(blocks)
  return blocks


def query_blocks(mask: MaskSpec, k_start, block_k: int, block_q: int, q_len,
                 kv_len, offset=0,
                 segment_range: SegmentRange | None = None):
  """Query tiles of a key tile (dK/dV kernel); as `key_blocks`."""
  if mask.window is None:
    blocks = query_blocks_for_key_block(mask, k_start, block_k, block_q,
                                        q_len, kv_len, offset)
  else:
    blocks = query_blocks_windowed(mask, k_start, block_k, block_q, q_len,
                                   kv_len, offset)
  if mask.has_segments:
    blocks = _restrict_to_segments(blocks, segment_range,
                                   _div(k_start, block_k))
  elif mask.has_dense_mask:
    blocks = _all_masked(blocks)
  return blocks


# Segments (packed sequences).
#
# Host side: per tile of one axis, the contiguous range of tiles of the other
# axis whose segment ids can equal one of its own (`segment_tile_ranges`),
# passed to the kernels as two int32 [batch, num_tiles] arrays next to the
# ids themselves. Kernel side: a `SegmentRange` reads them, `key_blocks` /
# `query_blocks` intersect the range with the other masks' bounds, and
# `visible` compares the ids element-wise in every visited tile.


@dataclasses.dataclass(frozen=True)
class MaskedRange:
  """Tiles to visit with segments or a dense mask: [start, stop), masked."""

  start: jax.Array
  stop: jax.Array

  def runs(self):
    """[(lo, hi, needs_mask)]: the runs of tiles, in visiting order."""
    return [(self.start, self.stop, True)]


def _restrict_to_segments(blocks, segment_range: SegmentRange,
                          tile_index) -> MaskedRange:
  """Intersects a range's tiles with the tiles the segments can meet.

  Every range above visits one contiguous run of tiles (its runs are
  adjacent), so the intersection is one run too. The segment bounds are
  traced, so all bounds become traced int32 (see `_block_range`).
  """
  parts = blocks.runs()
  start = jnp.asarray(parts[0][0], jnp.int32)
  stop = jnp.asarray(parts[-1][1], jnp.int32)
  first, last = segment_range(tile_index)
  start = jnp.maximum(start, first)
  return MaskedRange(start=start,
                     stop=jnp.maximum(jnp.minimum(stop, last), start))


def _all_masked(blocks) -> MaskedRange:
  """The same run of tiles, all masked (bounds all static or all traced)."""
  parts = blocks.runs()
  start, stop = parts[0][0], parts[-1][1]
  if not _static(start, stop):
    start, stop = (jnp.asarray(x, jnp.int32) for x in (start, stop))
  return MaskedRange(start=start, stop=stop)


def _tile_extrema(ids, lengths, block: int):
  """Min and max segment id of each tile's valid positions.

  Args:
    ids: int32 [batch, seq].
    lengths: int32 [batch]; positions at or past them are ignored.
    block: tile size.

  Returns:
    (lo, hi), int32 [batch, cdiv(seq, block)]; lo > hi for a tile without
    a valid position.
  """
  batch, seq = ids.shape
  num_tiles = -(-seq // block)
  info = jnp.iinfo(jnp.int32)
  valid = jnp.arange(seq, dtype=jnp.int32)[None, :] < lengths[:, None]
  padding = ((0, 0), (0, num_tiles * block - seq))

  def reduce(fill, op):
    x = jnp.pad(jnp.where(valid, ids, fill), padding, constant_values=fill)
    return op(x.reshape(batch, num_tiles, block), axis=-1)

  return reduce(info.max, jnp.min), reduce(info.min, jnp.max)


# jnp.searchsorted's default ("scan") is a loop of tiny GPU launches: on an
# H200 it cost 0.64 ms per call at 64 tiles, more than packed attention itself
# (8192 tokens, 512-token segments: forward 0.745 ms with it, 0.168 ms with
# "compare_all", whose [tiles, other tiles] comparison is one fused kernel).
# "sort" (0.128 ms) takes over where that comparison would get large.
_COMPARE_ALL_LIMIT = 1 << 22


def segment_tile_ranges(ids, lengths, block: int, other_ids, other_lengths,
                        other_block: int):
  """Per tile of one axis, the tiles of the other that its segments can meet.

  Host side, plain XLA. A tile pair can hold a visible element only if the
  [min, max] intervals of their (valid) segment ids intersect: tile j of the
  other axis can meet tile i when hi_j >= lo_i and lo_j <= hi_i. Each
  condition holds on a run of j once the tile extrema are replaced by
  prefix/suffix extrema (monotone in j), so each end of the range is a
  search in a sorted array (one fused [tiles, other tiles] comparison while
  that is small, a sort-based search beyond; see _COMPARE_ALL_LIMIT). The
  range contains every meeting tile for any layout of ids, and is exactly the
  first and last meeting tile for ids sorted along the sequence (the usual
  packing).

  Args:
    ids: int32 [batch, seq], segment ids of the axis whose tiles get ranges.
    lengths: int32 [batch], its valid positions per batch element.
    block: its tile size.
    other_ids: int32 [batch, other_seq], the other axis's segment ids.
    other_lengths: int32 [batch].
    other_block: the other axis's tile size.

  Returns:
    (first, stop), int32 [batch, cdiv(seq, block)]: tiles of the other axis
    outside [first, stop) share no segment with the tile; first == stop when
    no tile does.
  """
  lo, hi = _tile_extrema(ids, lengths, block)
  other_lo, other_hi = _tile_extrema(other_ids, other_lengths, other_block)
  # `~x` reverses int32 order without overflow (unlike `-x` at int32 min).
  method = ("compare_all" if lo.shape[1] * other_lo.shape[1]
            <= _COMPARE_ALL_LIMIT else "sort")
  search = lambda side: jax.vmap(functools.partial(
      jnp.searchsorted, side=side, method=method))
  # First j with prefix_max(other_hi)[j] >= lo and with
  # prefix_min(other_lo)[j] <= hi (both conditions hold from there on).
  first = jnp.maximum(
      search("left")(lax.cummax(other_hi, axis=1), lo),
      search("left")(~lax.cummin(other_lo, axis=1), ~hi))
  # One past the last j with suffix_max(other_hi)[j] >= lo and with
  # suffix_min(other_lo)[j] <= hi (both hold up to there).
  stop = jnp.minimum(
      search("right")(~lax.cummax(other_hi, axis=1, reverse=True), ~lo),
      search("right")(lax.cummin(other_lo, axis=1, reverse=True), hi))
  first = first.astype(jnp.int32)
  return first, jnp.maximum(stop.astype(jnp.int32), first)
