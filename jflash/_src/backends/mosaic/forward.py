"""Forward kernel on Mosaic GPU (Hopper, sm90): warp-specialized attention.

FlashAttention-3 (Shah et al., 2024), forward, without FP8: one block
computes 2 * block_q query rows of one (batch, head) with three warpgroups.

- Warpgroup 2, the producer (few registers), streams K and V tiles with TMA
  into a ring of `num_stages` shared-memory slots. A slot is refilled once
  both compute warpgroups have arrived on its "consumed" barrier.
- Warpgroups 0 and 1, the consumers (most registers), own block_q rows
  each: Q^T tile in shared memory, S = Q K^T by wgmma (both operands in
  shared memory), the online softmax in registers in base 2 with the scale
  folded in, then O += P V by wgmma with P from registers.
- Ping-pong: a two-arrival "schedule" barrier makes the two consumers take
  turns, so that one's softmax overlaps the other's matrix products (the
  tensor cores are never idle while a warpgroup computes exponentials).
- The output goes back through the Q slot of shared memory and a TMA store;
  the lse (base 2, float32, `numerics.py`) through its own small slot.

Persistent launch (`is_persistent`: calls without window, lengths or
segments): one program per SM instead of one block per (query tile, head,
batch); each program works through its items (`pipeline.PersistentGrid`:
round-robin, query tiles fastest so that programs in flight share a head's
K and V in L2; causal tiles in pairs t, n-1-t of equal total work) while
the producer's ring runs on from one block into the next, so a block's Q
load and output stores overlap the next block's K/V loads instead of
costing a launch (H100: +12-60% at 2048 keys, a few % at 8k-32k).

Masks come from `masks.py`, as for every backend: the key tiles a query
tile visits (fully masked tiles are never visited) and the element-wise
predicate, applied only on tiles the mask cuts. The producer loads the union
of the two consumers' tiles; a consumer steps over the tiles outside its own
range without computing (it still waits and arrives on their barriers, so
every barrier's phase stays in step).

Shapes: q [B, T, N, H], k/v [B, S, K, H], H a multiple of 64. The TMA
tiling of shared memory takes sequence lengths in multiples of 8 rows:
`forward_call` pads T and S up to one (zeros, a copy only for such
lengths) and the kernel masks by the true lengths. Rows and keys past the
arrays' ends come in as zeros (TMA's out-of-bounds fill) and are masked;
stores past the ends are dropped by TMA.

Outputs: O in the input dtype and lse2 float32 [B, N, T], as the Triton
forward (a row that sees no key: O = 0, lse2 = +inf; with attention sinks
the lse includes the sink, and such a row before q_len gets lse2 = its
sink).
"""

from __future__ import annotations

import functools

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from jflash._src import numerics
from jflash._src import sharding
from jflash._src.backends.mosaic import pipeline
from jflash._src.backends.mosaic.config import MosaicBlockSizes
from jflash._src.spec import CallSpec
from jflash._src.spec import MaskSpec

# Warpgroups of a block: two consumers, then the producer.
COMPUTE_WARPGROUPS = 2
PRODUCER = 2
# Register budgets per thread after `set_max_registers` (the three
# warpgroups share 64K registers: 2 * 232 + 40 <= 512 per thread-slot).
COMPUTE_REGISTERS = 232
PRODUCER_REGISTERS = 40
# TMA row granularity of the shared-memory tiling: sequence lengths must be
# multiples of it.
SEQ_ALIGN = 8


def smem_transforms(dtype) -> tuple:
  """Tiling and 128-byte swizzle of a [rows, head_dim] 16-bit tile (the
  layout wgmma reads without bank conflicts)."""
  swizzle = 128
  columns = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(swizzle))


def forward_kernel(q_ref, k_ref, v_ref, q_lengths_ref, kv_lengths_ref,
                   sinks_ref, segments, out_ref, lse_ref, scratch, *,
                   mask: MaskSpec, scale: float, soft_cap: float | None,
                   block_sizes: MosaicBlockSizes, group: int, q_seq: int,
                   kv_seq: int,
                   persistent: pipeline.PersistentGrid | None = None):
  """The kernel; `segments`: a `pipeline.SegmentInputs` of refs, or None.

  persistent: a persistent launch (grid axis "programs"; calls whose key
  tiles do not depend on the block, see `forward_call`): each program
  computes its items one after the other, the ring running on across them.
  Else one block per grid point ("q_tiles", "heads", "batch").
  """
  (qo_smem, k_smem, v_smem, lse_smem, ids_smem), barriers = scratch
  (q_ready, k_ready, v_ready, k_consumed, v_consumed,
   schedule) = barriers
  block_q, block_kv = block_sizes.block_q, block_sizes.block_kv
  stages = block_sizes.num_stages
  head_dim = q_ref.shape[3]
  dtype = q_ref.dtype
  block_rows = COMPUTE_WARPGROUPS * block_q
  wg = lax.axis_index("wg")

  def block_at(position=None):
    return pipeline.query_block(
        mask, q_lengths_ref, kv_lengths_ref, q_seq=q_seq, kv_seq=kv_seq,
        block_rows=block_rows, block_kv=block_kv,
        ranges_ref=None if segments is None else segments.block_ranges,
        position=position)

  # With segments: the rows' ids (one row per consumer) and the ring of the
  # key tiles' ids, each loaded with its Q or K tile.
  q_ids, kv_ids = ((None, None) if segments is None else
                   ((segments.own_ids, ids_smem[0]),
                    (segments.streamed_ids, ids_smem[1])))

  def take_turn():
    plgpu.barrier_arrive(schedule)
    plgpu.barrier_wait(schedule)

  def over_items(run_block):
    """Persistent kernels: run_block(block, base) on each block of this
    program's items in turn, `base` the ring step of the block's first key
    tile (the ring runs on across blocks). One loop over the blocks, so
    that the block's code is emitted once (compile time)."""

    def one_block(j, base):
      position, valid = persistent.position(j)
      block = block_at(position)
      run = functools.partial(run_block, block, base)
      steps = block.steps_hi - block.steps_lo
      if valid is True:
        run()
        return base + steps
      pl.when(valid)(run)
      return base + jnp.where(valid, steps, 0)

    lax.fori_loop(0, persistent.num_blocks(), one_block, jnp.int32(0))

  def consume(block: pipeline.QueryBlock, base, first=True, last=True):
    """One block's rows of this consumer; the block's first key tile is
    step `base` of the ring (0 but in persistent kernels), `first` and
    `last`: whether it is the consumer's first and last block (bools, or
    traced in persistent kernels)."""
    (batch, head, _, block_start, q_len, kv_len, offset, steps_lo,
     steps_hi) = block
    slot_of = functools.partial(pipeline.slot_of, lo=steps_lo - base,
                                stages=stages)
    q_start = pipeline.row_group_start(block_start, wg, block_q)
    q_tile = qo_smem.at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_start, block_q), head],
                            q_tile, q_ready.at[wg])
    if q_ids is not None:
      pipeline.load_ids(q_ids, batch, q_start, block_q, wg, q_ready.at[wg])
    plgpu.barrier_wait(q_ready.at[wg])
    row_segments = (None if q_ids is None
                    else pipeline.ids_vector(q_ids[1].at[wg], 0))

    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    tile_shape = (block_q, block_kv)
    rows = q_start + plgpu.broadcasted_iota(jnp.int32, tile_shape, 0,
                                            layout=wgmma_layout)
    columns = plgpu.broadcasted_iota(jnp.int32, tile_shape, 1,
                                     layout=wgmma_layout)

    segment_tiles = functools.partial(
        pipeline.key_tile_segment_ids, row_segments,
        None if kv_ids is None else kv_ids[1], tile_shape=tile_shape)

    def step(kv_step, carry, *, kind: str):
      acc, row_max, row_sum = carry
      slot = slot_of(kv_step)
      plgpu.barrier_wait(k_ready.at[slot])
      if kind == "skip":
        # Outside this warpgroup's rows: keep the barriers' phases and the
        # ping-pong in step with the other consumer, compute nothing.
        plgpu.barrier_arrive(k_consumed.at[slot])
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_arrive(v_consumed.at[slot])
        take_turn()
        take_turn()
        return carry

      def scores(acc_ref):
        plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].T)
        take_turn()
        return acc_ref[...]

      s = pl.run_scoped(scores, plgpu.ACC(tile_shape, jnp.float32))
      plgpu.barrier_arrive(k_consumed.at[slot])

      # Base-2 logits; without a cap or mask the scale is applied to the
      # row max (one multiply per row) and fused into the exponent.
      if soft_cap is None and kind == "full":
        scale2 = scale * numerics.LOG2_E
        new_max = jnp.maximum(row_max, s.max(axis=1) * scale2)
        probs = jnp.exp2(s * scale2 - lax.broadcast_in_dim(
            new_max, tile_shape, [0]))
      else:
        logits, _ = numerics.logits_base2(s, scale=scale, soft_cap=soft_cap)
        if kind == "masked":
          seen = pipeline.key_tile_visible(
              mask, rows, columns, kv_step, block_kv, kv_len, offset,
              *segment_tiles(slot))
          logits = jnp.where(seen, logits, numerics.MASK_VALUE)
        new_max = jnp.maximum(row_max, logits.max(axis=1))
        probs = jnp.exp2(logits - lax.broadcast_in_dim(new_max, tile_shape,
                                                       [0]))
        if kind == "masked":
          # Exact zeros, also for rows that have seen no visible key yet
          # (their max is MASK_VALUE and the line above gives 1).
          probs = jnp.where(seen, probs, 0.0)
      correction = jnp.exp2(row_max - new_max)
      acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])
      row_sum = row_sum * correction + probs.sum(axis=1)
      probs = probs.astype(dtype)
      plgpu.barrier_arrive(schedule)  # This warpgroup's softmax is done.
      plgpu.barrier_wait(v_ready.at[slot])
      plgpu.barrier_wait(schedule)  # The other one has issued its QK^T.

      def accumulate(acc_ref):
        plgpu.wgmma(acc_ref, probs, v_smem.at[slot])

      acc = pl.run_state(accumulate)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(v_consumed.at[slot])
      return acc, new_max, row_sum

    # Row max and row sum: nothing seen yet; with a sink, one key of logit
    # `sink` that adds no value (max = sink, sum = 1; modifiers.py).
    start_max, start_sum = numerics.MASK_VALUE, 0.0
    if sinks_ref is not None:
      start_max, start_sum = sinks_ref[batch, head] * numerics.LOG2_E, 1.0
    carry = (
        plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32),
                          wgmma_layout),
        plgpu.layout_cast(jnp.full((block_q,), start_max, jnp.float32),
                          row_layout),
        plgpu.layout_cast(jnp.full((block_q,), start_sum, jnp.float32),
                          row_layout),
    )
    own = pipeline.key_tiles(
        mask, block, q_start, block_q, block_kv,
        None if segments is None else segments.group_ranges)
    # The second consumer starts one turn later: from then on the two
    # alternate between matrix products and softmax.
    pl.when(_and(wg == 1, first))(take_turn)
    for lo, hi, kind in pipeline.consumer_runs(own, steps_lo, steps_hi):
      carry = lax.fori_loop(lo, hi, functools.partial(step, kind=kind),
                            carry)
    pl.when(_and(wg == 0, last))(take_turn)
    acc, row_max, row_sum = carry

    # A row has a visible key iff its sum is positive (masked probabilities
    # are exact zeros); rows past q_len have none.
    row_ids = q_start + plgpu.broadcasted_iota(jnp.int32, (block_q,), 0,
                                               layout=row_layout)
    has_keys = jnp.logical_and(row_sum > 0.0, row_ids < q_len)
    safe_sum = jnp.where(has_keys, row_sum, 1.0)
    inverse = jnp.where(has_keys, 1.0 / safe_sum, 0.0)
    out = acc * lax.broadcast_in_dim(inverse, acc.shape, [0])
    lse = jnp.where(has_keys, row_max + jnp.log2(safe_sum), jnp.inf)
    q_tile[...] = out.astype(dtype)
    lse_smem.at[wg][...] = lse
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_tile,
                            out_ref.at[batch, pl.ds(q_start, block_q), head])
    plgpu.copy_smem_to_gmem(lse_smem.at[wg],
                            lse_ref.at[batch, head, pl.ds(q_start, block_q)])

  @pl.when(wg < COMPUTE_WARPGROUPS)
  def _consumer():
    plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
    if persistent is None:
      consume(block_at(), 0)
    else:
      def run_block(block, base):
        # The previous block's output stores must have read the Q/O and lse
        # tiles before they are reused.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        consume(block, base, first=False, last=False)

      # The ping-pong's offset (see consume) once for all blocks.
      pl.when(wg == 1)(take_turn)
      over_items(run_block)
      pl.when(wg == 0)(take_turn)
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == PRODUCER)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    def loader(block: pipeline.QueryBlock):
      return pipeline.key_value_loader(
          k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, batch=block.batch,
          kv_head=pipeline.kv_head_of(block.head, group), block_kv=block_kv,
          ids=kv_ids)

    if persistent is None:
      block = block_at()
      pipeline.produce(loader(block), block.steps_lo, block.steps_hi, stages,
                       (k_consumed, v_consumed))
      return
    over_items(lambda block, base: pipeline.produce_continuing(
        loader(block), block.steps_lo, block.steps_hi, base, stages,
        (k_consumed, v_consumed)))


def is_persistent(mask: MaskSpec) -> bool:
  """Whether the forward runs persistent (pipeline.PersistentGrid): when
  items handed out round-robin cost about the same (no window, lengths or
  segments; causal tiles go in pairs)."""
  return not (mask.window is not None or mask.has_lengths
              or mask.has_segments)


def _and(a, b):
  """a and b, for a traced bool `a` and a Python or traced bool `b`."""
  return a if b is True else jnp.logical_and(a, b)


def pad_rows(x, multiple: int):
  """x [B, L, ...] with L padded up to a multiple (zeros); x itself when
  L already is one."""
  extra = -x.shape[1] % multiple
  if not extra:
    return x
  return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))


def forward_call(query, key, value, q_lengths, kv_lengths, sinks=None,
                 segment_ids: pipeline.SegmentIds | None = None, *,
                 spec: CallSpec, block_sizes: MosaicBlockSizes,
                 persistent: bool | None = None):
  """Launches the forward kernel.

  Args:
    query: [B, T, N, H], H a multiple of 64.
    key, value: [B, S, K, H].
    q_lengths, kv_lengths: int32 [B], or None without lengths.
    sinks: float32 [B, N] natural-log sink logits, or None.
    segment_ids: with segments, the ids and filled lengths, else None.
    spec: the call.
    persistent: whether to launch a persistent kernel; None: where
      `is_persistent` allows (True there only, for comparisons).
    block_sizes: the tiles.

  Returns:
    (out [B, T, N, H] in query.dtype, lse2 float32 [B, N, T]).
  """
  batch, q_seq, num_heads, head_dim = query.shape
  kv_seq, num_kv_heads = key.shape[1:3]
  dtype = query.dtype
  query = pad_rows(query, SEQ_ALIGN)
  key, value = pad_rows(key, SEQ_ALIGN), pad_rows(value, SEQ_ALIGN)
  block_q, block_kv = block_sizes.block_q, block_sizes.block_kv
  stages = block_sizes.num_stages
  if q_lengths is None:
    q_lengths = kv_lengths = jnp.zeros((batch,), jnp.int32)  # Unread.
  transforms = smem_transforms(dtype)
  has_segments = segment_ids is not None
  # The segment ids come with Q and K: one more copy on their barriers.
  with_ids = 2 if has_segments else 1
  scratch = (
      (
          plgpu.SMEM((COMPUTE_WARPGROUPS, block_q, head_dim), dtype,
                     transforms=transforms),
          plgpu.SMEM((stages, block_kv, head_dim), dtype,
                     transforms=transforms),
          plgpu.SMEM((stages, block_kv, head_dim), dtype,
                     transforms=transforms),
          plgpu.SMEM((COMPUTE_WARPGROUPS, block_q), jnp.float32),
          ((plgpu.SMEM((COMPUTE_WARPGROUPS, block_q), jnp.int32),
            plgpu.SMEM((stages, block_kv), jnp.int32))
           if has_segments else ()),
      ),
      (
          plgpu.Barrier(num_arrivals=with_ids,
                        num_barriers=COMPUTE_WARPGROUPS),
          plgpu.Barrier(num_arrivals=with_ids, num_barriers=stages),
          plgpu.Barrier(num_barriers=stages),
          plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS,
                        num_barriers=stages),
          plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS,
                        num_barriers=stages),
          plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS),
      ),
  )
  num_tiles = pl.cdiv(q_seq, COMPUTE_WARPGROUPS * block_q)
  if persistent and not is_persistent(spec.mask):
    raise ValueError(f"persistent=True needs a mask without window, lengths "
                     f"or segments; got {spec.mask}.")
  if persistent is None:
    persistent = is_persistent(spec.mask)
  persistent = (pipeline.PersistentGrid.over(num_tiles, num_heads, batch,
                                             pairs=spec.mask.is_causal)
                if persistent else None)
  kernel = functools.partial(
      forward_kernel, mask=spec.mask, scale=spec.scale,
      soft_cap=spec.logits_soft_cap, block_sizes=block_sizes,
      group=num_heads // num_kv_heads, q_seq=q_seq, kv_seq=kv_seq,
      persistent=persistent)
  segments = None
  if has_segments:
    segments = pipeline.segment_inputs(
        segment_ids, queries_own=True,
        block_rows=COMPUTE_WARPGROUPS * block_q, group_rows=block_q,
        streamed_rows=block_kv)

  def with_optional_inputs(q_ref, k_ref, v_ref, q_len_ref, kv_len_ref,
                           *refs):
    *optional, out_ref, lse_ref, scoped = refs
    sinks_ref, segment_refs = pipeline.split_optional(
        optional, sinks is not None, has_segments)
    kernel(q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, sinks_ref,
           segment_refs, out_ref, lse_ref, scoped)

  # The lse rows of the last tile are stored by a 1-D copy, which TMA
  # bounds by the whole array, not per row: past T they would land on the
  # next head's rows. Its array is padded to whole tiles instead.
  lse_seq = num_tiles * COMPUTE_WARPGROUPS * block_q
  out, lse2 = pipeline.launch(
      with_optional_inputs, scratch,
      out_type=(sharding.output_struct(query.shape, dtype, query, key),
                sharding.output_struct((batch, num_heads, lse_seq),
                                       jnp.float32, query, key)),
      **(pipeline.tile_grid(num_tiles, num_heads, batch,
                            tile_axis="q_tiles", mask=spec.mask,
                            streamed_bytes=2 * key.size * key.dtype.itemsize)
         if persistent is None
         else dict(grid=(persistent.programs,), grid_names=("programs",))),
      num_threads=COMPUTE_WARPGROUPS + 1,
      args=(query, key, value, q_lengths, kv_lengths,
            *([] if sinks is None else [sinks.astype(jnp.float32)]),
            *([] if segments is None else segments)))
  if out.shape[1] != q_seq:
    out = out[:, :q_seq]
  if lse_seq != q_seq:
    lse2 = lse2[..., :q_seq]
  return out, lse2
