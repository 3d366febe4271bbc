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
- Ping-pong: the two consumers take turns, so that one's softmax overlaps
  the other's matrix products (the tensor cores are never idle while a
  warpgroup computes exponentials). Two hardware named barriers, one per
  consumer, carry the turns one way (`PingPong`): a consumer signals
  without waiting once it has issued its Q K^T, and waits only before its
  P V, until the other has issued its own Q K^T (causal calls at head dim
  256 keep a two-arrival mbarrier rendezvous: `named_ping_pong`).
- The output goes back through the Q slot of shared memory (or output
  tiles of its own, see below) and a TMA store; the lse (base 2, float32,
  `numerics.py`) through its own small slot.

Persistent launch (`is_persistent`: calls without window, lengths or
segments; by default all of them but FP8 causal calls at head dim 256,
`runs_persistent`): one program per SM instead of one block per (query
tile, head, batch); each program works through its items
(`pipeline.PersistentGrid`: round-robin, query tiles fastest so that
programs in flight share a head's K and V in L2; causal tiles in pairs t,
n-1-t of equal total work) while the producer's ring runs on from one
block into the next, so a block's Q load and output stores overlap the
next block's K/V loads instead of costing a launch (H100: +12-60% at 2048
keys, a few % at 8k-32k). Where
shared memory has room for output tiles apart from the Q tiles (head dims
<= 128 at the default tiles, and FP8), a consumer may issue its next
block's Q load as soon as its last Q K^T is done, under this block's
epilogue (`Q_PREFETCH`: +4-9% at 1024-2048 tokens, +1.5-2% at 8192).

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

FP8 (float8_e4m3fn q, k, v; `Fp8Scales`): the same kernel with 8-bit
operands, FlashAttention-3's FP8 forward. Q K^T is an e4m3 wgmma with both
operands in shared memory; P is cast to e4m3 in registers and fed to the
second wgmma from there. 8-bit wgmma operands cannot be transposed, so both
shared-memory operands must have the contracted axis fastest: V comes
transposed, [B, K, H, S'] (keys fastest; `fp8_value_layout`, one XLA pass
per call). The accumulator's register layout (two adjacent columns per
thread per 8 columns) is not the 8-bit operand's (four per 16): the cast P
keeps its registers and is read as if in the 8-bit layout
(`relabel_for_8bit_operand`), which permutes keys within each group of 16;
V's keys are permuted the same way when it is transposed, so the product is
exact. Numerics: P = exp2(logit - max + FP8_P_SHIFT) lies in [0, 256], in
e4m3's normal range (the shift cancels in the row sum, taken from the
unrounded P); the q and k descales fold into the logit scale, the v descale
into the final 1 / row sum. The output is out_ref's dtype (bfloat16).

Outputs: O in the input dtype and lse2 float32 [B, N, T], as the Triton
forward (a row that sees no key: O = 0, lse2 = +inf; with attention sinks
the lse includes the sink, and such a row before q_len gets lse2 = its
sink).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

from jflash._src import numerics
from jflash._src import sharding
from jflash._src.backends.mosaic import pipeline
from jflash._src.backends.mosaic.config import MosaicBlockSizes
from jflash._src.spec import CallSpec
from jflash._src.spec import MaskSpec
from jflash._src.spec import Operands

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
# FP8: exp2 of the logits minus the row max plus this lies in [1, 256] at
# the max, so P rounds to e4m3 (max 448, normal from 2^-6) with its full
# 3-bit mantissa over 14 binades below the max instead of 6; it cancels in
# out = P V / sum(P) (FlashAttention-3's offset). On normal inputs with
# outliers it cut the error from 0.011 to 0.008 (../shared/FP8.md).
FP8_P_SHIFT = 8.0
# FP8: V's keys are stored in groups of this many, permuted (see
# `fp8_value_layout`).
FP8_KEY_GROUP = 16
# FP8: an optimization barrier on the softmax's results before the
# ping-pong's arrival (benchmarks/fp8.py sweep compares both settings).
FP8_SOFTMAX_BARRIER = True
# Each step waits for the next step's K tile while its P V product runs
# (as tokamax's and JAX's Mosaic attention do) instead of after it, at the
# start of the next step: "auto" (`waits_for_k_under_pv`), True or False (a
# module switch for A/B runs: benchmarks/sweep_mosaic.py --ab k_wait,
# benchmarks/fp8.py k_wait_ab). H100, interleaved rounds in the balanced
# order (RECORD 2026-11-26, "the balanced order checked" and "FP8 defaults
# from fixed-order A/Bs, re-timed"): 16-bit D=64 +3.6% at 2x4096 (+2.5-3.6%
# in every order), level at 1x16384, -3% causal; FP8 D=128 -0.6% and -1.8%
# (its +5.3-5.7% in fixed-order runs was the order's doing), FP8 D=64
# -1.7%, D=256 -0.5%, D=128 causal -5%; 16-bit D=128 -4 to -5% and D=256
# -2% (fixed order). The (8-bit operands, head dim, causal) it is on for:
K_WAIT_UNDER_PV = "auto"
K_WAIT_UNDER_PV_CALLS = frozenset({(False, 64, False)})
# 16-bit: an optimization barrier on the softmax's results (accumulator,
# max, sum, P) before the ping-pong's wait, as the FP8 path has
# (FP8_SOFTMAX_BARRIER) and tokamax's forward at head dims <= 128. Off: at
# D=64/128 within -1.4..+0.6%, at D=256 +2.1%, +2.4%, then -0.5% (-1.9%
# causal) in three runs (H100, RECORD 2026-11-26, "two orderings from
# tokamax's Mosaic forward" and the check after it). A module switch for
# A/B runs (benchmarks/sweep_mosaic.py --ab softmax_barrier), read when a
# call is traced.
SOFTMAX_BARRIER_16BIT = False
# The ping-pong's named barriers (PTX `bar`), one per consumer: ids 0 to 3
# are Mosaic GPU's (0: the block, 1 + w: warpgroup w's own barrier).
PING_PONG_BARRIER_IDS = (4, 5)
# The ping-pong's barriers: "named" (`PingPong`), "mbarrier" (a two-arrival
# mbarrier that both consumers arrive on and wait for: a rendezvous, the
# earlier scheme) or "auto" (`named_ping_pong`). A module switch for A/B
# runs (benchmarks/sweep_mosaic.py --ab ping_pong).
PING_PONG = "auto"
# Persistent 16-bit kernels: output tiles of their own where shared memory
# has room (`MosaicBlockSizes.fits_output_tiles`: head dims <= 128 at the
# default tiles), so that a consumer loads its next block's Q during this
# block's epilogue instead of after it (H100: +0.6-8.8% forward, RECORD.md
# 2026-11-25, "Q prefetch"; benchmarks/sweep_mosaic.py --ab q_prefetch).
# On since its check at size passed on an H100 (tests/attention_test.py
# MosaicPersistentAtSizeTest, several blocks per program: the same bits as
# without it; RECORD 2026-11-25, "The Q prefetch's check at size"). A module
# switch for A/B runs.
Q_PREFETCH = True
# The FP8 forward (output tiles of its own anyway) prefetches at these head
# dims: all of them. H100, 16k tokens, default FP8 tiles, 12 interleaved
# rounds in the balanced order (`benchmarks/fp8.py prefetch_ab`, RECORD
# 2026-11-26, "FP8 defaults from fixed-order A/Bs, re-timed"): on / off
# 1.036 at D=64, 1.021 at D=128, 1.014 at D=256, 1.012 at D=128 causal;
# with the K wait's change, +3.9-5.0% at 2-4k keys ("the FP8 defaults
# changed"). A fixed-order A/B ("After the decode and Q-prefetch changes")
# had put it behind at 128 and 256: it timed the prefetch right after
# cuDNN in every round. A table for A/B runs (fp8.py prefetch_ab patches
# it).
FP8_Q_PREFETCH_HEAD_DIMS = (64, 128, 256)


def waits_for_k_under_pv(fp8: bool, head_dim: int, causal: bool) -> bool:
  """Whether a forward step waits for the next K tile under its P V
  (K_WAIT_UNDER_PV)."""
  if K_WAIT_UNDER_PV != "auto":
    return bool(K_WAIT_UNDER_PV)
  return (fp8, head_dim, causal) in K_WAIT_UNDER_PV_CALLS


def q_prefetch(fp8: bool, head_dim: int) -> bool:
  """Whether a persistent forward with output tiles prefetches Q."""
  return Q_PREFETCH and (not fp8 or head_dim in FP8_Q_PREFETCH_HEAD_DIMS)


def named_ping_pong(mask: MaskSpec, head_dim: int) -> bool:
  """Whether the forward's ping-pong uses named barriers (PING_PONG "auto":
  all but causal calls at head dim 256). H100, named / mbarrier forward
  (RECORD.md 2026-11-25, "named-barrier ping-pong"): D=64 +10-13%, D=128
  +0.5-5%, D=256 +2-5% without a causal mask but -5% causal at 1 x 8192
  (twice; +1% at 2 x 4096)."""
  if PING_PONG != "auto":
    return PING_PONG == "named"
  return not (mask.is_causal and head_dim > 128)


def smem_transforms(dtype, columns: int | None = None) -> tuple:
  """Tiling and swizzle of a [rows, columns] tile in shared memory (the
  layout wgmma reads without bank conflicts): 128-byte swizzle, or the
  row's width in bytes when narrower (8-bit tiles of 64 columns).
  `columns`: the tile's width (None: wide enough for 128 bytes)."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = 128 if columns is None else min(128, columns * itemsize)
  columns = swizzle // itemsize
  return (plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(swizzle))


def _named_barrier(operation: str, barrier_id, num_threads: int):
  """PTX `bar.<operation> barrier_id, num_threads` for the warpgroup (the
  id an int32 that may differ between warpgroups)."""

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
  def emit(_, barrier):
    mgpu_utils.inline_ptx(f"bar.{operation} $0, {num_threads};",
                          barrier.registers[()], has_side_effects=True,
                          convergent=True)

  emit(barrier_id)


@dataclasses.dataclass(frozen=True)
class PingPong:
  """The consumers' turns: `signal` once this consumer has issued its Q K^T
  (the other may then multiply P V), `wait` before its own P V until the
  other has issued its Q K^T. Consumer 1 waits once before its first turn
  and consumer 0 signals once after its last (`start`, `finish`), so that
  the two alternate: ... QK_j(0), PV_j(1), QK_j+1(1) ... with one's softmax
  under the other's matrix products.

  Named barriers: consumer w waits on barrier ids[w] and signals on
  ids[1 - w]; a barrier completes when both warpgroups (2 x 128 threads)
  have arrived, the waiting one included. A consumer never signals twice
  before the other has waited (its next signal follows its own wait, which
  needs the other's signal, which follows the other's wait), which named
  barriers (no phases) need.
  Without `named` (the earlier scheme): one two-arrival mbarrier that
  `signal` and `wait` both arrive on and wait for, a rendezvous.
  """

  wg: Any
  schedule: Any
  named: bool

  def _bar(self, operation: str, own: bool):
    first, second = PING_PONG_BARRIER_IDS
    barrier_id = jnp.where((self.wg == 0) == own, first, second)
    _named_barrier(operation, barrier_id.astype(jnp.int32),
                   COMPUTE_WARPGROUPS * 128)

  def _rendezvous(self):
    plgpu.barrier_arrive(self.schedule)
    plgpu.barrier_wait(self.schedule)

  def signal(self):
    if self.named:
      self._bar("arrive", own=False)
    else:
      self._rendezvous()

  def wait(self):
    if self.named:
      self._bar("sync", own=True)
    else:
      self._rendezvous()

  def start(self, when=True):
    """Consumer 1's first wait (`when`: whether this is its first block)."""
    pl.when(_and(self.wg == 1, when))(self.wait)

  def finish(self, when=True):
    """Consumer 0's last signal (`when`: whether this is its last block)."""
    pl.when(_and(self.wg == 0, when))(self.signal)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardScratch:
  """The forward kernel's shared memory and barriers: types on the host
  (`forward_scratch`), refs in the kernel. The fields are in allocation
  order (the order of the refs in the kernel's jaxpr).

  Attributes:
    qo: [2, block_q, H]: each consumer's Q tile, then its output tile.
    k, v: the K and V rings, [stages, block_kv, H].
    lse: float32 [2, block_q]: each consumer's lse, for its store.
    q_ids: with segments, int32 [2, block_q]: each consumer's rows' ids;
      else None.
    kv_ids: with segments, int32 [stages, block_kv]: the ring of the key
      tiles' ids; else None.
    q_ready: per consumer: its Q tile (and ids) loaded.
    k_ready, v_ready: per slot: its K tile (and ids), its V tile loaded.
    k_consumed, v_consumed: per slot: both consumers are done with its K,
      its V.
    schedule: the ping-pong's mbarrier (two arrivals) where it does not
      use named barriers (`PingPong`).
    out: [2, block_q, H] in the output dtype, each consumer's output tile:
      FP8, and persistent 16-bit calls with room for them (the Q prefetch,
      `Q_PREFETCH`); else None and the output goes through `qo`.
  """

  qo: Any
  k: Any
  v: Any
  lse: Any
  q_ids: Any
  kv_ids: Any
  q_ready: Any
  k_ready: Any
  v_ready: Any
  k_consumed: Any
  v_consumed: Any
  schedule: Any
  out: Any = None


def forward_scratch(dtype, head_dim: int, block_sizes: MosaicBlockSizes, *,
                    has_segments: bool, out_dtype=None) -> ForwardScratch:
  """The `ForwardScratch` types of a launch. `out_dtype`: output tiles of
  their own in that dtype (FP8 inputs always, 16-bit ones for the
  persistent kernel's Q prefetch), else None. 8-bit inputs have V
  transposed: [stages, H, block_kv]."""
  block_q, block_kv = block_sizes.block_q, block_sizes.block_kv
  stages = block_sizes.num_stages
  fp8 = jnp.dtype(dtype).itemsize == 1
  transforms = smem_transforms(dtype, head_dim if fp8 else None)
  # The segment ids come with Q and K: one more copy on their barriers.
  with_ids = 2 if has_segments else 1
  return ForwardScratch(
      qo=plgpu.SMEM((COMPUTE_WARPGROUPS, block_q, head_dim), dtype,
                    transforms=transforms),
      k=plgpu.SMEM((stages, block_kv, head_dim), dtype,
                   transforms=transforms),
      v=(plgpu.SMEM((stages, head_dim, block_kv), dtype,
                    transforms=smem_transforms(dtype, block_kv)) if fp8
         else plgpu.SMEM((stages, block_kv, head_dim), dtype,
                         transforms=transforms)),
      lse=plgpu.SMEM((COMPUTE_WARPGROUPS, block_q), jnp.float32),
      q_ids=(plgpu.SMEM((COMPUTE_WARPGROUPS, block_q), jnp.int32)
             if has_segments else None),
      kv_ids=(plgpu.SMEM((stages, block_kv), jnp.int32)
              if has_segments else None),
      q_ready=plgpu.Barrier(num_arrivals=with_ids,
                            num_barriers=COMPUTE_WARPGROUPS),
      k_ready=plgpu.Barrier(num_arrivals=with_ids, num_barriers=stages),
      v_ready=plgpu.Barrier(num_barriers=stages),
      k_consumed=plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS,
                               num_barriers=stages),
      v_consumed=plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS,
                               num_barriers=stages),
      schedule=plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS),
      out=(plgpu.SMEM((COMPUTE_WARPGROUPS, block_q, head_dim), out_dtype,
                      transforms=smem_transforms(out_dtype))
           if out_dtype is not None else None),
  )


def forward_kernel(refs: pipeline.KernelInputs, out_ref, lse_ref,
                   scratch: ForwardScratch, *, mask: MaskSpec, scale: float,
                   soft_cap: float | None, block_sizes: MosaicBlockSizes,
                   group: int, q_seq: int, kv_seq: int,
                   persistent: pipeline.PersistentGrid | None = None,
                   prefetch_q: bool = False):
  """The kernel.

  Args:
    refs: q, k, v, q_lengths, kv_lengths, and sinks and segments where the
      call has them; FP8: v is transposed ([B, K, H, S'], see
      `fp8_value_layout`) and `fp8_scales` float32 [B, K, 2] holds each
      (batch, kv head)'s logit scale (natural units, descales folded in)
      and v descale.
    out_ref, lse_ref: the outputs, [B, T', N, H] and float32 [B, N, T''].
    scratch: the block's shared memory and barriers.
    persistent: a persistent launch (grid axis "programs"; calls whose key
      tiles do not depend on the block, see `forward_call`): each program
      computes its items one after the other, the ring running on across
      them. Else one block per grid point ("q_tiles", "heads", "batch").
    prefetch_q: persistent kernels with output tiles (`scratch.out`): each
      consumer issues its next block's Q load under this block's epilogue
      (`q_prefetch`).
  """
  block_q, block_kv = block_sizes.block_q, block_sizes.block_kv
  stages = block_sizes.num_stages
  head_dim = refs.q.shape[3]
  dtype = refs.q.dtype
  fp8 = refs.fp8_scales is not None
  block_rows = COMPUTE_WARPGROUPS * block_q
  wg = lax.axis_index("wg")
  segments = refs.segments

  def block_at(position=None):
    return pipeline.query_block(
        mask, refs.q_lengths, refs.kv_lengths, q_seq=q_seq, kv_seq=kv_seq,
        block_rows=block_rows, block_kv=block_kv,
        ranges_ref=None if segments is None else segments.block_ranges,
        position=position)

  # With segments: the rows' ids (one row per consumer) and the ring of the
  # key tiles' ids, each loaded with its Q or K tile.
  q_ids, kv_ids = pipeline.segment_sources(segments, scratch.q_ids,
                                           scratch.kv_ids)

  turns = PingPong(wg, scratch.schedule, named_ping_pong(mask, head_dim))

  def over_items(run_block, *, with_next: bool = False):
    """Persistent kernels: run_block(block, base) on each block of this
    program's items in turn, `base` the ring step of the block's first key
    tile (the ring runs on across blocks). One loop over the blocks, so
    that the block's code is emitted once (compile time).

    With `with_next` (the consumers' Q prefetch): run_block(block, base,
    q_issued, next_block, next_valid), `q_issued` whether the previous
    block issued this one's Q load (a traced bool, False for the first
    block), next_block the program's next block and next_valid whether
    there is one to run; the loop carries next_valid as the next block's
    q_issued (a block that does not run issues nothing)."""
    num_blocks = persistent.num_blocks()

    def one_block(j, carry):
      base, q_issued = carry
      position, valid = persistent.position(j)
      block = block_at(position)
      steps = block.steps_hi - block.steps_lo
      if with_next:
        next_position, next_valid = persistent.position(j + 1)
        next_valid = jnp.logical_and(j + 1 < num_blocks, next_valid)
        run = functools.partial(run_block, block, base, q_issued,
                                block_at(next_position), next_valid)
        q_issued = jnp.where(valid, next_valid, q_issued)
      else:
        run = functools.partial(run_block, block, base)
      if valid is True:
        run()
        return base + steps, q_issued
      pl.when(valid)(run)
      return base + jnp.where(valid, steps, 0), q_issued

    lax.fori_loop(0, num_blocks, one_block, (jnp.int32(0), jnp.bool_(False)))

  q_ready = scratch.q_ready.at[wg]
  q_tile = scratch.qo.at[wg]

  def load_q(block: pipeline.QueryBlock):
    """Issues the copy of this consumer's Q rows of `block` (and their
    ids), which completes q_ready."""
    q_start = pipeline.row_group_start(block.start, wg, block_q)
    plgpu.copy_gmem_to_smem(
        refs.q.at[block.batch, pl.ds(q_start, block_q), block.head], q_tile,
        q_ready)
    if q_ids is not None:
      pipeline.load_ids(q_ids, block.batch, q_start, block_q, wg, q_ready)

  def consume(block: pipeline.QueryBlock, base, first=True, last=True,
              q_issued=False, next_block=None, next_valid=None):
    """One block's rows of this consumer; the block's first key tile is
    step `base` of the ring (0 but in persistent kernels), `first` and
    `last`: whether it is the consumer's first and last block (bools, or
    traced in persistent kernels). `q_issued`: whether the block's Q load
    was issued already (traced, Q prefetch); with `next_block`, the
    consumer issues that block's Q load where `next_valid` once its last
    Q K^T is done (the output then goes through `scratch.out`)."""
    batch, head = block.batch, block.head
    slot_of = functools.partial(pipeline.slot_of, lo=block.steps_lo - base,
                                stages=stages)
    q_start = pipeline.row_group_start(block.start, wg, block_q)
    # The logit scale (natural units) and the factor of the output: with
    # FP8, per (batch, kv head), the descales folded in.
    logit_scale, out_scale, p_shift = scale, None, 0.0
    if fp8:
      kv_head = pipeline.kv_head_of(head, group)
      logit_scale = refs.fp8_scales[batch, kv_head, 0]
      out_scale = refs.fp8_scales[batch, kv_head, 1]
      p_shift = FP8_P_SHIFT
    if q_issued is False:
      load_q(block)
    else:
      pl.when(jnp.logical_not(q_issued))(lambda: load_q(block))
    plgpu.barrier_wait(q_ready)
    row_segments = (None if q_ids is None
                    else pipeline.ids_vector(q_ids[1].at[wg], 0))

    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    tile_shape = (block_q, block_kv)
    k_wait_under_pv = waits_for_k_under_pv(fp8, head_dim, mask.is_causal)

    segment_tiles = functools.partial(
        pipeline.key_tile_segment_ids, row_segments,
        None if kv_ids is None else kv_ids[1], tile_shape=tile_shape)

    def wait_next_k(kv_step):
      """With the K wait under P V (`waits_for_k_under_pv`): the wait for
      step kv_step + 1's K tile, if the block has that step (the block's
      first step waits for its own; every later one relies on this)."""
      pl.when(kv_step + 1 < block.steps_hi)(
          lambda: plgpu.barrier_wait(scratch.k_ready.at[slot_of(kv_step + 1)]))

    def step(kv_step, carry, *, kind: str):
      acc, row_max, row_sum = carry
      slot = slot_of(kv_step)
      if k_wait_under_pv:
        pl.when(kv_step == block.steps_lo)(
            lambda: plgpu.barrier_wait(scratch.k_ready.at[slot]))
      else:
        plgpu.barrier_wait(scratch.k_ready.at[slot])
      if kind == "skip":
        # Outside this warpgroup's rows: keep the barriers' phases and the
        # ping-pong in step with the other consumer, compute nothing.
        plgpu.barrier_arrive(scratch.k_consumed.at[slot])
        plgpu.barrier_wait(scratch.v_ready.at[slot])
        plgpu.barrier_arrive(scratch.v_consumed.at[slot])
        turns.signal()
        turns.wait()
        if k_wait_under_pv:
          wait_next_k(kv_step)
        return carry

      def scores(acc_ref):
        plgpu.wgmma(acc_ref, q_tile, scratch.k.at[slot].T)
        turns.signal()
        return acc_ref[...]

      s = pl.run_scoped(scores, plgpu.ACC(tile_shape, jnp.float32))
      plgpu.barrier_arrive(scratch.k_consumed.at[slot])

      # Base-2 logits; without a cap or mask the scale is applied to the
      # row max (one multiply per row) and fused into the exponent.
      # With FP8, the probabilities are exp2(logit - max + p_shift) (see
      # FP8_P_SHIFT); row_sum is in the same units.
      if soft_cap is None and kind == "full":
        scale2 = logit_scale * numerics.LOG2_E
        new_max = jnp.maximum(row_max, s.max(axis=1) * scale2)
        probs = jnp.exp2(s * scale2 - lax.broadcast_in_dim(
            _minus(new_max, p_shift), tile_shape, [0]))
      else:
        logits, _ = numerics.logits_base2(s, scale=logit_scale,
                                          soft_cap=soft_cap)
        if kind == "masked":
          # The tile's positions, built here rather than once per block:
          # live across the unmasked loops they cost ~3% causal (H100,
          # RECORD.md 2026-11-25, "named-barrier ping-pong").
          rows = q_start + plgpu.broadcasted_iota(
              jnp.int32, tile_shape, 0, layout=wgmma_layout)
          columns = plgpu.broadcasted_iota(jnp.int32, tile_shape, 1,
                                           layout=wgmma_layout)
          seen = pipeline.key_tile_visible(
              mask, rows, columns, kv_step, block_kv, block.kv_len,
              block.offset, *segment_tiles(slot))
          logits = jnp.where(seen, logits, numerics.MASK_VALUE)
        new_max = jnp.maximum(row_max, logits.max(axis=1))
        probs = jnp.exp2(logits - lax.broadcast_in_dim(
            _minus(new_max, p_shift), tile_shape, [0]))
        if kind == "masked":
          # Exact zeros, also for rows that have seen no visible key yet
          # (their max is MASK_VALUE and the line above gives 1).
          probs = jnp.where(seen, probs, 0.0)
      correction = jnp.exp2(row_max - new_max)
      acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])
      row_sum = row_sum * correction + probs.sum(axis=1)
      probs = probs.astype(dtype)
      if fp8:
        # P's registers read as the 8-bit operand layout: keys permuted
        # within groups of 16, as V's are (fp8_value_layout). The barrier
        # keeps the relabelled registers from being moved across the
        # ping-pong below.
        probs = relabel_for_8bit_operand(probs)
        if FP8_SOFTMAX_BARRIER:
          acc, new_max, row_sum, probs = lax.optimization_barrier(
              (acc, new_max, row_sum, probs))
      elif SOFTMAX_BARRIER_16BIT:
        acc, new_max, row_sum, probs = lax.optimization_barrier(
            (acc, new_max, row_sum, probs))
      plgpu.barrier_wait(scratch.v_ready.at[slot])
      # Until the other consumer has issued its Q K^T.
      turns.wait()

      def accumulate(acc_ref):
        # FP8: V's tile is [H, block_kv], keys (the contracted axis)
        # fastest, as 8-bit operands must be.
        value = scratch.v.at[slot]
        plgpu.wgmma(acc_ref, probs, value.T if fp8 else value)
        if k_wait_under_pv:
          wait_next_k(kv_step)

      acc = pl.run_state(accumulate)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(scratch.v_consumed.at[slot])
      return acc, new_max, row_sum

    # Row max and row sum: nothing seen yet; with a sink, one key of logit
    # `sink` that adds no value (max = sink, sum = 1; modifiers.py).
    start_max, start_sum = numerics.MASK_VALUE, 0.0
    if refs.sinks is not None:
      start_max = refs.sinks[batch, head] * numerics.LOG2_E
      start_sum = 2.0**p_shift
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
    turns.start(when=first)
    for lo, hi, kind in pipeline.consumer_runs(own, block.steps_lo,
                                               block.steps_hi):
      carry = lax.fori_loop(lo, hi, functools.partial(step, kind=kind),
                            carry)
    turns.finish(when=last)
    acc, row_max, row_sum = carry
    if next_block is not None:
      # The last Q K^T has read the Q tile: the next block's Q loads under
      # this block's epilogue (and under the other consumer's last P V).
      pl.when(next_valid)(lambda: load_q(next_block))

    # A row has a visible key iff its sum is positive (masked probabilities
    # are exact zeros); rows past q_len have none.
    row_ids = q_start + plgpu.broadcasted_iota(jnp.int32, (block_q,), 0,
                                               layout=row_layout)
    has_keys = jnp.logical_and(row_sum > 0.0, row_ids < block.q_len)
    safe_sum = jnp.where(has_keys, row_sum, 1.0)
    inverse = jnp.where(
        has_keys, (1.0 if out_scale is None else out_scale) / safe_sum, 0.0)
    out = acc * lax.broadcast_in_dim(inverse, acc.shape, [0])
    lse = jnp.where(has_keys,
                    _minus(row_max + jnp.log2(safe_sum), p_shift), jnp.inf)
    out_tile = q_tile if scratch.out is None else scratch.out.at[wg]
    out_tile[...] = out.astype(out_ref.dtype)
    scratch.lse.at[wg][...] = lse
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_tile,
                            out_ref.at[batch, pl.ds(q_start, block_q), head])
    plgpu.copy_smem_to_gmem(scratch.lse.at[wg],
                            lse_ref.at[batch, head, pl.ds(q_start, block_q)])

  @pl.when(wg < COMPUTE_WARPGROUPS)
  def _consumer():
    plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
    if persistent is None:
      consume(block_at(), 0)
    else:
      def run_block(block, base, *next_args):
        # The previous block's output stores must have read the output
        # (without prefetch: Q/O) and lse tiles before they are reused.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        consume(block, base, False, False, *next_args)

      # The ping-pong's offset (see consume) once for all blocks.
      turns.start()
      over_items(run_block, with_next=prefetch_q)
      turns.finish()
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == PRODUCER)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    def loader(block: pipeline.QueryBlock):
      return pipeline.key_value_loader(
          refs.k, refs.v, scratch.k, scratch.v, scratch.k_ready,
          scratch.v_ready, batch=block.batch,
          kv_head=pipeline.kv_head_of(block.head, group), block_kv=block_kv,
          ids=kv_ids, values_transposed=fp8)

    consumed = (scratch.k_consumed, scratch.v_consumed)

    if persistent is None:
      block = block_at()
      pipeline.produce(loader(block), block.steps_lo, block.steps_hi, stages,
                       consumed)
      return
    over_items(lambda block, base: pipeline.produce_continuing(
        loader(block), block.steps_lo, block.steps_hi, base, stages,
        consumed))


def is_persistent(mask: MaskSpec) -> bool:
  """Whether the forward runs persistent (pipeline.PersistentGrid): when
  items handed out round-robin cost about the same (no window, lengths or
  segments; causal tiles go in pairs)."""
  return not (mask.window is not None or mask.has_lengths
              or mask.has_segments)


# FP8 causal calls from this head dim launch one block per tile rather
# than the persistent kernel: H100, D=256, B x N = 16k tokens, 16 heads,
# interleaved rounds, outputs bitwise equal: +8.1% at 2048 keys, +8.2% at
# 4096, +6.3% at 8192, +4.4-6.5% at 16384 (three runs; RECORD 2026-11-26,
# "FP8 causal D=256, persistent or grid, by length"). Non-causal D=256
# +0.8-1.6% (noise), D=64 -5.5%: persistent there.
FP8_CAUSAL_GRID_MIN_HEAD_DIM = 256


def runs_persistent(spec: CallSpec) -> bool:
  """Whether a call's forward runs the persistent kernel by default: where
  `is_persistent` allows it, but for FP8 causal calls from head dim
  FP8_CAUSAL_GRID_MIN_HEAD_DIM."""
  if (spec.is_fp8 and spec.mask.is_causal
      and spec.head_dim >= FP8_CAUSAL_GRID_MIN_HEAD_DIM):
    return False
  return is_persistent(spec.mask)


def _minus(x, shift: float):
  """x - shift; x itself for a shift of 0 (16-bit inputs: no extra op)."""
  return x - shift if shift else x


def relabel_for_8bit_operand(probs):
  """FP8 probabilities [block_q, block_kv] in the accumulator's register
  layout, read without moving data as the 8-bit wgmma operand layout.

  Per group of 16 columns, a thread holds columns 2c, 2c+1 and 8+2c,
  8+2c+1 (c = lane % 4) in the accumulator's layout (Layout.WGMMA: a pair
  per 8 columns) and columns 4c..4c+3 in the 8-bit operand's
  (Layout.WGMMA_8BIT: four per 16), rows alike. Joining its two pairs into
  one vector of four therefore puts key 8a + 2c + b (a, b in {0, 1}) at
  operand column 4c + 2a + b: a permutation of the keys within each group
  of 16 that `fp8_value_layout` applies to V's keys too, so that P V is
  unchanged (the contraction's order is free). Mosaic has no such
  conversion (`layout_cast` refuses it): this is written against its
  fragmented arrays.
  """
  layout_8bit = plgpu.Layout.WGMMA_8BIT

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=plgpu.ShapeDtypeStruct(probs.shape, probs.dtype,
                                         layout_8bit))
  def relabel(ctx, array):
    del ctx
    target = mgpu.WGMMA_LAYOUT_8BIT
    registers = np.empty(target.registers_shape(array.shape), dtype=object)
    for index in np.ndindex(registers.shape):
      # Register (.., j, ..) of the 8-bit layout: the accumulator's pairs
      # of its 8-column tiles 2j and 2j + 1.
      pairs = [array.registers[(index[0], 2 * index[1] + half, *index[2:])]
               for half in (0, 1)]
      registers[index] = mgpu_utils.vector_concat(pairs)
    return mgpu.FragmentedArray(_registers=registers, _layout=target,
                                _is_signed=None)

  return relabel(probs)


def fp8_value_layout(value, block_kv: int):
  """FP8 V [B, S, K, H] as the kernel reads it: [B, K, H, S'] (S' = S
  padded with zeros to a multiple of block_kv, which TMA's tiling of the
  keys axis needs), the keys of each group of 16 permuted as
  `relabel_for_8bit_operand` permutes P's: key 8a + 2c + b of a group at
  position 4c + 2a + b. One XLA transpose; a caller storing its cache this
  way would skip it."""
  batch, kv_seq, num_kv_heads, head_dim = value.shape
  value = pad_rows(value, block_kv)
  groups = value.shape[1] // FP8_KEY_GROUP
  value = value.reshape(batch, groups, 2, 4, 2, num_kv_heads, head_dim)
  # (batch, group, a, c, b, kv head, H) -> (batch, kv head, H, group, c, a,
  # b).
  value = value.transpose(0, 5, 6, 1, 3, 2, 4)
  del kv_seq
  return value.reshape(batch, num_kv_heads, head_dim, groups * FP8_KEY_GROUP)


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


def forward_call(operands: Operands, *, spec: CallSpec,
                 block_sizes: MosaicBlockSizes,
                 persistent: bool | None = None):
  """Launches the forward kernel.

  Args:
    operands: the call's arrays: query [B, T, N, H], H a multiple of 64;
      key and value [B, S, K, H]; the lengths, segment ids and sinks
      (float32 [B, N] natural-log sink logits) where `spec` has them; for
      float8_e4m3fn q, k, v their descales (float32 [B, K] each; a real
      value is the FP8 value times its descale, q's per kv head's group).
    spec: the call.
    block_sizes: the tiles.
    persistent: whether to launch a persistent kernel; None: the default
      (`runs_persistent`); True only where `is_persistent` allows (for
      comparisons).

  Returns:
    (out [B, T, N, H] in spec.output_dtype (the query's dtype but for FP8
    calls), lse2 float32
    [B, N, T]).
  """
  q_lengths, kv_lengths = pipeline.kernel_lengths(spec.mask, operands)
  segment_ids = pipeline.segment_ids(spec.mask, operands)
  query, key = operands.query, operands.key
  batch, q_seq, num_heads, head_dim = query.shape
  kv_seq, num_kv_heads = key.shape[1:3]
  dtype = query.dtype
  fp8 = spec.is_fp8
  out_dtype = jnp.dtype(spec.output_dtype)
  query = pad_rows(query, SEQ_ALIGN)
  key = pad_rows(key, SEQ_ALIGN)
  value = (fp8_value_layout(operands.value, block_sizes.block_kv) if fp8
           else pad_rows(operands.value, SEQ_ALIGN))
  block_q, block_kv = block_sizes.block_q, block_sizes.block_kv
  if q_lengths is None:
    q_lengths = kv_lengths = jnp.zeros((batch,), jnp.int32)  # Unread.
  fp8_scales = None
  if fp8:
    # Validation made each descale float32 [B, K].
    fp8_scales = jnp.stack([operands.q_descale * operands.k_descale
                            * spec.scale, operands.v_descale], axis=-1)
  num_tiles = pl.cdiv(q_seq, COMPUTE_WARPGROUPS * block_q)
  if persistent and not is_persistent(spec.mask):
    raise ValueError(f"persistent=True needs a mask without window, lengths "
                     f"or segments; got {spec.mask}.")
  if persistent is None:
    persistent = runs_persistent(spec)
  persistent = (pipeline.PersistentGrid.over(num_tiles, num_heads, batch,
                                             pairs=spec.mask.is_causal)
                if persistent else None)
  # Persistent kernels prefetch each block's Q during the previous block's
  # epilogue where the output has tiles of its own (FP8 has them anyway;
  # 16-bit calls where shared memory has room).
  prefetch_q = (persistent is not None and q_prefetch(fp8, head_dim)
                and (fp8 or block_sizes.fits_output_tiles(
                    head_dim, dtype.itemsize,
                    has_segments=segment_ids is not None)))
  output_tiles = fp8 or prefetch_q
  scratch = forward_scratch(
      dtype, head_dim, block_sizes, has_segments=segment_ids is not None,
      out_dtype=out_dtype if output_tiles else None)
  kernel = functools.partial(
      forward_kernel, mask=spec.mask, scale=spec.scale,
      soft_cap=spec.logits_soft_cap, block_sizes=block_sizes,
      group=num_heads // num_kv_heads, q_seq=q_seq, kv_seq=kv_seq,
      persistent=persistent, prefetch_q=prefetch_q)
  segments = None
  if segment_ids is not None:
    segments = pipeline.segment_inputs(
        segment_ids, queries_own=True,
        block_rows=COMPUTE_WARPGROUPS * block_q, group_rows=block_q,
        streamed_rows=block_kv)
  sinks = operands.sinks
  inputs = pipeline.KernelInputs(
      q=query, k=key, v=value, q_lengths=q_lengths, kv_lengths=kv_lengths,
      sinks=None if sinks is None else sinks.astype(jnp.float32),
      segments=segments, fp8_scales=fp8_scales)

  # The lse rows of the last tile are stored by a 1-D copy, which TMA
  # bounds by the whole array, not per row: past T they would land on the
  # next head's rows. Its array is padded to whole tiles instead.
  lse_seq = num_tiles * COMPUTE_WARPGROUPS * block_q
  out, lse2 = pipeline.launch(
      kernel, scratch, inputs,
      out_type=(sharding.output_struct(query.shape, out_dtype, query, key),
                sharding.output_struct((batch, num_heads, lse_seq),
                                       jnp.float32, query, key)),
      **(pipeline.tile_grid(num_tiles, num_heads, batch,
                            tile_axis="q_tiles", mask=spec.mask,
                            streamed_bytes=2 * key.size * key.dtype.itemsize)
         if persistent is None
         else dict(grid=(persistent.programs,), grid_names=("programs",))),
      num_threads=COMPUTE_WARPGROUPS + 1)
  if out.shape[1] != q_seq:
    out = out[:, :q_seq]
  if lse_seq != q_seq:
    lse2 = lse2[..., :q_seq]
  return out, lse2
