"""What the Mosaic kernels share: where a block is, and their rings.

Every kernel streams tiles through a ring of `stages` slots: step `s` of
the range [lo, hi) goes to slot (s - lo) % stages. The producer warpgroup
fills the first `stages` slots at once, then refills a slot as soon as
every compute warpgroup has released it (arrived on its "consumed"
barrier). The consumers wait on the slot's "ready" barrier(s), which the
TMA copies complete, and walk the same steps (`consumer_runs`).

Every decision about which tiles and rows a warpgroup works on (block and
row-group positions, its runs of tiles and their kinds, the element-wise
masks, the rows whose lse is dropped, the dK/dV ring's slots and loads) is
a helper here rather than inline in a kernel: the CPU model in
tests/mosaic_model.py (run by tests/mosaic_masking_test.py) walks the
kernels' tiles with these same helpers and checks the result numerically
(no interpreter runs the kernels). Keep new decisions here too; each helper
the model calls or restates says so in its docstring, and a change to one
must keep the model right (and the masking test passing).

A kernel receives its GMEM inputs as one `KernelInputs` of refs (an absent
operand is None), and its shared memory and barriers as one scratch
dataclass of refs (forward.ForwardScratch, backward.DqScratch and
backward.DkvScratch); `launch` flattens both, in field order.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import Any, Callable, NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from jflash._src import masks
from jflash._src.spec import MaskSpec
from jflash._src.spec import Operands


def as_int32(x):
  return jnp.asarray(x, jnp.int32)


def _static(*xs) -> bool:
  return all(isinstance(x, int) for x in xs)


def static_or_int32(x):
  """x itself when a Python int (known when the kernel is traced), else an
  int32 scalar."""
  return x if _static(x) else as_int32(x)


def _maximum(a, b):
  return max(a, b) if _static(a, b) else jnp.maximum(a, b)


def consumer_runs(runs, lo, hi):
  """A consumer's runs of tiles, clipped to the producer's [lo, hi), with
  the tiles before and after them as runs to skip ("skip").

  Args:
    runs: the consumer's `masks` runs [(lo, hi, needs_mask)], adjacent.
    lo, hi: the steps the producer streams (int32 scalars, or Python ints).

  Returns:
    [(lo, hi, kind)], kind "skip", "masked" or "full", covering [lo, hi).
    When every bound is known at trace time (no lengths, no causal mask:
    the ranges do not depend on the block), they stay Python ints and the
    empty runs are left out: each run is one more copy of a loop body in
    the kernel, and fewer copies compile faster.

  The CPU masking model (tests/mosaic_model.py) calls this: each
  consumer's runs and their kinds (a walk it checks against the producer's
  steps).
  """
  if _static(lo, hi, *(b for run in runs for b in run[:2])):
    own_lo = min(max(runs[0][0], lo), hi)
    own_hi = min(max(runs[-1][1], own_lo), hi)
    clip_static = lambda x: min(max(x, own_lo), own_hi)
    every = ([(lo, own_lo, "skip")]
             + [(clip_static(a), clip_static(b),
                 "masked" if needs_mask else "full")
                for a, b, needs_mask in runs]
             + [(own_hi, hi, "skip")])
    return [run for run in every if run[0] < run[1]]
  lo, hi = as_int32(lo), as_int32(hi)
  own_lo = jnp.minimum(jnp.maximum(as_int32(runs[0][0]), lo), hi)
  own_hi = jnp.minimum(jnp.maximum(as_int32(runs[-1][1]), own_lo), hi)
  clip = lambda x: jnp.minimum(jnp.maximum(as_int32(x), own_lo), own_hi)
  return ([(lo, own_lo, "skip")]
          + [(clip(a), clip(b), "masked" if needs_mask else "full")
             for a, b, needs_mask in runs]
          + [(own_hi, hi, "skip")])


def slot_of(step, lo, stages: int):
  """The ring slot of step `step` of a range starting at `lo` (a traced
  int32 scalar, or the Python int 0).

  The CPU masking model (tests/mosaic_model.py) calls this: the slot
  the dK/dV producer fills at each step.
  """
  return lax.rem(step if isinstance(lo, int) and lo == 0 else step - lo,
                 stages)


def produce(load: Callable, lo, hi, stages: int, consumed: tuple):
  """Streams steps [lo, hi): load(step, slot) issues the step's copies.

  Args:
    load: issues the TMA copies of one step into one slot.
    lo, hi: the steps: traced int32 scalars, or Python ints (then the
      loop has a fixed trip count, and the fills past hi are left out).
    stages: the ring's slots.
    consumed: the "consumed" barrier arrays to wait on before refilling a
      slot (one per separately released buffer, e.g. K's and V's).

  The CPU masking model (tests/mosaic_model.py) restates this: step i of
  [0, hi) is in slot i for the first `stages`, then in slot_of(i), the same
  (the dK/dV ring's producer side, checked against `group_slot`).
  """
  for i in range(stages):
    pl.when(lo + i < hi)(functools.partial(load, as_int32(lo + i), i))
  if _static(lo, hi) and lo + stages >= hi:
    return

  @pl.loop(static_or_int32(lo + stages), hi)
  def _refill(step):
    slot = slot_of(step, lo, stages)
    for barriers in consumed:
      plgpu.barrier_wait(barriers.at[slot])
    load(step, slot)


def tile_start(tile, rows: int):
  """First row of tile `tile` of an axis cut into tiles of `rows` rows: the
  keys of ring step `tile` (forward, dQ), the queries of query tile `tile`
  (dK/dV).

  The CPU masking model (tests/mosaic_model.py) calls this: the rows
  of every streamed tile it loads and masks.
  """
  return tile * rows


def key_value_loader(k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, *,
                     batch, kv_head, block_kv: int,
                     ids: tuple | None = None,
                     values_transposed: bool = False) -> Callable:
  """load(step, slot) of key/value tile `step` of one (batch, kv head).

  ids: with segments, (kv segment ids in GMEM [B, S'], their ring in shared
    memory [stages, block_kv]): the tile's ids come with K, on `k_ready`
    (a barrier of two arrivals then).
  values_transposed: V is [B, K, H, S'] (the FP8 forward's layout): its
    tile is [H, block_kv].

  The CPU masking model (tests/mosaic_model.py) restates which rows
  this loads (K, V and their ids at `tile_start(step, block_kv)`, block_kv
  rows).
  """

  def load(step, slot):
    rows = (batch, pl.ds(tile_start(step, block_kv), block_kv), kv_head)
    plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot],
                            k_ready.at[slot])
    if ids is not None:
      load_ids(ids, batch, tile_start(step, block_kv), block_kv, slot,
               k_ready.at[slot])
    if values_transposed:
      keys = pl.ds(tile_start(step, block_kv), block_kv)
      plgpu.copy_gmem_to_smem(v_ref.at[batch, kv_head, :, keys],
                              v_smem.at[slot], v_ready.at[slot])
    else:
      plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot],
                              v_ready.at[slot])

  return load


def load_ids(ids: tuple, batch, start, rows: int, index, barrier):
  """Copies segment ids [start, start + rows) of a batch element (ids: (GMEM
  [B, L'], shared memory [n, rows])) into shared-memory row `index`; the
  copy completes `barrier`. A 1-D copy is bounded by the whole array, not
  by its row: the host pads the ids to whole tiles (`segment_inputs`).

  The CPU masking model (tests/mosaic_model.py) restates this copy and
  checks that no load leaves its row.
  """
  ids_gmem, ids_smem = ids
  plgpu.copy_gmem_to_smem(ids_gmem.at[batch, pl.ds(start, rows)],
                          ids_smem.at[index], barrier)


def query_loader(q_ref, lse_ref, do_ref, delta_ref, q_smem, lse_smem,
                 do_smem, delta_smem, q_ready, do_ready, *, batch,
                 block_q: int, ids: tuple | None = None,
                 row_scales: tuple | None = None) -> Callable:
  """load(head, q_start, index): the backward's query-side tiles.

  Q with its lse complete `q_ready[index]`, dO with its delta
  `do_ready[index]` (two copies each: barriers of two arrivals). With
  segments (ids: as `key_value_loader`'s, for the queries) the rows' ids
  come with Q (three arrivals). row_scales: (ref [B, N, T'], ring
  [stages, block_q]) of a float32 per query row that comes with dO (three
  arrivals): the dK/dV kernel's fixed-point dQ factors.

  The CPU masking model (tests/mosaic_model.py) restates which rows
  this loads (block_q rows at q_start, of Q, dO, lse, delta and ids).
  """

  def load(head, q_start, index):
    rows = (batch, pl.ds(q_start, block_q), head)
    stats = (batch, head, pl.ds(q_start, block_q))
    plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[index],
                            q_ready.at[index])
    plgpu.copy_gmem_to_smem(lse_ref.at[stats], lse_smem.at[index],
                            q_ready.at[index])
    if ids is not None:
      load_ids(ids, batch, q_start, block_q, index, q_ready.at[index])
    plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[index],
                            do_ready.at[index])
    plgpu.copy_gmem_to_smem(delta_ref.at[stats], delta_smem.at[index],
                            do_ready.at[index])
    if row_scales is not None:
      scales_ref, scales_smem = row_scales
      plgpu.copy_gmem_to_smem(scales_ref.at[stats], scales_smem.at[index],
                              do_ready.at[index])

  return load


class Position(NamedTuple):
  """A block's (query tile, head, batch element): its grid point, or in a
  persistent kernel the work item it is on."""

  q_tile: jax.Array
  head: jax.Array
  batch: jax.Array


def grid_position() -> Position:
  """The block's grid point (grid axes "q_tiles", "heads", "batch")."""
  return Position(lax.axis_index("q_tiles"), lax.axis_index("heads"),
                  lax.axis_index("batch"))


# Persistent kernels: the grid is one program per SM (grid axis
# "programs"), and program p works through items p, p + P, p + 2P, ... of
# the (batch, head, query tile) space, query tiles fastest (programs in
# flight together share a head's K and V in L2). A block's prologue (Q
# load, ring fill) and epilogue (output stores) then overlap the ring's
# next tiles instead of costing a launch each: short sequences gain most.

# SMs of an H100/H200 SXM, for lowering on a machine without a GPU.
DEFAULT_SM_COUNT = 132


def sm_count() -> int:
  """The default device's SMs (DEFAULT_SM_COUNT off the GPU).

  The CPU masking model (tests/mosaic_model.py) patches this (a few
  SMs, so that its persistent programs work through several items).
  """
  device = jax.devices()[0]
  count = getattr(device, "core_count", None)
  if device.platform != "gpu" or not count:
    return DEFAULT_SM_COUNT
  return int(count)


class PersistentGrid(NamedTuple):
  """A persistent launch: `programs` programs over `items` work items.

  An item is one query tile of a (batch, head) or, with `pairs` (causal
  masks, where a tile's work grows with its index), the two tiles t and
  q_tiles - 1 - t: every item then costs about the same (q_tiles + 1 key
  tiles), so that handing them out round-robin balances the programs.

  The CPU masking model (tests/mosaic_model.py) calls `over`,
  `position` and `num_blocks` (and reads `programs`, `items`,
  `blocks_per_item`): the blocks each program computes, checked to cover
  every tile once.
  """

  programs: int
  items: int
  q_tiles: int
  heads: int
  pairs: bool

  @classmethod
  def over(cls, q_tiles: int, heads: int, batch: int, *,
           pairs: bool) -> PersistentGrid:
    items = cls.per_head(q_tiles, pairs) * heads * batch
    return cls(programs=min(items, sm_count()), items=items,
               q_tiles=q_tiles, heads=heads, pairs=pairs)

  @staticmethod
  def per_head(q_tiles: int, pairs: bool) -> int:
    return (q_tiles + 1) // 2 if pairs else q_tiles

  @property
  def blocks_per_item(self) -> int:
    return 2 if self.pairs else 1

  def num_items(self):
    """Items of this program (grid axis "programs"), an int32 scalar."""
    program = lax.axis_index("programs")
    return lax.div(self.items - program + self.programs - 1,
                   jnp.int32(self.programs))

  def num_blocks(self):
    """Blocks of this program: blocks_per_item per item."""
    return self.num_items() * self.blocks_per_item

  def position(self, j):
    """(position, valid) of this program's j-th block (block j % 2 of item
    j // 2 with pairs): valid is False for the second block of the middle
    tile's item (an odd number of tiles pairs it with itself), else True
    (a Python bool without pairs)."""
    k, which = j, 0
    if self.pairs:
      k, which = lax.div(j, jnp.int32(2)), lax.rem(j, jnp.int32(2))
    item = lax.axis_index("programs") + k * self.programs
    per_head = jnp.int32(self.per_head(self.q_tiles, self.pairs))
    tile, rest = lax.rem(item, per_head), lax.div(item, per_head)
    head = lax.rem(rest, jnp.int32(self.heads))
    batch = lax.div(rest, jnp.int32(self.heads))
    if not self.pairs:
      return Position(q_tile=tile, head=head, batch=batch), True
    second = which == 1
    return (Position(q_tile=jnp.where(second, self.q_tiles - 1 - tile, tile),
                     head=head, batch=batch),
            jnp.logical_or(~second, 2 * tile + 1 != self.q_tiles))


def produce_continuing(load: Callable, lo, hi, base, stages: int,
                       consumed: tuple):
  """As `produce`, for a ring that runs on across blocks (persistent
  kernels): step `step` of [lo, hi) is ring step base + step - lo, in slot
  (base + step - lo) % stages, refilled once consumed (ring steps past the
  first `stages`)."""

  @pl.loop(static_or_int32(lo), static_or_int32(hi))
  def _step(step):
    ring_step = base + (step - lo)
    slot = lax.rem(ring_step, stages)

    @pl.when(ring_step >= stages)
    def _wait():
      for barriers in consumed:
        plgpu.barrier_wait(barriers.at[slot])

    load(step, slot)


def query_block_start(mask: MaskSpec, q_seq: int, block_rows: int,
                      q_tile=None):
  """First query row of query tile `q_tile` (default: grid axis
  "q_tiles"); causal blocks run in reverse, longest first (they visit the
  most key tiles).

  The CPU masking model (tests/mosaic_model.py) calls this through
  `query_block`.
  """
  tile = lax.axis_index("q_tiles") if q_tile is None else q_tile
  if mask.is_causal:
    tile = (pl.cdiv(q_seq, block_rows) - 1) - tile
  return tile * block_rows


def lengths(mask: MaskSpec, q_lengths_ref, kv_lengths_ref, batch,
            q_seq: int, kv_seq: int):
  """(q_len, kv_len) of the batch element: int32 scalars read from GMEM
  with lengths, else the static array lengths.

  The CPU masking model (tests/mosaic_model.py) calls this through
  `query_block` and `key_block`.
  """
  if mask.has_lengths:
    return q_lengths_ref[batch], kv_lengths_ref[batch]
  return q_seq, kv_seq


class QueryBlock(NamedTuple):
  """A block of query rows of the forward and dQ kernels as one of its
  warpgroups sees it, and the key tiles [steps_lo, steps_hi) any of its
  rows visits (the producer's)."""

  batch: jax.Array
  head: jax.Array
  warpgroup: jax.Array
  start: jax.Array
  q_len: jax.Array | int
  kv_len: jax.Array | int
  offset: jax.Array | int
  steps_lo: jax.Array
  steps_hi: jax.Array


def _span(runs):
  """(lo, hi) of adjacent `masks` runs: the tiles a block's producer
  streams (Python ints when known at trace time, else int32 scalars)."""
  lo = static_or_int32(runs[0][0])
  return lo, _maximum(static_or_int32(runs[-1][1]), lo)


def query_block(mask: MaskSpec, q_lengths_ref, kv_lengths_ref, *,
                q_seq: int, kv_seq: int, block_rows: int, block_kv: int,
                ranges_ref=None, position: Position | None = None
                ) -> QueryBlock:
  """This block's position, lengths and key tiles (thread axis "wg").

  position: the block's (query tile, head, batch); default: its grid
    point (grid axes "q_tiles", "heads", "batch").
  ranges_ref: with segments, the host's per-block key tile ranges
    (`SegmentInputs.block_ranges`).

  The CPU masking model (tests/mosaic_model.py) calls this: the
  forward's and dQ's blocks (the producer's key tiles).
  """
  position = grid_position() if position is None else position
  batch, head = position.batch, position.head
  warpgroup = lax.axis_index("wg")
  start = query_block_start(mask, q_seq, block_rows, position.q_tile)
  q_len, kv_len = lengths(mask, q_lengths_ref, kv_lengths_ref, batch, q_seq,
                          kv_seq)
  offset = masks.causal_offset(mask, q_len, kv_len)
  union = masks.key_blocks(mask, start, block_rows, block_kv, q_len, kv_len,
                           offset, segment_range(ranges_ref, batch)).runs()
  steps_lo, steps_hi = _span(union)
  return QueryBlock(batch=batch, head=head, warpgroup=warpgroup,
                    start=start, q_len=q_len, kv_len=kv_len, offset=offset,
                    steps_lo=steps_lo, steps_hi=steps_hi)


def row_group_start(block_start, row_group, rows: int):
  """First row of row group `row_group` (`rows` rows each) of a block that
  starts at `block_start`: a compute warpgroup's rows.

  The CPU masking model (tests/mosaic_model.py) calls this: every
  consumer's rows.
  """
  return block_start + row_group * rows


def row_group_of(warpgroup, chunks: int):
  """The row group of compute warpgroup `warpgroup` when `chunks` of them
  share each row group, one column chunk each (the backward at head dim
  256; `backward._for_each_compute_warpgroup`): the warpgroup itself with a
  single chunk, as in the forward.

  The CPU masking model (tests/mosaic_model.py) calls this: every
  consumer's row group.
  """
  return warpgroup if chunks == 1 else lax.div(warpgroup, chunks)


def column_chunk_of(warpgroup, chunks: int):
  """The column chunk of compute warpgroup `warpgroup` of `row_group_of`:
  0 (a Python int) with a single chunk. With the backward's product split
  (`config.backward_splits_products`) the chunk is the warpgroup's role
  instead: 0 computes the probabilities, 1 the gradients.

  The CPU masking model (tests/mosaic_model.py) calls this: the
  head-dim columns every backward consumer accumulates.
  """
  return 0 if chunks == 1 else lax.rem(warpgroup, chunks)


def kv_head_of(head, group: int):
  """The key/value head of query head `head` (GQA groups of `group`).

  The CPU masking model (tests/mosaic_model.py) calls this: the K/V
  the forward and dQ blocks stream.
  """
  return lax.div(head, jnp.int32(group))


def key_tiles(mask: MaskSpec, block: QueryBlock, q_start, block_q: int,
              block_kv: int, ranges_ref=None):
  """The `masks` runs [(lo, hi, needs_mask)] of the key tiles of the row
  group of `block_q` rows at `q_start` (forward and dQ; `consumer_runs`
  clips them to the block's [steps_lo, steps_hi)). ranges_ref: with
  segments, the host's per-row-group ranges (`SegmentInputs.group_ranges`).

  The CPU masking model (tests/mosaic_model.py) calls this: each
  forward and dQ consumer's key tiles.
  """
  return masks.key_blocks(mask, q_start, block_q, block_kv, block.q_len,
                          block.kv_len, block.offset,
                          segment_range(ranges_ref, block.batch)).runs()


def key_tile_visible(mask: MaskSpec, rows, columns, kv_step, block_kv: int,
                     kv_len, offset, q_ids=None, kv_ids=None):
  """The element-wise mask of key tile `kv_step` (forward and dQ): `rows`
  absolute query positions, `columns` positions within the tile; with
  segments, q_ids and kv_ids: the rows' and the columns' ids, as tiles.

  The CPU masking model (tests/mosaic_model.py) calls this: the mask
  of every "masked" forward and dQ tile.
  """
  return masks.visible(mask, rows, columns + tile_start(kv_step, block_kv),
                       kv_len, offset, q_ids=q_ids, kv_ids=kv_ids)


def valid_lse(lse, rows, q_len):
  """The lse of query rows before q_len, +inf past it (whatever TMA read
  there), so that their probabilities are 0 (backward kernels).

  The CPU masking model (tests/mosaic_model.py) calls this: the lse
  of every dQ and dK/dV tile.
  """
  return jnp.where(rows < q_len, lse, jnp.inf)


class KeyBlock(NamedTuple):
  """A block of key rows of the dK/dV kernel as one of its warpgroups sees
  it, and its walk: for each of the `group` query heads of its kv head, the
  query tiles [tiles_lo, tiles_hi) any of its keys is visible to (the
  producer's), `num_steps` steps in all."""

  batch: jax.Array
  kv_head: jax.Array
  warpgroup: jax.Array
  start: jax.Array
  q_len: jax.Array | int
  kv_len: jax.Array | int
  offset: jax.Array | int
  tiles_lo: jax.Array
  tiles_hi: jax.Array
  tiles_per_head: jax.Array
  num_steps: jax.Array


def key_block(mask: MaskSpec, q_lengths_ref, kv_lengths_ref, *, q_seq: int,
              kv_seq: int, block_rows: int, block_q: int, group: int,
              ranges_ref=None) -> KeyBlock:
  """This block's position, lengths and query tiles (grid axes
  "kv_tiles", "heads" (kv heads), "batch"; thread axis "wg"). ranges_ref:
  with segments, the host's per-block query tile ranges.

  The CPU masking model (tests/mosaic_model.py) calls this: the
  dK/dV blocks (the producer's query tiles, its steps).
  """
  batch = lax.axis_index("batch")
  kv_head = lax.axis_index("heads")
  warpgroup = lax.axis_index("wg")
  # Causal: the first key tiles see the most query tiles, and come first.
  start = lax.axis_index("kv_tiles") * block_rows
  q_len, kv_len = lengths(mask, q_lengths_ref, kv_lengths_ref, batch, q_seq,
                          kv_seq)
  offset = masks.causal_offset(mask, q_len, kv_len)
  union = masks.query_blocks(mask, start, block_rows, block_q, q_len, kv_len,
                             offset, segment_range(ranges_ref, batch)).runs()
  tiles_lo, tiles_hi = _span(union)
  # Steps: (head of the group, query tile in [tiles_lo, tiles_hi)).
  tiles_per_head = tiles_hi - tiles_lo
  return KeyBlock(batch=batch, kv_head=kv_head, warpgroup=warpgroup,
                  start=start, q_len=q_len, kv_len=kv_len, offset=offset,
                  tiles_lo=tiles_lo, tiles_hi=tiles_hi,
                  tiles_per_head=tiles_per_head,
                  num_steps=tiles_per_head * group)


def query_tiles(mask: MaskSpec, block: KeyBlock, k_start, block_kv: int,
                block_q: int, ranges_ref=None):
  """The `masks` runs [(lo, hi, needs_mask)] of the query tiles of the row
  group of `block_kv` keys at `k_start` (dK/dV; `consumer_runs` clips them
  to the block's [tiles_lo, tiles_hi)). ranges_ref: as `key_tiles`'.

  The CPU masking model (tests/mosaic_model.py) calls this: each
  dK/dV consumer's query tiles.
  """
  return masks.query_blocks(mask, k_start, block_kv, block_q, block.q_len,
                            block.kv_len, block.offset,
                            segment_range(ranges_ref, block.batch)).runs()


def query_tile_visible(mask: MaskSpec, query_offsets, q_start, key_ids,
                       kv_len, offset, q_ids=None, kv_ids=None):
  """The element-wise mask of a transposed tile (dK/dV: rows are keys,
  columns queries): `query_offsets` positions within the query tile at
  `q_start`, `key_ids` absolute key positions; with segments, q_ids and
  kv_ids: the columns' and the rows' segment ids, as tiles.

  The CPU masking model (tests/mosaic_model.py) calls this: the mask
  of every "masked" dK/dV tile.
  """
  return masks.visible(mask, query_offsets + q_start, key_ids, kv_len,
                       offset, q_ids=q_ids, kv_ids=kv_ids)


def group_slot(head_step, q_tile_index, block: KeyBlock, stages: int):
  """The ring slot of the dK/dV consumers' step (head `head_step` of the
  group, query tile `q_tile_index`): that of the producer's step
  head_step * tiles_per_head + (q_tile_index - tiles_lo).

  The CPU masking model (tests/mosaic_model.py) calls this: the slot
  each dK/dV consumer reads, checked against the producer's.
  """
  return lax.rem(head_step * block.tiles_per_head
                 + (q_tile_index - block.tiles_lo), stages)


def group_step_rows(step, block: KeyBlock, group: int, block_q: int):
  """(query head, first query row) of the tiles the dK/dV producer loads at
  step `step` of [0, num_steps).

  The CPU masking model (tests/mosaic_model.py) calls this: what
  each dK/dV consumer's step computes on.
  """
  per_head = jnp.maximum(block.tiles_per_head, 1)
  return (block.kv_head * group + lax.div(step, per_head),
          tile_start(block.tiles_lo + lax.rem(step, per_head), block_q))


# Segments (packed sequences), as the Triton kernels take them (masks.py):
# the host computes, per tile of the axis a kernel's blocks own, the tiles of
# the other axis its segment ids can meet, at two granularities: the block
# (the producer's range) and the row group (a consumer's); every visited
# tile is masked element-wise by comparing ids. The ids travel by 1-D TMA
# into shared memory: a block's own rows' ids once, the streamed tiles' ids
# in the ring with their tile.


class SegmentIds(NamedTuple):
  """A call's segment ids and (filled) lengths, as the backend passes
  them to the kernels' host functions: int32 [B, T], [B, S], [B], [B].

  The CPU masking model (tests/mosaic_model.py) builds these.
  """

  q_ids: Any
  kv_ids: Any
  q_lengths: Any
  kv_lengths: Any


class SegmentInputs(NamedTuple):
  """A kernel's segment operands (GMEM refs in the kernel).

  Attributes:
    own_ids: int32 [B, L'], the ids of the axis the blocks own (queries in
      the forward and dQ kernels, keys in dK/dV), padded to whole blocks.
    streamed_ids: int32 [B, L'], the other axis's, padded to whole tiles.
    block_ranges: int32 [B, 2, blocks]: per block, (first, stop) of the
      other axis's tiles its segments can meet.
    group_ranges: int32 [B, 2, row groups]: the same per row group.

  The CPU masking model (tests/mosaic_model.py) reads these fields.
  """

  own_ids: Any
  streamed_ids: Any
  block_ranges: Any
  group_ranges: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KernelInputs:
  """A kernel's GMEM inputs: arrays on the host, refs in the kernel.

  The host builds it of arrays and `launch` hands the kernel the same
  structure of refs: a kernel reads `refs.sinks`, never a position in a
  list, and an absent operand is None (no array, no ref). The fields are in
  the order of the kernels' flattened inputs, which fixes the order of the
  refs in the kernels' jaxprs: forward q, k, v, q_lengths, kv_lengths,
  sinks, segments; dQ and dK/dV q, k, v, do, lse, delta, q_lengths,
  kv_lengths, segments (and dq_sum, dq_factors for dK/dV with
  atomic_dq).

  Attributes:
    q: [B, T', N, H], T' the query length padded to SEQ_ALIGN.
    k, v: [B, S', K, H].
    do: the output cotangent, like q (backward kernels).
    lse: float32 [B, N, T'], the forward's base-2 lse (backward kernels).
    delta: float32 [B, N, T'], rowsum(dO * O) (backward kernels).
    q_lengths, kv_lengths: int32 [B] (always present: zeros, unread,
      without lengths).
    sinks: float32 [B, N] natural-log sink logits (forward).
    segments: the kernel's `SegmentInputs` (segment_inputs), or None.
    dq_sum: [B, T', N, H], zeros, that the dK/dV kernel adds each tile's
      dQ / scale into (atomic_dq; a `pl.run_state` ref): int32 fixed point
      (the row's `dq_factors` units), or float32.
    dq_factors: with an int32 dq_sum, float32 [B, N, T']: per query row
      the power of two that turns its dQ / scale into dq_sum's units.
    fp8_scales: the FP8 forward's float32 [B, K, 2]: per (batch, kv head)
      the logit scale (natural units, q and k descales folded in) and the
      v descale; None for 16-bit inputs.
  """

  q: Any
  k: Any
  v: Any
  do: Any = None
  lse: Any = None
  delta: Any = None
  q_lengths: Any = None
  kv_lengths: Any = None
  sinks: Any = None
  segments: SegmentInputs | None = None
  dq_sum: Any = None
  dq_factors: Any = None
  fp8_scales: Any = None

  def replace(self, **changes) -> KernelInputs:
    return dataclasses.replace(self, **changes)


def _pad_ids(ids, multiple: int):
  """ids [B, L] padded with -1 to a multiple of `multiple` (positions past
  the lengths are masked whatever their ids).

  The CPU masking model (tests/mosaic_model.py) caches its results
  (through `segment_inputs`): see its HOST_HELPERS.
  """
  extra = -ids.shape[1] % multiple
  return jnp.pad(ids.astype(jnp.int32), [(0, 0), (0, extra)],
                 constant_values=-1)


def segment_inputs(segments: SegmentIds, *, queries_own: bool,
                   block_rows: int, group_rows: int,
                   streamed_rows: int) -> SegmentInputs:
  """Host side: a kernel's `SegmentInputs`.

  Args:
    segments: the call's ids and lengths.
    queries_own: whether the kernel's blocks own query rows (forward, dQ)
      or key rows (dK/dV).
    block_rows: rows of the own axis per block.
    group_rows: rows per row group (per compute warpgroup).
    streamed_rows: rows of the other axis per streamed tile.

  The CPU masking model (tests/mosaic_model.py) calls this with the
  arguments the host code passed (it records them, and checks them against
  how it cuts the blocks), and caches the results: see its HOST_HELPERS.
  """
  own = (segments.q_ids, segments.q_lengths)
  other = (segments.kv_ids, segments.kv_lengths)
  if not queries_own:
    own, other = other, own

  # Tables over the padded own axis: every block and row group of the grid
  # reads its entry, also one wholly past the sequence (padding is past the
  # lengths, so it meets no tile).
  own_ids = _pad_ids(own[0], block_rows)

  def ranges(rows):
    first, stop = masks.segment_tile_ranges(own_ids, own[1], rows, *other,
                                            streamed_rows)
    return jnp.stack([first, stop], axis=1)

  return SegmentInputs(
      own_ids=own_ids, streamed_ids=_pad_ids(other[0], streamed_rows),
      block_ranges=ranges(block_rows), group_ranges=ranges(group_rows))


def kernel_lengths(mask: MaskSpec, operands: Operands):
  """(q_lengths, kv_lengths) for the kernels: None without lengths (the
  kernels then use the static array lengths)."""
  if not mask.has_lengths:
    return None, None
  return operands.lengths()


def segment_ids(mask: MaskSpec, operands: Operands) -> SegmentIds | None:
  """The call's `SegmentIds` (ids and filled lengths), or None without
  segments."""
  if not mask.has_segments:
    return None
  return SegmentIds(operands.q_segment_ids, operands.kv_segment_ids,
                    *operands.lengths())


def segment_sources(segments: SegmentInputs | None, own_smem, streamed_smem):
  """((own ids in GMEM, their shared memory), (streamed ids, their ring)),
  the `ids` of the loaders, of a kernel with segments, else (None, None).

  Args:
    segments: the kernel's `SegmentInputs` of refs, or None.
    own_smem: shared memory of the own rows' ids, one row per row group.
    streamed_smem: the ring of the streamed tiles' ids, one row per slot.
  """
  if segments is None:
    return None, None
  return ((segments.own_ids, own_smem),
          (segments.streamed_ids, streamed_smem))


def segment_range(ranges_ref, batch) -> masks.SegmentRange | None:
  """The `masks.SegmentRange` of a batch element's (first, stop) table
  ([B, 2, tiles]), or None without segments.

  The CPU masking model (tests/mosaic_model.py) calls this (through
  query_block, key_block, key_tiles and query_tiles) on tables that record
  their reads: a read outside the table fails the model.
  """
  if ranges_ref is None:
    return None
  return lambda tile: (ranges_ref[batch, 0, tile], ranges_ref[batch, 1, tile])


def ids_vector(ids_smem, dim: int):
  """A tile's segment ids from shared memory ([n] int32), in the layout
  that broadcasts along WGMMA tile axis `dim` (0: the rows', 1: the
  columns')."""
  return plgpu.load(ids_smem, layout=plgpu.Layout.WGMMA.reduce(1 - dim))


def ids_tile(ids, tile_shape, dim: int):
  """`ids_vector`'s ids as a whole tile (dim: the tile axis they index)."""
  return lax.broadcast_in_dim(ids, tile_shape, [dim])


# Grid order. Mosaic GPU starts blocks with the grid's LAST axis fastest (it
# reverses the grid into CUDA's x, y, z). Tile axis last: the blocks in
# flight are tiles of a few heads and share those heads' streamed K/V (or
# Q/dO) in L2. Tile axis first: every head's first tile, then every head's
# second...: for causal kernels, whose first tiles are the longest, that is
# longest-first over the whole grid (better balanced), but the blocks in
# flight span every (batch, head), whose streamed operands must then fit
# in L2. Measured on H100, fwd+bwd (2026-11-24): tile axis last lost 5-10%
# on causal calls streaming 32-64 MB (4x2048 and 1x8192 with 16 heads of
# 128, 2x4096 at D=64) and won 12% at 128 MB (8x2048); non-causal calls
# (equal blocks) won 2-15% everywhere.
LONGEST_FIRST_MAX_BYTES = 96 * 2**20
# ... unless the tile-last order leaves a long tail: with few (batch, head)
# pairs (GQA: the dK/dV grid has one per kv head) each head's longest
# blocks start late in the grid and run on after the rest are done.
# `tile_last_tail` models it; past this tail the grid is longest-first
# whatever the bytes. Measured on H100 (RECORD.md, 2026-11-26, "causal
# backward grid order at long sequences"), causal D=128, 16 heads, dK/dV
# kernel longest-first vs tile-last: 2x8192 with 4 kv heads (model tail
# 23%) 17.5% faster, 8x2048 with 4 kv heads (27%) 19% faster; with 16 kv
# heads (tails 6-7%) -1% to +3.5%, and the dQ kernel 21% slower at 8x2048
# (L2); 1x32768 (no tail) 5% slower.
TILE_LAST_MAX_TAIL = 0.10
# Between the two: longest first within each batch element (the blocks in
# flight share one element's streamed operands) takes most of the
# tile-last order's tail (modeled 6-7% at 8x2048 and 2x8192 with 16 heads,
# down to 0.4-2%) and keeps the L2 locality the tile-last order has. Read
# when a call is traced.
BATCH_MAJOR_LONGEST_FIRST = True


def tile_last_tail(num_tiles: int, num_pairs: int, slots: int) -> float:
  """The modeled tail of a causal tile-last grid: its makespan over the
  ideal (total work / slots) when `num_pairs` (batch, head) pairs of
  `num_tiles` blocks each, every pair's longest first, are handed in grid
  order to `slots` block slots (one block per SM), each to the first slot
  free. Block t (0: the longest) costs num_tiles - t tiles of the other
  operand (causal, equal lengths) plus one for its prologue and epilogue.
  Where max(work) / ideal, a bound on the tail, is already within
  TILE_LAST_MAX_TAIL (long grids), it returns that bound unsimulated.
  """
  work = [num_tiles - t + 1 for t in range(num_tiles)]
  ideal = num_pairs * sum(work) / slots
  # Every block starts by the ideal (the first free slot is at most the
  # mean load so far), so none ends later than the ideal plus its work.
  if work[0] / ideal <= TILE_LAST_MAX_TAIL:
    return work[0] / ideal
  free = [0] * slots
  for _ in range(num_pairs):
    for w in work:
      heapq.heapreplace(free, free[0] + w)
  return max(free) / ideal - 1.0


def tile_grid(num_tiles: int, num_heads: int, batch: int, *, tile_axis: str,
              mask: MaskSpec, streamed_bytes: int):
  """The launch's grid and grid_names over (tile, head, batch), ordered for
  causal masks (no window) longest first:
  - over the whole grid where the streamed operands (`streamed_bytes`, all
    batch elements and heads) stay under LONGEST_FIRST_MAX_BYTES, or where
    the tile-last order would leave a tail over TILE_LAST_MAX_TAIL
    (`tile_last_tail`);
  - else, with BATCH_MAJOR_LONGEST_FIRST, within each batch element (batch
    first, then tiles, heads fastest) where one element's streamed operands
    stay under LONGEST_FIRST_MAX_BYTES;
  and else (and without a causal mask) tile axis last."""
  if mask.is_causal and mask.window is None:
    if (streamed_bytes <= LONGEST_FIRST_MAX_BYTES
        or tile_last_tail(num_tiles, num_heads * batch, sm_count())
        > TILE_LAST_MAX_TAIL):
      return dict(grid=(num_tiles, num_heads, batch),
                  grid_names=(tile_axis, "heads", "batch"))
    if (BATCH_MAJOR_LONGEST_FIRST and batch > 1
        and streamed_bytes // batch <= LONGEST_FIRST_MAX_BYTES):
      return dict(grid=(batch, num_tiles, num_heads),
                  grid_names=("batch", tile_axis, "heads"))
  return dict(grid=(batch, num_heads, num_tiles),
              grid_names=("batch", "heads", tile_axis))


def key_tile_segment_ids(row_segments, ring, slot, tile_shape) -> tuple:
  """With segments, the (q_ids, kv_ids) tiles of the key tile in ring slot
  `slot` (forward and dQ): `row_segments` the rows' ids (`ids_vector(...,
  0)`), `ring` the key tiles' ids in shared memory; () without segments
  (row_segments None)."""
  if row_segments is None:
    return ()
  return (ids_tile(row_segments, tile_shape, 0),
          ids_tile(ids_vector(ring.at[slot], 1), tile_shape, 1))


def launch(kernel, scratch, inputs: KernelInputs, *, out_type, grid,
           grid_names, num_threads: int, outputs: tuple = ()):
  """Runs kernel(input_refs, *output_refs, scratch_refs) over `grid`.

  Blocks start in row-major order of `grid` (see `tile_grid`).

  Args:
    kernel: the kernel; it gets `inputs` as a `KernelInputs` of GMEM refs,
      then the output refs, then `scratch` of refs.
    scratch: the kernel's scratch dataclass of shared-memory and barrier
      types, allocated per block and shared by its `num_threads`
      warpgroups (thread axis "wg").
    inputs: the kernel's `KernelInputs` of arrays.
    out_type: the outputs' types (their refs follow the inputs').
    grid, grid_names: the launch's grid.
    num_threads: warpgroups per block.
    outputs: refs (of a `pl.run_state`) that the kernel writes in place,
      passed after the inputs as its output refs (then out_type=()).
  """
  flat_inputs, tree = jax.tree.flatten(inputs)

  def body(*refs):
    input_refs = jax.tree.unflatten(tree, refs[:len(flat_inputs)])
    output_refs = refs[len(flat_inputs):]
    pl.run_scoped(lambda scoped: kernel(input_refs, *output_refs, scoped),
                  scratch, collective_axes="wg")

  return plgpu.kernel(
      body, out_type=out_type, grid=grid, grid_names=grid_names,
      num_threads=num_threads, thread_name="wg",
      # No shared memory set aside for cross-warp reductions (Mosaic's
      # default: 2 KiB per kernel): the kernels reduce only along the rows
      # of wgmma tiles, within each warp. Lowering raises if a reduction
      # needs it (tests/mosaic_lowering_test.py lowers every kernel).
      compiler_params=plgpu.CompilerParams(approx_math=True,
                                           reduction_scratch_bytes=0),
  )(*flat_inputs, *outputs)
