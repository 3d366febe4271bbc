"""Backward kernels on Mosaic GPU (Hopper, sm90): warp-specialized dQ and dK/dV.

FlashAttention-2's backward (recompute p from q, k and the forward's base-2
lse), split in two kernels as the Triton backend's, with the forward's
warpgroup structure (forward.py): two compute warpgroups and one producer
warpgroup that streams tiles with TMA into a ring of `num_stages` shared-
memory slots; a slot is refilled once every compute warpgroup has arrived
on its "consumed" barrier.

- dQ kernel: grid (query tiles, heads, batch). The producer loads the
  block's Q, dO, lse and delta once, then streams K and V tiles (the union
  of the key tiles its rows visit, `masks.key_blocks`). Per key tile a
  compute warpgroup computes S = Q K^T and dP = dO V^T (wgmma, both operands
  in shared memory), p = 2^(s2 - lse2), dS = p (dP - delta) in registers,
  and dQ += dS K (dS from registers). The two products are issued together
  and p is computed while dP's still runs (up to 4% faster fwd+bwd at
  D=64). The dK/dV kernel does not do the same: with S^T, dP^T, dK and dV
  live at once its accumulators spill registers (RECORD 2026-11-26, "backward
  products overlapped with the elementwise work").
- dK/dV kernel: grid (key tiles, kv heads, batch). The producer loads the
  block's K and V once, then streams Q, dO, lse and delta tiles: for every
  query head of the kv head's GQA group, the query tiles the keys are
  visible to (`masks.query_blocks`). A compute warpgroup computes
  S^T = K Q^T and dP^T = V dO^T, so that p^T and dS^T come out in
  registers as the left operands of dV += p^T dO and dK += dS^T Q. The GQA
  group is summed in the fp32 accumulators: each dK/dV element is written
  once, no atomics, deterministic.
- atomic_dq (`MosaicBlockSizes`, head dims <= 128): no dQ kernel. The
  dK/dV kernel also forms dQ = dS K from both row groups' dS^T, shared
  through shared memory one step late, in 64 x 64 pieces dealt to the two
  warpgroups, and adds them into a zeroed buffer with TMA reduce-adds
  (`add_query_gradient`): 5 products per tile pair instead of 7. In a
  deterministic call the buffer is int32 fixed point (per query row a
  power of two from a bound, `dq_fixed_point_exponents`): integer adds are
  exact, so dQ is bitwise the same in any order. With
  `deterministic_grads=False` it is float32 and the additions' varying
  order moves dQ's last bits (dK and dV stay bitwise the same).

Warpgroup roles (`config.backward_warpgroup_split`): with head dim <= 128
the two compute warpgroups own one row tile each (2 * block rows per
block). With head dim 256 the accumulators ([64, 256] fp32, 128 registers
a thread; twice in dK/dV) do not fit one warpgroup twice, so both
warpgroups work on the same row tile, and by default
(`config.backward_splits_products`) split its products:

- warpgroup 0, the probabilities: S = Q K^T (S^T = K Q^T in dK/dV), p,
  masked; it hands p (times tanh' with a soft cap, `_score_factor`) to
  warpgroup 1 through one float32 tile of shared memory (`_hand_over`:
  barriers probs_ready / probs_free, so it is never overwritten before it
  is read), and in dK/dV accumulates all of dV += p^T dO.
- warpgroup 1, the gradients: dP = dO V^T (dP^T = V dO^T), dS = p (dP -
  delta) with the handed-over p (`_take_over`), and accumulates all of dQ
  += dS K (dQ kernel) or dK += dS^T Q (dK/dV kernel).

Per 64 x 64 tile pair that is 4 products of 64 x 64 x 256 in dK/dV (2 per
warpgroup) and 3 in dQ, against 6 and 5 with the column split
(BWD_SHARED_ROW_SPLIT = "columns": both warpgroups compute the tile's S
and dP, and each accumulates half of the head-dim columns): 1.35-1.43x
faster backward on an H100 (RECORD 2026-11-26, "the D=256 backward's
product split"). Each gradient is accumulated by one warpgroup in a fixed
order and written over its own K, V or Q tile once the other warpgroup is
done reading it (barrier `done`): deterministic as before.

Masks come from `masks.py` as in the forward: tiles no row/column of the
block sees are never loaded; a compute warpgroup steps over the tiles of
the block's union outside its own range without computing (still waiting
and arriving on their barriers, so every barrier's phases stay in step);
the element-wise predicate is applied on the tiles the mask cuts only.
Rows past q_len get lse = +inf (whatever was read: past T a 1-D TMA load
of lse/delta may read the next head's values, see forward.py), so p = 0
and dS = 0 for them. Sequences are padded to multiples of SEQ_ALIGN for
TMA (the padding is past q_len / kv_len, hence masked).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

from jflash._src import numerics
from jflash._src import sharding
from jflash._src.backends.mosaic import pipeline
from jflash._src.backends.mosaic.config import BWD_COMPUTE_WARPGROUPS
from jflash._src.backends.mosaic.config import DQ_PIECE
from jflash._src.backends.mosaic.config import MosaicBlockSizes
from jflash._src.backends.mosaic.config import atomic_dq_pieces
from jflash._src.backends.mosaic.config import backward_splits_products
from jflash._src.backends.mosaic.config import backward_warpgroup_split
from jflash._src.backends.mosaic.forward import COMPUTE_REGISTERS
from jflash._src.backends.mosaic.forward import PRODUCER_REGISTERS
from jflash._src.backends.mosaic.forward import SEQ_ALIGN
from jflash._src.backends.mosaic.forward import pad_rows
from jflash._src.backends.mosaic.forward import smem_transforms
from jflash._src.spec import CallSpec
from jflash._src.spec import MaskSpec
from jflash._src.spec import Operands

COMPUTE_WARPGROUPS = BWD_COMPUTE_WARPGROUPS
PRODUCER = COMPUTE_WARPGROUPS
# atomic_dq: the dK/dV kernel's registers a thread (compute warpgroups,
# producer). FlashAttention-3's split for two consumer warpgroups: its
# accumulators spill less than at 232/40 and it ran 3-4% faster; the
# default kernels lost 0-4% with it (RECORD 2026-11-26, "the atomic dK/dV
# kernel's spills").
ATOMIC_DQ_REGISTERS = (240, 24)
# atomic_dq in a call with deterministic gradients: dQ is added up in
# int32 fixed point (integer adds are exact, so the sum is the same in any
# order: bitwise deterministic), each query row in units of 2^-e, with
# 2^e times a bound on its |dQ| / scale under 2^DQ_FIXED_POINT_BITS
# (`dq_fixed_point_exponents`). With deterministic_grads=False: float32
# reduce-adds, whose order (and so dQ's last bits) varies between runs;
# 3-12% faster (H100, 2026-11-26, RECORD "the fixed-point factors on the
# dQ pieces": the scaling and the conversion sit on each warpgroup's
# serial path).
DQ_FIXED_POINT_BITS = 30


def _columns(ref, chunk: int, width: int, chunks: int):
  """The head-dim columns [chunk * width, (chunk + 1) * width) of a
  [rows, head_dim] ref (the whole ref with a single chunk)."""
  if chunks == 1:
    return ref
  return ref.at[:, pl.ds(chunk * width, width)]


def _rows_scratch(tiles, dtype, rows: int, head_dim: int, row_groups: int,
                  chunks: int):
  """Shared memory of a block's two [rows, head_dim] tiles per row group (Q
  and dO, or K and V). With several column chunks (then one row group), a
  union with the staging of the outputs: two [chunks, rows, width] tiles,
  contiguous per chunk as a TMA store needs (a column slice of a tiled
  [rows, head_dim] tile is not)."""
  pair = (tiles(row_groups, rows), tiles(row_groups, rows))
  if chunks == 1:
    return pair
  assert row_groups == 1, (row_groups, chunks)
  width = head_dim // chunks
  stage = plgpu.SMEM((chunks, rows, width), dtype,
                     transforms=smem_transforms(dtype))
  return plgpu.RefUnion(pair, (stage, stage))


def _unpack_rows(rows_smem, chunks: int):
  """(the pair of row tiles, the output staging or None): see
  `_rows_scratch`."""
  if chunks == 1:
    return rows_smem, None
  pair, stage = rows_smem
  return pair, stage


def _score_gradient(probs, capped, dprobs, delta_bcast):
  """dL/d(scale * q.k) / scale: p (dP - delta), times tanh' with a cap."""
  ds = probs * (dprobs - delta_bcast)
  if capped is not None:
    ds = ds * (1.0 - capped * capped)
  return ds


def _score_factor(probs, capped):
  """What the gradients warpgroup of a product split multiplies (dP -
  delta) by to form dS: p, times tanh' with a cap (`_score_gradient` with
  the cap's factor taken first, so that one float32 tile carries both)."""
  if capped is None:
    return probs
  return probs * (1.0 - capped * capped)


def _hand_over(scratch, factor):
  """The probabilities warpgroup of a product split: writes this step's
  `_score_factor` tile into the shared buffer once the gradients
  warpgroup has read the previous one, and signals it. Plain shared-memory
  stores and loads on both sides (no wgmma or TMA reads the buffer): the
  barriers' release and acquire order them."""
  plgpu.barrier_wait(scratch.probs_free)
  scratch.probs[...] = factor
  plgpu.barrier_arrive(scratch.probs_ready)


def _take_over(scratch):
  """The gradients warpgroup of a product split: this step's
  `_score_factor` tile (`_hand_over`), in WGMMA layout; frees the
  buffer."""
  plgpu.barrier_wait(scratch.probs_ready)
  factor = scratch.probs[...]
  plgpu.barrier_arrive(scratch.probs_free)
  return factor


def _score_gradients_and_factor(scratch, lhs, rhs, tile_shape):
  """The gradients warpgroup's step of a product split: (lhs rhs^T, the
  handed-over `_score_factor` tile), the tile taken over while the product
  runs. dQ kernel: dP = dO V^T; dK/dV kernel: dP^T = V dO^T."""

  def product_and_factor(acc_ref):
    plgpu.wgmma(acc_ref, lhs, rhs.T)
    factor = _take_over(scratch)  # While the product runs.
    return acc_ref[...], factor

  return pl.run_scoped(product_and_factor,
                       plgpu.ACC(tile_shape, jnp.float32))


def _accumulated(acc, lhs, rhs):
  """acc + lhs rhs (wgmma into the float32 accumulator acc, WGMMA layout;
  lhs from registers or shared memory, rhs from shared memory)."""

  def product(acc_ref):
    plgpu.wgmma(acc_ref, lhs, rhs)

  return pl.run_state(product)(plgpu.ACC.init(acc))


def _to_fixed_point(array):
  """A float32 WGMMA-layout array rounded to the nearest int32, one
  `cvt.rni` per element. (`astype` truncates and first clamps to int32's
  range, three instructions more; the caller's bound keeps |array| under
  2^31.)"""

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=plgpu.ShapeDtypeStruct(array.shape, jnp.int32,
                                         plgpu.Layout.WGMMA))
  def convert(ctx, values):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    registers = np.empty_like(values.registers)
    for index, register in np.ndenumerate(values.registers):
      (width,) = ir.VectorType(register.type).shape
      rounded = [mgpu_utils.inline_ptx(
          "cvt.rni.s32.f32 $0, $1;",
          vector.extract(register, dynamic_position=[],
                         static_position=[i]),
          result_types=i32) for i in range(width)]
      registers[index] = vector.from_elements(
          ir.VectorType.get((width,), i32), rounded)
    return mgpu.FragmentedArray(_registers=registers, _layout=values.layout,
                                _is_signed=True)

  return convert(array)


def _for_each_compute_warpgroup(wg, chunks: int, consumer):
  """Runs consumer(row_group, chunk) on the compute warpgroups, in the
  roles `pipeline.row_group_of` and `pipeline.column_chunk_of` give them:
  the row group is traced, the column chunk static (it slices shared
  memory; with the product split it is the warpgroup's role, 0 the
  probabilities, 1 the gradients)."""
  if chunks == 1:
    pl.when(wg < COMPUTE_WARPGROUPS)(functools.partial(
        consumer, pipeline.row_group_of(wg, chunks),
        pipeline.column_chunk_of(wg, chunks)))
    return
  for chunk in range(chunks):
    pl.when(jnp.logical_and(wg < COMPUTE_WARPGROUPS,
                            pipeline.column_chunk_of(wg, chunks) == chunk))(
        functools.partial(consumer, pipeline.row_group_of(wg, chunks),
                          chunk))


def _ranges(segments, name: str):
  """The host's `name` tile ranges ref, or None without segments."""
  return None if segments is None else getattr(segments, name)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DqScratch:
  """The dQ kernel's shared memory and barriers: types on the host
  (`backward_call`), refs in the kernel. The fields are in allocation order
  (the order of the refs in the kernel's jaxpr).

  Attributes:
    rows: the block's Q and dO tiles, [row_groups, block_q, H] each; with
      column chunks a union of them with the dQ staging (`_rows_scratch`,
      `_unpack_rows`).
    lse, delta: float32 [row_groups, block_q]: the rows' lse and delta.
    k, v: the K and V rings, [stages, block_kv, H].
    q_ids: with segments, int32 [row_groups, block_q]: the rows' ids; else
      None.
    kv_ids: with segments, int32 [stages, block_kv]: the ring of the key
      tiles' ids; else None.
    q_ready: per row group: its Q and lse (and ids) loaded.
    do_ready: per row group: its dO and delta loaded.
    k_ready, v_ready: per slot: its K tile (and ids), its V tile loaded.
    consumed: per slot: every compute warpgroup is done with it.
    done: the compute warpgroups are done reading Q and dO (column chunks:
      before the staging that aliases them is written; product split:
      before dQ is written over Q).
    probs: with the product split, float32 [block_q, block_kv]: the
      probabilities warpgroup's `_score_factor` tile, handed to the
      gradients warpgroup; else None.
    probs_ready, probs_free: with the product split, the hand-over's
      barriers (`_hand_over`, `_take_over`); else None.
  """

  rows: Any
  lse: Any
  delta: Any
  k: Any
  v: Any
  q_ids: Any
  kv_ids: Any
  q_ready: Any
  do_ready: Any
  k_ready: Any
  v_ready: Any
  consumed: Any
  done: Any
  probs: Any = None
  probs_ready: Any = None
  probs_free: Any = None


def dq_kernel(refs: pipeline.KernelInputs, dq_ref, scratch: DqScratch, *,
              mask: MaskSpec, scale: float, soft_cap: float | None,
              block_q: int, block_kv: int, stages: int, row_groups: int,
              chunks: int, group: int, q_seq: int, kv_seq: int,
              split_products: bool = False):
  """The dQ kernel.

  Args:
    refs: q, k, v, do, lse, delta, q_lengths, kv_lengths, and segments
      where the call has them.
    dq_ref: the output, like q.
    scratch: the block's shared memory and barriers.
    split_products: the two warpgroups of the (single) row group split its
      products (`config.backward_splits_products`), not its columns.
  """
  (q_smem, do_smem), stage = _unpack_rows(scratch.rows,
                                          1 if split_products else chunks)
  head_dim = refs.q.shape[3]
  width = head_dim // chunks
  dtype = refs.q.dtype
  block_rows = row_groups * block_q
  segments = refs.segments

  block = pipeline.query_block(
      mask, refs.q_lengths, refs.kv_lengths, q_seq=q_seq, kv_seq=kv_seq,
      block_rows=block_rows, block_kv=block_kv,
      ranges_ref=_ranges(segments, "block_ranges"))
  batch, head = block.batch, block.head
  # With segments: each row group's ids (loaded with its Q), and the ring of
  # the key tiles' ids (loaded with K).
  q_ids, kv_ids = pipeline.segment_sources(segments, scratch.q_ids,
                                           scratch.kv_ids)

  slot_of = functools.partial(pipeline.slot_of, lo=block.steps_lo,
                              stages=stages)

  def key_runs(q_start):
    """The runs (lo, hi, kind) of the key tiles that the row tile of queries
    from q_start sees (`pipeline.key_tiles`, `consumer_runs`); with the
    product split both warpgroups walk the same runs."""
    tiles = pipeline.key_tiles(mask, block, q_start, block_q, block_kv,
                               _ranges(segments, "group_ranges"))
    return pipeline.consumer_runs(tiles, block.steps_lo, block.steps_hi)

  def masked_probabilities(s, lse, kv_step, kind: str, rows, columns,
                           segment_ids):
    """(P, the capped logits or None) of key tile kv_step from its scores
    S = Q K^T: base-2 softmax numerators against the rows' lse, masked
    where `kind` is "masked" (rows, columns: the tile's query rows and key
    offsets; segment_ids(): `pipeline.key_tile_segment_ids`' tiles or (),
    built only for a masked tile)."""
    tile_shape = s.shape
    logits, capped = numerics.logits_base2(s, scale=scale,
                                           soft_cap=soft_cap)
    probs = jnp.exp2(logits - lax.broadcast_in_dim(lse, tile_shape, [0]))
    if kind == "masked":
      seen = pipeline.key_tile_visible(mask, rows, columns, kv_step,
                                       block_kv, block.kv_len,
                                       block.offset, *segment_ids())
      probs = jnp.where(seen, probs, 0.0)
    return probs, capped

  def consumer(row_group, chunk: int):
    plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
    q_start = pipeline.row_group_start(block.start, row_group, block_q)
    q_tile, do_tile = q_smem.at[row_group], do_smem.at[row_group]
    plgpu.barrier_wait(scratch.q_ready.at[row_group])
    plgpu.barrier_wait(scratch.do_ready.at[row_group])

    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    tile_shape = (block_q, block_kv)
    row_ids = q_start + plgpu.broadcasted_iota(jnp.int32, (block_q,), 0,
                                               layout=row_layout)
    lse = plgpu.load(scratch.lse.at[row_group], layout=row_layout)
    lse = pipeline.valid_lse(lse, row_ids, block.q_len)
    delta = plgpu.load(scratch.delta.at[row_group], layout=row_layout)
    rows = q_start + plgpu.broadcasted_iota(jnp.int32, tile_shape, 0,
                                            layout=wgmma_layout)
    columns = plgpu.broadcasted_iota(jnp.int32, tile_shape, 1,
                                     layout=wgmma_layout)
    row_segments = (None if q_ids is None
                    else pipeline.ids_vector(q_ids[1].at[row_group], 0))

    segment_tiles = functools.partial(
        pipeline.key_tile_segment_ids, row_segments,
        None if kv_ids is None else kv_ids[1], tile_shape=tile_shape)

    def step(kv_step, dq, *, kind: str):
      slot = slot_of(kv_step)
      k_tile = scratch.k.at[slot]
      plgpu.barrier_wait(scratch.k_ready.at[slot])
      plgpu.barrier_wait(scratch.v_ready.at[slot])
      if kind == "skip":
        plgpu.barrier_arrive(scratch.consumed.at[slot])
        return dq

      def scores_and_probabilities(s_ref, dp_ref):
        plgpu.wgmma(s_ref, q_tile, k_tile.T)
        plgpu.wgmma(dp_ref, do_tile, scratch.v.at[slot].T)
        # S only (wait_n=1: dP's product may still run): the softmax
        # overlaps dP = dO V^T on the tensor cores.
        s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
        probs, capped = masked_probabilities(
            s, lse, kv_step, kind, rows, columns,
            functools.partial(segment_tiles, slot))
        return probs, capped, dp_ref[...]

      probs, capped, dp = pl.run_scoped(
          scores_and_probabilities, plgpu.ACC(tile_shape, jnp.float32),
          plgpu.ACC(tile_shape, jnp.float32))
      ds = _score_gradient(probs, capped, dp,
                           lax.broadcast_in_dim(delta, tile_shape, [0]))
      ds = ds.astype(dtype)

      dq = _accumulated(dq, ds, _columns(k_tile, chunk, width, chunks))
      plgpu.barrier_arrive(scratch.consumed.at[slot])
      return dq

    dq = plgpu.layout_cast(jnp.zeros((block_q, width), jnp.float32),
                           wgmma_layout)
    for lo, hi, kind in key_runs(q_start):
      dq = lax.fori_loop(lo, hi, functools.partial(step, kind=kind), dq)

    if chunks > 1:
      # The other chunk's warpgroup may still read Q and dO, which `stage`
      # aliases: wait for it.
      plgpu.barrier_arrive(scratch.done)
      plgpu.barrier_wait(scratch.done)
      out_tile = stage[0].at[chunk]
    else:
      out_tile = q_tile
    out_tile[...] = (dq * scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
        out_tile, dq_ref.at[batch, pl.ds(q_start, block_q), head,
                            pl.ds(chunk * width, width)])
    plgpu.wait_smem_to_gmem(0)

  # The product split: one row group, warpgroup 0 computes the probabilities
  # and hands them over, warpgroup 1 computes dP, dS and all of dQ.
  tile_shape = (block_q, block_kv)
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  def probabilities():
    """Warpgroup 0: per key tile S = Q K^T, P (masked), handed over."""
    plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
    q_start, q_tile = block.start, q_smem.at[0]
    plgpu.barrier_wait(scratch.q_ready.at[0])
    wgmma_layout = plgpu.Layout.WGMMA
    row_ids = q_start + plgpu.broadcasted_iota(jnp.int32, (block_q,), 0,
                                               layout=row_layout)
    lse = plgpu.load(scratch.lse.at[0], layout=row_layout)
    lse = pipeline.valid_lse(lse, row_ids, block.q_len)
    rows = q_start + plgpu.broadcasted_iota(jnp.int32, tile_shape, 0,
                                            layout=wgmma_layout)
    columns = plgpu.broadcasted_iota(jnp.int32, tile_shape, 1,
                                     layout=wgmma_layout)
    row_segments = (None if q_ids is None
                    else pipeline.ids_vector(q_ids[1].at[0], 0))
    segment_tiles = functools.partial(
        pipeline.key_tile_segment_ids, row_segments,
        None if kv_ids is None else kv_ids[1], tile_shape=tile_shape)

    def step(kv_step, carry, *, kind: str):
      slot = slot_of(kv_step)
      plgpu.barrier_wait(scratch.k_ready.at[slot])
      if kind == "skip":
        plgpu.barrier_arrive(scratch.consumed.at[slot])
        return carry

      def scores(acc_ref):
        plgpu.wgmma(acc_ref, q_tile, scratch.k.at[slot].T)
        return acc_ref[...]

      s = pl.run_scoped(scores, plgpu.ACC(tile_shape, jnp.float32))
      probs, capped = masked_probabilities(
          s, lse, kv_step, kind, rows, columns,
          functools.partial(segment_tiles, slot))
      _hand_over(scratch, _score_factor(probs, capped))
      plgpu.barrier_arrive(scratch.consumed.at[slot])
      return carry

    for lo, hi, kind in key_runs(block.start):
      lax.fori_loop(lo, hi, functools.partial(step, kind=kind), ())
    # Done reading Q: warpgroup 1 writes dQ over it.
    plgpu.barrier_arrive(scratch.done)

  def gradients():
    """Warpgroup 1: per key tile dP = dO V^T, dS from the handed-over
    probabilities, dQ += dS K."""
    plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
    q_tile, do_tile = q_smem.at[0], do_smem.at[0]
    plgpu.barrier_wait(scratch.do_ready.at[0])
    delta = lax.broadcast_in_dim(
        plgpu.load(scratch.delta.at[0], layout=row_layout), tile_shape, [0])
    plgpu.barrier_arrive(scratch.probs_free)  # The buffer starts free.

    def step(kv_step, dq, *, kind: str):
      slot = slot_of(kv_step)
      plgpu.barrier_wait(scratch.k_ready.at[slot])
      plgpu.barrier_wait(scratch.v_ready.at[slot])
      if kind == "skip":
        plgpu.barrier_arrive(scratch.consumed.at[slot])
        return dq

      dp, factor = _score_gradients_and_factor(
          scratch, do_tile, scratch.v.at[slot], tile_shape)
      ds = (factor * (dp - delta)).astype(dtype)

      dq = _accumulated(dq, ds, scratch.k.at[slot])
      plgpu.barrier_arrive(scratch.consumed.at[slot])
      return dq

    dq = plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32),
                           plgpu.Layout.WGMMA)
    for lo, hi, kind in key_runs(block.start):
      dq = lax.fori_loop(lo, hi, functools.partial(step, kind=kind), dq)
    plgpu.barrier_arrive(scratch.done)
    plgpu.barrier_wait(scratch.done)
    q_tile[...] = (dq * scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
        q_tile, dq_ref.at[batch, pl.ds(block.start, block_q), head])
    plgpu.wait_smem_to_gmem(0)

  if split_products:
    assert row_groups == 1, row_groups
    _for_each_compute_warpgroup(
        block.warpgroup, chunks,
        lambda _, role: (probabilities, gradients)[role]())
  else:
    _for_each_compute_warpgroup(block.warpgroup, chunks, consumer)

  @pl.when(block.warpgroup == PRODUCER)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
    kv_head = pipeline.kv_head_of(head, group)
    load_rows = pipeline.query_loader(
        refs.q, refs.lse, refs.do, refs.delta, q_smem, scratch.lse, do_smem,
        scratch.delta, scratch.q_ready, scratch.do_ready, batch=batch,
        block_q=block_q, ids=q_ids)
    for row_group in range(row_groups):
      load_rows(head, pipeline.row_group_start(block.start, row_group,
                                               block_q), row_group)

    load = pipeline.key_value_loader(
        refs.k, refs.v, scratch.k, scratch.v, scratch.k_ready,
        scratch.v_ready, batch=batch, kv_head=kv_head, block_kv=block_kv,
        ids=kv_ids)
    pipeline.produce(load, block.steps_lo, block.steps_hi, stages,
                     (scratch.consumed,))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DkvScratch:
  """The dK/dV kernel's shared memory and barriers: types on the host
  (`backward_call`), refs in the kernel. The fields are in allocation order
  (the order of the refs in the kernel's jaxpr).

  Attributes:
    rows: the block's K and V tiles, [row_groups, block_kv, H] each; with
      column chunks a union of them with the dK and dV staging
      (`_rows_scratch`, `_unpack_rows`).
    q, do: the Q and dO rings, [stages, block_q, H].
    lse, delta: float32 [stages, block_q]: the rings of the query tiles'
      lse and delta.
    kv_ids: with segments, int32 [row_groups, block_kv]: the keys' ids;
      else None.
    q_ids: with segments, int32 [stages, block_q]: the ring of the query
      tiles' ids; else None.
    ds: with atomic_dq, [2, row_groups, block_kv, block_q]: by step
      parity, each row group's dS^T, transposed the left operands of the dQ
      products of both warpgroups; else None.
    dq_stage: with atomic_dq, [COMPUTE_WARPGROUPS, pieces, DQ_PIECE,
      DQ_PIECE] of dq_sum's dtype: each warpgroup's dQ pieces
      (`config.atomic_dq_pieces`) for their reduce-adds; else None.
    kv_ready: per row group: its K and V (and ids) loaded.
    q_ready: per slot: its Q and lse (and ids) loaded.
    do_ready: per slot: its dO and delta loaded.
    consumed: per slot: every compute warpgroup is done with it.
    done: the compute warpgroups are done reading K and V (column chunks:
      before the staging that aliases them is written; product split and
      atomic_dq: before dK and dV are written over K and V).
    probs: with the product split, float32 [block_kv, block_q]: the
      probabilities warpgroup's transposed `_score_factor` tile, handed to
      the gradients warpgroup; else None.
    probs_ready, probs_free: with the product split, the hand-over's
      barriers (`_hand_over`, `_take_over`); else None.
    ds_ready: with atomic_dq, per ds buffer: both row groups' dS^T
      written.
    ds_free: with atomic_dq, per ds buffer: both warpgroups' dQ products
      have read it.
    dq_factors: with atomic_dq in fixed point, float32 [stages, block_q]:
      the ring of the query rows' factors 2^e (`dq_fixed_point_exponents`);
      else None.
  """

  rows: Any
  q: Any
  do: Any
  lse: Any
  delta: Any
  kv_ids: Any
  q_ids: Any
  ds: Any
  dq_stage: Any
  kv_ready: Any
  q_ready: Any
  do_ready: Any
  consumed: Any
  done: Any
  probs: Any = None
  probs_ready: Any = None
  probs_free: Any = None
  ds_ready: Any = None
  ds_free: Any = None
  dq_factors: Any = None


def dkv_kernel(refs: pipeline.KernelInputs, dk_ref, dv_ref,
               scratch: DkvScratch, *, mask: MaskSpec, scale: float,
               soft_cap: float | None, block_q: int, block_kv: int,
               stages: int, row_groups: int, chunks: int, group: int,
               q_seq: int, kv_seq: int, split_products: bool = False):
  """The dK/dV kernel.

  Args:
    refs: q, k, v, do, lse, delta, q_lengths, kv_lengths, and segments
      where the call has them; with `refs.dq_sum` (atomic_dq, float32
      [B, T', N, H], zeros) the kernel also adds each tile's dQ / scale
      into it.
    dk_ref, dv_ref: the outputs, like k.
    scratch: the block's shared memory and barriers.
    split_products: the two warpgroups of the (single) row group split its
      products (`config.backward_splits_products`), not its columns.
  """
  (k_smem, v_smem), stage = _unpack_rows(scratch.rows,
                                          1 if split_products else chunks)
  head_dim = refs.q.shape[3]
  width = head_dim // chunks
  dtype = refs.q.dtype
  block_rows = row_groups * block_kv
  segments = refs.segments

  block = pipeline.key_block(
      mask, refs.q_lengths, refs.kv_lengths, q_seq=q_seq, kv_seq=kv_seq,
      block_rows=block_rows, block_q=block_q, group=group,
      ranges_ref=_ranges(segments, "block_ranges"))
  batch, kv_head = block.batch, block.kv_head
  # With segments: each row group's key ids (loaded with its K and V), and
  # the ring of the query tiles' ids (loaded with Q).
  kv_ids, q_ids = pipeline.segment_sources(segments, scratch.kv_ids,
                                           scratch.q_ids)

  compute_registers, producer_registers = (
      (COMPUTE_REGISTERS, PRODUCER_REGISTERS) if refs.dq_sum is None
      else ATOMIC_DQ_REGISTERS)
  wgmma_layout = plgpu.Layout.WGMMA
  column_layout = plgpu.Layout.WGMMA.reduce(0)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  # Transposed tiles: rows are keys, columns queries.
  tile_shape = (block_kv, block_q)

  def query_runs(k_start):
    """The runs (lo, hi, kind) of the query tiles that the row tile of keys
    from k_start sees (`pipeline.query_tiles`, `consumer_runs`)."""
    tiles = pipeline.query_tiles(mask, block, k_start, block_kv, block_q,
                                 _ranges(segments, "group_ranges"))
    return pipeline.consumer_runs(tiles, block.tiles_lo, block.tiles_hi)

  def walk_query_tiles(runs, step, carry):
    """Runs step(q_tile_index, carry, head_step=, kind=) over `runs` for
    every query head of the kv head's GQA group; returns the carry."""

    def head_loop(head_step, carry):
      for lo, hi, kind in runs:
        carry = lax.fori_loop(
            lo, hi, functools.partial(step, head_step=head_step, kind=kind),
            carry)
      return carry

    if group == 1:
      return head_loop(jnp.int32(0), carry)
    return lax.fori_loop(0, group, head_loop, carry)

  def transposed_probabilities(row_group, k_start, k_tile):
    """A warpgroup's per-step P^T of its keys (row group `row_group`, from
    k_start, in k_tile), once K is loaded: returns
    probabilities(slot, q_tile_index, kind) -> (P^T, the capped logits or
    None): S^T = K Q^T of query tile `slot`, base-2 softmax numerators
    against the rows' lse, masked where `kind` is "masked"."""
    key_ids = k_start + plgpu.broadcasted_iota(jnp.int32, tile_shape, 0,
                                               layout=wgmma_layout)
    query_offsets = plgpu.broadcasted_iota(jnp.int32, tile_shape, 1,
                                           layout=wgmma_layout)
    query_vector = plgpu.broadcasted_iota(jnp.int32, (block_q,), 0,
                                          layout=column_layout)
    key_segments = (None if kv_ids is None
                    else pipeline.ids_vector(kv_ids[1].at[row_group], 0))

    def segment_tiles(slot):
      """(q_ids, kv_ids) tiles of query tile `slot` (columns) and of this
      warpgroup's keys (rows), or () without segments."""
      if key_segments is None:
        return ()
      return (pipeline.ids_tile(pipeline.ids_vector(q_ids[1].at[slot], 1),
                                tile_shape, 1),
              pipeline.ids_tile(key_segments, tile_shape, 0))

    def probabilities(slot, q_tile_index, kind: str):
      q_start = pipeline.tile_start(q_tile_index, block_q)

      def scores(acc_ref):
        plgpu.wgmma(acc_ref, k_tile, scratch.q.at[slot].T)
        return acc_ref[...]

      s_t = pl.run_scoped(scores, plgpu.ACC(tile_shape, jnp.float32))
      lse = plgpu.load(scratch.lse.at[slot], layout=column_layout)
      lse = pipeline.valid_lse(lse, q_start + query_vector, block.q_len)
      logits, capped = numerics.logits_base2(s_t, scale=scale,
                                             soft_cap=soft_cap)
      probs = jnp.exp2(logits - lax.broadcast_in_dim(lse, tile_shape, [1]))
      if kind == "masked":
        seen = pipeline.query_tile_visible(mask, query_offsets, q_start,
                                           key_ids, block.kv_len,
                                           block.offset, *segment_tiles(slot))
        probs = jnp.where(seen, probs, 0.0)
      return probs, capped

    return probabilities

  def query_tile_slot(q_tile_index, head_step, kind: str):
    """The ring slot of a step's Q and dO tiles once its Q tile is in, for
    the warpgroups that compute probabilities (their dO wait comes later,
    after S^T); None for a skipped tile, whose dO is still waited for and
    whose slot is released (every thread waits on every phase)."""
    slot = pipeline.group_slot(head_step, q_tile_index, block, stages)
    plgpu.barrier_wait(scratch.q_ready.at[slot])
    if kind == "skip":
      plgpu.barrier_wait(scratch.do_ready.at[slot])
      plgpu.barrier_arrive(scratch.consumed.at[slot])
      return None
    return slot

  def consumer(row_group, chunk: int):
    plgpu.set_max_registers(compute_registers, action="increase")
    k_start = pipeline.row_group_start(block.start, row_group, block_kv)
    k_tile, v_tile = k_smem.at[row_group], v_smem.at[row_group]
    plgpu.barrier_wait(scratch.kv_ready.at[row_group])
    probabilities_of = transposed_probabilities(row_group, k_start, k_tile)

    # atomic_dq: each warpgroup's dQ pieces (`config.atomic_dq_pieces`).
    # Where both have as many, piece j's offsets are picked by the (traced)
    # row group: one copy of the code (two warpgroups: row_group is 0 or 1).
    per_warpgroup = atomic_dq_pieces(block_q, head_dim)
    same_count = len(set(map(len, per_warpgroup))) == 1
    pick = lambda a, b: a if a == b else a + row_group * (b - a)

    def piece_rows():
      """The query rows of this warpgroup's dQ pieces (where the counts
      differ, warpgroup 0's, the only one with pieces)."""
      if not same_count:
        return [pl.ds(row, DQ_PIECE) for row, _ in per_warpgroup[0]]
      return [pl.ds(pick(r0, r1), DQ_PIECE)
              for (r0, _), (r1, _) in zip(*per_warpgroup)]

    def piece_factors(slot):
      """In fixed point, the factors 2^e of the query rows of this
      warpgroup's dQ pieces of query tile `slot` (row layout, one vector a
      piece; kept until the pieces are added a step later, when the ring
      slot may hold another tile's); else ()."""
      if refs.dq_factors is None:
        return ()
      return tuple(plgpu.load(scratch.dq_factors.at[slot, rows],
                              layout=row_layout) for rows in piece_rows())

    def tile_gradients(slot, q_tile_index, kind: str, dv):
      """(dV + P^T dO, dS^T in the input dtype) of query tile `slot`."""
      do_tile = scratch.do.at[slot]
      probs, capped = probabilities_of(slot, q_tile_index, kind)

      plgpu.barrier_wait(scratch.do_ready.at[slot])

      def values(accumulators):
        dv_acc, dp_acc = accumulators
        plgpu.wgmma(dv_acc, probs.astype(dtype),
                    _columns(do_tile, chunk, width, chunks))
        plgpu.wgmma(dp_acc, v_tile, do_tile.T)

      zeros = plgpu.layout_cast(jnp.zeros(tile_shape, jnp.float32),
                                wgmma_layout)
      dv, dp_t = pl.run_state(values)((plgpu.ACC.init(dv),
                                       plgpu.ACC.init(zeros)))
      delta = plgpu.load(scratch.delta.at[slot], layout=column_layout)
      ds_t = _score_gradient(probs, capped, dp_t,
                             lax.broadcast_in_dim(delta, tile_shape, [1]))
      return dv, ds_t.astype(dtype)

    def step(q_tile_index, carry, *, head_step, kind: str):
      dk, dv = carry
      slot = query_tile_slot(q_tile_index, head_step, kind)
      if slot is None:
        return carry
      dv, ds_t = tile_gradients(slot, q_tile_index, kind, dv)
      dk = _accumulated(dk, ds_t,
                        _columns(scratch.q.at[slot], chunk, width, chunks))
      plgpu.barrier_arrive(scratch.consumed.at[slot])
      return dk, dv

    def atomic_step(q_tile_index, carry, *, head_step, kind: str):
      """`step` with atomic_dq: also shares the tile's dS^T and adds the
      dQ = dS K of the step before into dq_sum (`add_query_gradient`, with
      that step's factors, carried). A tile this row group skips still
      takes part (its dS^T zero): the other row group's may not be."""
      dk, dv, earlier_factors = carry
      index = head_step * block.tiles_per_head + (q_tile_index
                                                  - block.tiles_lo)
      slot = pipeline.group_slot(head_step, q_tile_index, block, stages)
      plgpu.barrier_wait(scratch.q_ready.at[slot])
      if kind == "skip":
        plgpu.barrier_wait(scratch.do_ready.at[slot])
        ds_t = plgpu.layout_cast(jnp.zeros(tile_shape, dtype), wgmma_layout)
      else:
        dv, ds_t = tile_gradients(slot, q_tile_index, kind, dv)
      # (Skipped tiles too: the pieces sum both row groups' keys.)
      factors = piece_factors(slot)
      # This row group's dS^T, for both warpgroups' dQ products in the next
      # step, into the buffer both have read two steps ago.
      buffer = lax.rem(index, 2)
      plgpu.barrier_wait(scratch.ds_free.at[buffer])
      scratch.ds.at[buffer, row_group][...] = ds_t
      plgpu.commit_smem()
      plgpu.barrier_arrive(scratch.ds_ready.at[buffer])
      if kind != "skip":
        dk = _accumulated(dk, ds_t, scratch.q.at[slot])
      plgpu.barrier_arrive(scratch.consumed.at[slot])
      pl.when(index > 0)(
          lambda: add_query_gradient(index - 1, earlier_factors))
      return dk, dv, factors

    def add_query_gradient(index, factors):
      """dq_sum[q rows, head] += dS K of step `index` (atomic_dq), over the
      block's keys, once both row groups' dS^T of that step are in shared
      memory. One step late, so that the two warpgroups may drift apart by
      up to a step (each one's softmax under the other's products) instead
      of meeting at every step. The [block_q, H] dQ tile is cut into
      64 x 64 pieces (`config.atomic_dq_pieces`) split between the
      warpgroups; each piece sums both row groups' keys in its product and
      goes out through a float32 staging tile and one TMA reduce-add: one
      reduce-add per dQ element per block of keys. In fixed point each
      piece is scaled by its rows' `factors` (powers of two: exact, the
      same bits as scaling dS^T) and rounded to int32."""
      buffer = lax.rem(index, 2)
      head_step = lax.div(index, block.tiles_per_head)
      q_start = pipeline.tile_start(
          block.tiles_lo + lax.rem(index, block.tiles_per_head), block_q)
      head = kv_head * group + head_step
      slices = lambda pieces: [(pl.ds(row, DQ_PIECE), pl.ds(column, DQ_PIECE))
                               for row, column in pieces]
      if same_count:
        pieces = [(pick(r0, r1), pick(c0, c1))
                  for (r0, c0), (r1, c1) in zip(*per_warpgroup)]
        add_pieces(row_group, slices(pieces), buffer, q_start, head, factors)
      else:
        for warpgroup, pieces in enumerate(per_warpgroup):
          if pieces:
            pl.when(row_group == warpgroup)(functools.partial(
                add_pieces, warpgroup, slices(pieces), buffer, q_start,
                head, factors))
      plgpu.barrier_arrive(scratch.ds_free.at[buffer])

    def add_pieces(warpgroup, pieces, buffer, q_start, head, factors):
      plgpu.barrier_wait(scratch.ds_ready.at[buffer])
      for piece, (rows, columns) in enumerate(pieces):

        def product(acc_ref):
          for group_keys in range(row_groups):
            ds_tile = scratch.ds.at[buffer, group_keys].at[:, rows]
            plgpu.wgmma(acc_ref, ds_tile.T,
                        k_smem.at[group_keys].at[:, columns])
          return acc_ref[...]

        dq = pl.run_scoped(product, plgpu.ACC((DQ_PIECE, DQ_PIECE),
                                              jnp.float32))
        if refs.dq_factors is not None:
          # |dq| < 2^31 by the factors' bound (`dq_fixed_point_exponents`).
          dq = _to_fixed_point(
              dq * lax.broadcast_in_dim(factors[piece], dq.shape, [0]))
        # This piece's reduce-add of the step before (len(pieces) copies
        # ago) must have read its staging tile.
        plgpu.wait_smem_to_gmem(len(pieces) - 1, wait_read_only=True)
        dq_tile = scratch.dq_stage.at[warpgroup, piece]
        dq_tile[...] = dq
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            dq_tile, refs.dq_sum.at[batch, pl.ds(q_start + rows.start,
                                                 DQ_PIECE), head, columns],
            reduction_op="add")

    runs = query_runs(k_start)
    zeros = plgpu.layout_cast(jnp.zeros((block_kv, width), jnp.float32),
                              wgmma_layout)
    if refs.dq_sum is None:
      dk, dv = walk_query_tiles(runs, step, (zeros, zeros))
    else:
      for buffer in range(2):  # Both dS^T buffers start free.
        plgpu.barrier_arrive(scratch.ds_free.at[buffer])
      no_factors = tuple(
          plgpu.layout_cast(jnp.zeros((DQ_PIECE,), jnp.float32), row_layout)
          for _ in (piece_rows() if refs.dq_factors is not None else ()))
      dk, dv, factors = walk_query_tiles(runs, atomic_step,
                                         (zeros, zeros, no_factors))
      # The last step's dQ.
      pl.when(block.num_steps > 0)(
          lambda: add_query_gradient(block.num_steps - 1, factors))

    if chunks > 1 or refs.dq_sum is not None:
      # The other warpgroup may still read what the gradients are written
      # over (column chunks: K and V, which `stage` aliases; atomic_dq: its
      # dQ pieces read this row group's K): wait for it.
      plgpu.barrier_arrive(scratch.done)
      plgpu.barrier_wait(scratch.done)
    if chunks > 1:
      dk_tile, dv_tile = stage[0].at[chunk], stage[1].at[chunk]
    else:
      dk_tile, dv_tile = k_tile, v_tile
    rows = (batch, pl.ds(k_start, block_kv), kv_head,
            pl.ds(chunk * width, width))
    dk_tile[...] = (dk * scale).astype(dtype)
    dv_tile[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dk_tile, dk_ref.at[rows])
    plgpu.copy_smem_to_gmem(dv_tile, dv_ref.at[rows])
    plgpu.wait_smem_to_gmem(0)

  # The product split: one row group; warpgroup 0 computes the
  # probabilities, hands them over and accumulates all of dV, warpgroup 1
  # computes dP^T, dS^T and accumulates all of dK.
  def split_walk(step, carry):
    """`walk_query_tiles` over the row group's query tiles (both
    warpgroups walk them)."""
    return walk_query_tiles(query_runs(block.start), step, carry)

  def store_gradient(tile, gradient, out_ref):
    """Writes a [block_kv, H] gradient over `tile` (K or V, which the other
    warpgroup may still read: waits for it) and copies it out."""
    plgpu.barrier_arrive(scratch.done)
    plgpu.barrier_wait(scratch.done)
    tile[...] = gradient.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
        tile, out_ref.at[batch, pl.ds(block.start, block_kv), kv_head])
    plgpu.wait_smem_to_gmem(0)

  def probabilities():
    """Warpgroup 0: per query tile S^T = K Q^T, P^T (masked), handed over;
    dV += P^T dO."""
    plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
    plgpu.barrier_wait(scratch.kv_ready.at[0])
    probabilities_of = transposed_probabilities(0, block.start, k_smem.at[0])

    def step(q_tile_index, dv, *, head_step, kind: str):
      slot = query_tile_slot(q_tile_index, head_step, kind)
      if slot is None:
        return dv
      probs, capped = probabilities_of(slot, q_tile_index, kind)
      factor = _score_factor(probs, capped)
      probs = probs.astype(dtype)
      plgpu.barrier_wait(scratch.do_ready.at[slot])

      def values(acc_ref):
        plgpu.wgmma(acc_ref, probs, scratch.do.at[slot])
        _hand_over(scratch, factor)  # While the product runs.

      dv = pl.run_state(values)(plgpu.ACC.init(dv))
      plgpu.barrier_arrive(scratch.consumed.at[slot])
      return dv

    zeros = plgpu.layout_cast(jnp.zeros((block_kv, head_dim), jnp.float32),
                              wgmma_layout)
    store_gradient(v_smem.at[0], split_walk(step, zeros), dv_ref)

  def gradients():
    """Warpgroup 1: per query tile dP^T = V dO^T, dS^T from the
    handed-over probabilities, dK += dS^T Q."""
    plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
    v_tile = v_smem.at[0]
    plgpu.barrier_wait(scratch.kv_ready.at[0])
    plgpu.barrier_arrive(scratch.probs_free)  # The buffer starts free.

    def step(q_tile_index, dk, *, head_step, kind: str):
      slot = pipeline.group_slot(head_step, q_tile_index, block, stages)
      plgpu.barrier_wait(scratch.q_ready.at[slot])
      plgpu.barrier_wait(scratch.do_ready.at[slot])
      if kind == "skip":
        plgpu.barrier_arrive(scratch.consumed.at[slot])
        return dk

      dp_t, factor = _score_gradients_and_factor(
          scratch, v_tile, scratch.do.at[slot], tile_shape)
      delta = plgpu.load(scratch.delta.at[slot], layout=column_layout)
      delta = lax.broadcast_in_dim(delta, tile_shape, [1])
      ds_t = (factor * (dp_t - delta)).astype(dtype)

      dk = _accumulated(dk, ds_t, scratch.q.at[slot])
      plgpu.barrier_arrive(scratch.consumed.at[slot])
      return dk

    zeros = plgpu.layout_cast(jnp.zeros((block_kv, head_dim), jnp.float32),
                              plgpu.Layout.WGMMA)
    store_gradient(k_smem.at[0], split_walk(step, zeros) * scale, dk_ref)

  if split_products:
    assert refs.dq_sum is None and row_groups == 1, row_groups
    _for_each_compute_warpgroup(
        block.warpgroup, chunks,
        lambda _, role: (probabilities, gradients)[role]())
  else:
    _for_each_compute_warpgroup(block.warpgroup, chunks, consumer)

  @pl.when(block.warpgroup == PRODUCER)
  def _producer():
    plgpu.set_max_registers(producer_registers, action="decrease")
    for row_group in range(row_groups):
      k_start = pipeline.row_group_start(block.start, row_group, block_kv)
      rows = (batch, pl.ds(k_start, block_kv), kv_head)
      kv_ready = scratch.kv_ready.at[row_group]
      plgpu.copy_gmem_to_smem(refs.k.at[rows], k_smem.at[row_group],
                              kv_ready)
      plgpu.copy_gmem_to_smem(refs.v.at[rows], v_smem.at[row_group],
                              kv_ready)
      if kv_ids is not None:
        pipeline.load_ids(kv_ids, batch, k_start, block_kv, row_group,
                          kv_ready)

    load_rows = pipeline.query_loader(
        refs.q, refs.lse, refs.do, refs.delta, scratch.q, scratch.lse,
        scratch.do, scratch.delta, scratch.q_ready, scratch.do_ready,
        batch=batch, block_q=block_q, ids=q_ids,
        row_scales=(None if refs.dq_factors is None
                    else (refs.dq_factors, scratch.dq_factors)))

    def load(step, slot):
      load_rows(*pipeline.group_step_rows(step, block, group, block_q), slot)

    pipeline.produce(load, 0, block.num_steps, stages, (scratch.consumed,))


def dq_fixed_point_exponents(key, value, dout, delta, group: int):
  """atomic_dq in fixed point: per query row, the exponent e (int32
  [B, N, T'], `dq_sum` holds the row's dQ / scale times 2^e) and whether
  the row's bound is finite.

  The bound: the dK/dV kernel adds sum_k dS_ik K_kd over its keys into row
  i, dS_ik = P_ik (dP_ik - delta_i) with dP_ik = dO_i . V_k (times a soft
  cap's tanh' <= 1). The probabilities of a row sum to at most 1, so any
  partial sum over keys, and the sum of their magnitudes, is at most
  b_i = max|K| (|dO_i| max_k |V_k| + |delta_i|) (norms over the head dim;
  maxima over the kv head's keys). With 2^e b_i < 2^DQ_FIXED_POINT_BITS =
  2^30 every running int32 sum stays under 2^31 (dS's bf16 rounding and
  the pieces' float32 sums add well under 1% to it), and a row's
  resolution is b_i 2^-30 or finer. The kernel multiplies each float32
  dQ piece by 2^e before rounding it (powers of two: exact); e is clipped
  to +-120, within float32's normal range.

  Args:
    key, value: [B, S', K, H] (padded rows are zeros).
    dout: [B, T', N, H].
    delta: float32 [B, N, T'].
    group: query heads per kv head.
  """
  f32 = jnp.float32
  k_abs = jnp.abs(key.astype(f32))
  v_squares = jnp.sum(jnp.square(value.astype(f32)), axis=3)  # [B, S', K]
  k_max = jnp.max(k_abs, axis=(1, 3))  # [B, K]
  v_norm = jnp.sqrt(jnp.max(v_squares, axis=1))  # [B, K]
  do_norm = jnp.sqrt(jnp.sum(jnp.square(dout.astype(f32)), axis=3))
  do_norm = jnp.swapaxes(do_norm, 1, 2)  # [B, N, T']
  per_head = lambda x: jnp.repeat(x, group, axis=1)[:, :, None]
  ds_bound = do_norm * per_head(v_norm) + jnp.abs(delta)
  bound = per_head(k_max) * ds_bound
  exponent = DQ_FIXED_POINT_BITS - jnp.frexp(bound)[1]
  # Maxima may drop nans (XLA's fast min/max): sums keep them.
  kv_finite = jnp.isfinite(jnp.sum(k_abs, axis=(1, 3))
                           + jnp.sum(v_squares, axis=1))
  return (jnp.clip(exponent, -120, 120).astype(jnp.int32),
          jnp.isfinite(bound) & per_head(kv_finite))


def backward_call(operands: Operands, dout, lse2, delta, *, spec: CallSpec,
                  block_sizes: MosaicBlockSizes):
  """Launches the dQ and dK/dV kernels.

  Args:
    operands: the call's arrays: query [B, T, N, H], H in {64, 128, 256};
      key and value [B, S, K, H]; the lengths and segment ids where `spec`
      has them.
    dout: the output cotangent, like query.
    lse2: the forward's base-2 lse, float32 [B, N, T] (+inf: no key).
    delta: rowsum(dO * O) (less an lse cotangent), float32 [B, N, T].
    spec: the call.
    block_sizes: the tiles.

  Returns:
    (dq [B, T, N, H], dk [B, S, K, H], dv [B, S, K, H]) in query.dtype.
  """
  q_lengths, kv_lengths = pipeline.kernel_lengths(spec.mask, operands)
  segment_ids = pipeline.segment_ids(spec.mask, operands)
  query, key, value = operands.query, operands.key, operands.value
  batch, q_seq, num_heads, head_dim = query.shape
  kv_seq, num_kv_heads = key.shape[1], key.shape[2]
  dtype = query.dtype
  group = num_heads // num_kv_heads
  stages = block_sizes.backward_stages
  row_groups, chunks = backward_warpgroup_split(head_dim)
  split_products = backward_splits_products(head_dim)
  # Shared memory of the row tiles: a column split stages its outputs'
  # chunks in a union with them, a product split writes over them whole.
  rows_chunks = 1 if split_products else chunks
  if q_lengths is None:
    q_lengths = kv_lengths = jnp.zeros((batch,), jnp.int32)  # Unread.
  # TMA needs rows in multiples of SEQ_ALIGN: pad (padded rows and keys are
  # past q_seq / kv_seq, hence masked) and slice the gradients back.
  query, dout = pad_rows(query, SEQ_ALIGN), pad_rows(dout, SEQ_ALIGN)
  key, value = pad_rows(key, SEQ_ALIGN), pad_rows(value, SEQ_ALIGN)
  stats_pad = [(0, 0), (0, 0), (0, query.shape[1] - q_seq)]
  lse2 = jnp.pad(lse2.astype(jnp.float32), stats_pad,
                 constant_values=jnp.inf)
  delta = jnp.pad(delta.astype(jnp.float32), stats_pad)
  transforms = smem_transforms(dtype)
  tiles = lambda n, rows: plgpu.SMEM((n, rows, head_dim), dtype,
                                     transforms=transforms)
  stats = lambda n, rows: plgpu.SMEM((n, rows), jnp.float32)
  common = dict(mask=spec.mask, scale=spec.scale,
                soft_cap=spec.logits_soft_cap, stages=stages,
                row_groups=row_groups, chunks=chunks, group=group,
                q_seq=q_seq, kv_seq=kv_seq)
  if split_products:
    common.update(split_products=True)

  def hand_over_scratch(rows: int, columns: int) -> dict:
    """With the product split, the probabilities' buffer ([rows, columns]
    float32) and its barriers (`DqScratch`, `DkvScratch`); else none."""
    if not split_products:
      return {}
    return dict(probs=plgpu.SMEM((rows, columns), jnp.float32,
                                 transforms=smem_transforms(jnp.float32)),
                probs_ready=plgpu.Barrier(num_arrivals=1),
                probs_free=plgpu.Barrier(num_arrivals=1))
  inputs = pipeline.KernelInputs(
      q=query, k=key, v=value, do=dout, lse=lse2, delta=delta,
      q_lengths=q_lengths, kv_lengths=kv_lengths)
  has_segments = segment_ids is not None
  # With segments, the ids come with Q (dQ, dK/dV), K (dQ) or K and V
  # (dK/dV): one more copy on their barriers.
  with_ids = int(has_segments)

  def ids_scratch(n: int, rows: int):
    """Shared memory of n rows of segment ids, [n, rows], or None without
    segments."""
    return plgpu.SMEM((n, rows), jnp.int32) if has_segments else None

  def with_segments(queries_own: bool, own_rows: int, ring_rows: int):
    """`inputs` with, where the call has segments, the kernel's segment
    operands (own_rows: rows per row group, ring_rows: per streamed
    tile)."""
    if not has_segments:
      return inputs
    return inputs.replace(segments=pipeline.segment_inputs(
        segment_ids, queries_own=queries_own,
        block_rows=row_groups * own_rows, group_rows=own_rows,
        streamed_rows=ring_rows))

  block_q, block_kv = block_sizes.block_q_dq, block_sizes.block_kv_dq
  dq_scratch = DqScratch(
      rows=_rows_scratch(tiles, dtype, block_q, head_dim, row_groups,
                         rows_chunks),
      lse=stats(row_groups, block_q),
      delta=stats(row_groups, block_q),
      k=tiles(stages, block_kv),
      v=tiles(stages, block_kv),
      q_ids=ids_scratch(row_groups, block_q),
      kv_ids=ids_scratch(stages, block_kv),
      q_ready=plgpu.Barrier(num_arrivals=2 + with_ids,
                            num_barriers=row_groups),  # Q, lse (ids).
      do_ready=plgpu.Barrier(num_arrivals=2,
                             num_barriers=row_groups),  # dO, delta.
      k_ready=plgpu.Barrier(num_arrivals=1 + with_ids,
                            num_barriers=stages),  # K (ids).
      v_ready=plgpu.Barrier(num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS,
                             num_barriers=stages),
      done=plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS),
      **hand_over_scratch(block_q, block_kv),
  )
  atomic_dq = block_sizes.atomic_dq
  fixed_point = atomic_dq and spec.deterministic_grads
  operand_arrays = jax.tree.leaves(inputs)
  if not atomic_dq:
    dq = pipeline.launch(
        functools.partial(dq_kernel, block_q=block_q, block_kv=block_kv,
                          **common),
        dq_scratch, with_segments(True, block_q, block_kv),
        out_type=sharding.output_struct(query.shape, dtype,
                                        *operand_arrays),
        **pipeline.tile_grid(
            pl.cdiv(q_seq, row_groups * block_q), num_heads, batch,
            tile_axis="q_tiles", mask=spec.mask,
            streamed_bytes=2 * key.size * key.dtype.itemsize),
        num_threads=COMPUTE_WARPGROUPS + 1)

  block_q, block_kv = block_sizes.block_q_dkv, block_sizes.block_kv_dkv
  if atomic_dq:
    assert row_groups == COMPUTE_WARPGROUPS and chunks == 1, (row_groups,
                                                              chunks)
    max_pieces = max(map(len, atomic_dq_pieces(block_q, head_dim)))
    dq_sum_dtype = jnp.int32 if fixed_point else jnp.float32
  dkv_scratch = DkvScratch(
      rows=_rows_scratch(tiles, dtype, block_kv, head_dim, row_groups,
                         rows_chunks),
      q=tiles(stages, block_q),
      do=tiles(stages, block_q),
      lse=stats(stages, block_q),
      delta=stats(stages, block_q),
      kv_ids=ids_scratch(row_groups, block_kv),
      q_ids=ids_scratch(stages, block_q),
      ds=(plgpu.SMEM((2, row_groups, block_kv, block_q), dtype,
                     transforms=transforms)
          if atomic_dq else None),
      dq_stage=(plgpu.SMEM((COMPUTE_WARPGROUPS, max_pieces, DQ_PIECE,
                            DQ_PIECE), dq_sum_dtype,
                           transforms=smem_transforms(dq_sum_dtype))
                if atomic_dq else None),
      kv_ready=plgpu.Barrier(num_arrivals=2 + with_ids,
                             num_barriers=row_groups),  # K, V (ids).
      q_ready=plgpu.Barrier(num_arrivals=2 + with_ids,
                            num_barriers=stages),  # Q, lse (ids).
      do_ready=plgpu.Barrier(num_arrivals=2 + int(fixed_point),
                             num_barriers=stages),  # dO, delta (factors).
      consumed=plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS,
                             num_barriers=stages),
      done=plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS),
      **hand_over_scratch(block_kv, block_q),
      **(dict(ds_ready=plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS,
                                     num_barriers=2),
              ds_free=plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS,
                                    num_barriers=2))
         if atomic_dq else {}),
      **(dict(dq_factors=stats(stages, block_q)) if fixed_point else {}),
  )
  kv_struct = sharding.output_struct(key.shape, dtype, *operand_arrays)
  dkv_inputs = with_segments(False, block_kv, block_q)
  launch_dkv = functools.partial(
      pipeline.launch,
      functools.partial(dkv_kernel, block_q=block_q, block_kv=block_kv,
                        **common),
      dkv_scratch,
      **pipeline.tile_grid(
          pl.cdiv(kv_seq, row_groups * block_kv), num_kv_heads, batch,
          tile_axis="kv_tiles", mask=spec.mask,
          streamed_bytes=2 * query.size * query.dtype.itemsize),
      num_threads=COMPUTE_WARPGROUPS + 1)
  if not atomic_dq:
    dk, dv = launch_dkv(dkv_inputs, out_type=(kv_struct, kv_struct))
    return dq[:, :q_seq], dk[:, :kv_seq], dv[:, :kv_seq]

  factors = None
  if fixed_point:
    exponents, finite = dq_fixed_point_exponents(key, value, dout, delta,
                                                 group)
    # A row whose bound is not finite (inf or nan in its inputs, or in its
    # output through delta) adds nothing and comes out nan.
    one = jnp.float32(1)
    factors = jnp.where(finite, jnp.ldexp(one, exponents), 0.0)
    units = jnp.where(finite, jnp.ldexp(one, -exponents), jnp.nan)

  # The reduce-adds need a zeroed buffer that the kernel writes in place: a
  # state ref of `run_state` (discharged here, into a buffer aliased by the
  # kernel call), with dK and dV as refs beside it.
  def run(refs):
    dq_sum, dk, dv = refs
    launch_dkv(dkv_inputs.replace(dq_sum=dq_sum, dq_factors=factors),
               out_type=(), outputs=(dk, dv))

  dq_sum, dk, dv = pl.run_state(run)((
      jnp.zeros(query.shape, dq_sum_dtype), jnp.zeros(key.shape, dtype),
      jnp.zeros(key.shape, dtype)))
  if fixed_point:
    # Back from the rows' units (times 2^-e: exact).
    row_units = jnp.swapaxes(units, 1, 2)[..., None]  # [B, T', N, 1].
    dq = dq_sum.astype(jnp.float32) * row_units * spec.scale
  else:
    dq = dq_sum * spec.scale
  dq = dq.astype(dtype)
  return dq[:, :q_seq], dk[:, :kv_seq], dv[:, :kv_seq]
