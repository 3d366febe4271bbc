"""Forward kernel: tiled attention with online softmax (FlashAttention-2).

Limitations: the Pallas Triton backend (deprecated since JAX 0.11, see
docs/DESIGN.md); head_dim <= 256; float32, bfloat16 and float16 inputs.

Layout: q [batch, q_len, num_heads, head_dim], k/v [batch, kv_len,
num_kv_heads, head_dim]. One program computes one query tile of one
(batch, head): grid (num_query_tiles, batch, num_heads). Query head h reads
key/value head h // (num_heads // num_kv_heads); K/V are never repeated.

Outputs: O in the input dtype and the per-row log-sum-exp in fp32, in base 2
of the scaled logits: lse2 = log2(sum_c 2^(scale * log2(e) * q.k_c)). It is
the only statistic the backward needs (p = 2^(s2 - lse2)). A row that sees no
key at all (past q_len, kv_len == 0, outside every window, or with no key
of its segment) gets O = 0 and lse2 = +inf, which makes every probability the
backward recomputes for it exactly 0. With attention sinks (modifiers.py) the
lse includes the sink term, and a row before q_len that sees no key gets O = 0
and lse2 = its sink.

Masks (causal, window, lengths, segments, dense mask) come from `masks.py`:
the key tiles a query tile visits and the element-wise predicate inside the
cut ones. With segment ids, a query tile visits only the key tiles its
segments can meet (a per-tile range computed on the host) and masks all of
them. A dense `bias` (see dense.py) is added to the logits after the soft
cap: logit = cap(scale * q.k) + bias, in natural units, then masked. ALiBi,
sinks and dropout are the per-head modifiers of modifiers.py.
"""

from __future__ import annotations

import functools

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from jflash._src import masks
from jflash._src import numerics
from jflash._src import sharding
from jflash._src.backends.triton import dense
from jflash._src.backends.triton import kernel_inputs
from jflash._src.backends.triton import tiles
from jflash._src.backends.triton.config import TritonConfig
from jflash._src.backends.triton.kernel_inputs import KernelInputs
from jflash._src.spec import CallSpec
from jflash._src.spec import MaskSpec
from jflash._src.spec import ModifierSpec
from jflash._src.spec import Operands


# FlashAttention-2 (Dao, 2023), Algorithm 1, one query tile per program.
def forward_kernel(
    refs: KernelInputs, o_ref, lse_ref, *,
    mask: MaskSpec, scale: float, soft_cap: float | None,
    block_q: int, block_k: int, head_dim: int, q_tile_axis: int = 0,
    mods: ModifierSpec = ModifierSpec(),
):
  head_mods = kernel_inputs.load_head_modifiers(
      mods, refs, head=lambda: pl.program_id(head_axis(q_tile_axis)))
  q_seq, kv_seq = refs.q.shape[0], refs.k.shape[0]
  if refs.block_table is not None:  # Pages [num_pages, page_size, H_p].
    kv_seq = refs.block_table.shape[1] * refs.k.shape[1]
    # Read here: the interpreter discharges program ids outside loops only.
    batch_index = pl.program_id(1)
  q_tile_index = query_tile_index(mask, q_tile_axis, q_seq, block_q)
  q_len, kv_len = kernel_inputs.load_lengths(
      mask, refs.q_lengths, refs.kv_lengths, q_seq, kv_seq)
  offset = masks.causal_offset(mask, q_len, kv_len)
  q_start = q_tile_index * block_q
  rows = numerics.tile_rows(q_start, block_q)

  q = tiles.load_tile(
      refs.q, q_start, block_q, head_dim=head_dim,
      seq_len=q_seq if q_seq % block_q else None)
  q_ids = None
  if refs.q_segment_ids is not None:
    q_ids = kernel_inputs.load_ids(refs.q_segment_ids, q_start,
                                   block_q)[:, None]
  # Logits are kept in base 2: exp(scale * x) == exp2(scale * log2(e) * x).

  def step(k_tile_index, carry, *, needs_mask: bool):
    acc, row_max, row_sum = carry
    k_start = k_tile_index * block_k
    if refs.block_table is None:
      # Fully visible tiles lie below kv_len <= kv_seq: no row mask on the
      # loads.
      seq_len = kv_seq if needs_mask else None
      k = tiles.load_tile(refs.k, k_start, block_k, seq_len=seq_len,
                          head_dim=head_dim)
      v = tiles.load_tile(refs.v, k_start, block_k, seq_len=seq_len,
                          head_dim=head_dim)
    else:
      # Rows past kv_len are never read: their pages may not exist yet.
      k, v = (tiles.load_paged_tile(
          ref, k_start, block_k, head_dim=head_dim,
          table_ref=refs.block_table, batch=batch_index,
          seq_len=kv_len) for ref in (refs.k, refs.v))
    bias = None
    if refs.bias is not None:
      bias = dense.load_bias(refs.bias, q_start, block_q, k_start, block_k)
    logits, _, cols = numerics.tile_logits(
        tiles.matmul(q, k, trans_b=True), scale=scale, soft_cap=soft_cap,
        bias=bias, head_mods=head_mods, rows=rows, k_start=k_start,
        block_k=block_k, offset=offset)
    if needs_mask:
      if cols is None:
        cols = numerics.tile_columns(k_start, block_k)
      kv_ids = tile_mask = None
      if refs.kv_segment_ids is not None:
        kv_ids = kernel_inputs.load_ids(refs.kv_segment_ids, k_start,
                                        block_k)[None, :]
      if refs.mask is not None:
        tile_mask = dense.load_mask(refs.mask, q_start, block_q, k_start,
                                    block_k)
      seen = masks.visible(mask, rows, cols, kv_len, offset, q_ids=q_ids,
                           kv_ids=kv_ids, dense=tile_mask)
      logits = jnp.where(seen, logits, numerics.MASK_VALUE)
    new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
    probs = jnp.exp2(logits - new_max[:, None])
    if needs_mask:
      # Exact zeros even for rows that have seen no visible key yet (for them
      # new_max is MASK_VALUE and the line above gives 1).
      probs = jnp.where(seen, probs, 0.0)
    correction = jnp.exp2(row_max - new_max)
    row_sum = row_sum * correction + jnp.sum(probs, axis=1)
    if mods.has_dropout:
      # Dropout acts on the normalized probabilities: the row sum (hence the
      # lse) counts every probability, the output only the kept ones; the
      # 1 / (1 - rate) comes with the final normalization.
      probs = jnp.where(head_mods.dropout_keep(rows, cols), probs, 0.0)
    acc = acc * correction[:, None] + tiles.matmul(probs.astype(v.dtype), v)
    return acc, new_max, row_sum

  blocks = masks.key_blocks(mask, q_start, block_q, block_k, q_len, kv_len,
                            offset, kernel_inputs.segment_range(refs))
  carry = (
      jnp.zeros((block_q, refs.q.shape[-1]), jnp.float32),
      # Row max and row sum: nothing seen yet, or a sink (modifiers.py).
      *(head_mods.initial_row_stats(block_q) or (
          jnp.full((block_q,), numerics.MASK_VALUE, jnp.float32),
          jnp.zeros((block_q,), jnp.float32))),
  )
  for lo, hi, needs_mask in blocks.runs():
    carry = lax.fori_loop(
        lo, hi, functools.partial(step, needs_mask=needs_mask), carry)
  acc, row_max, row_sum = carry
  if mods.has_dropout:
    acc = acc * (1.0 / (1.0 - mods.dropout_rate))

  # A row has a visible key iff its sum is positive (masked probabilities are
  # exact zeros); rows past q_len are treated as having none.
  has_keys = jnp.logical_and(row_sum > 0.0, rows[:, 0] < q_len)
  safe_sum = jnp.where(has_keys, row_sum, 1.0)
  # One reciprocal per row, then a multiply per element (not a division).
  out = acc * jnp.where(has_keys, 1.0 / safe_sum, 0.0)[:, None]
  lse = jnp.where(has_keys, row_max + jnp.log2(safe_sum), jnp.inf)
  tiles.store_tile(o_ref, q_start, out, seq_len=q_seq, head_dim=head_dim)
  tiles.store_row_stats(lse_ref, q_start, lse, seq_len=q_seq)


# Launch order of the programs that own one query tile each (forward, dQ).
#
# Triton launches programs in grid order, axis 0 fastest. Without a causal
# mask every query tile costs the same and the grid is (query tile, batch,
# head): neighbouring programs share one head's K/V in L2. With a causal mask
# query tile i visits i + 1 key tiles and the tile index is reversed, so the
# longest tiles launch first and the shortest fill the last wave
# (longest-processing-time-first). Up to moderate lengths the grid is (head,
# batch, query tile): every head's longest tiles run before any head's short
# ones. At long key lengths that order spreads the programs in flight over
# every head's K/V, which no longer stays in L2, so from
# `CAUSAL_TILE_MAJOR_KV_LEN` keys on the grid is (query tile, batch, head)
# again: the programs in flight mostly share one head's K/V. H200, bf16,
# B=1, H=16, D=128, causal (RECORD.md, 2026-11-23, round 4), head-major
# against tile-major forward TFLOP/s: 408 vs 375 at N=8192, 442 vs 447 at
# 16384, 442 vs 458 at 32768, 422 vs 455 at 65536, 397 vs 470 at 131072
# (fwd+bwd 327 vs 387); at B=2, N=8192: 418 vs 395.
CAUSAL_TILE_MAJOR_KV_LEN = 16384


def query_tile_grid(num_q_tiles: int, batch: int, num_heads: int,
                    is_causal: bool, kv_seq: int):
  """(grid, order, q_tile_axis) for kernels with one program per query tile.

  `order(f)` adapts an index map written as f(i, b, h) to the grid's axis
  order; `q_tile_axis` is the grid axis of the query tile. The batch is axis
  1 in both orders (`kernel_inputs.load_lengths` reads it there).
  """
  if is_causal and kv_seq < CAUSAL_TILE_MAJOR_KV_LEN:
    order = lambda f: (lambda h, b, i: f(i, b, h))
    return (num_heads, batch, num_q_tiles), order, 2
  return (num_q_tiles, batch, num_heads), lambda f: f, 0


def query_tile_index(mask: MaskSpec, q_tile_axis: int, q_seq: int,
                     block_q: int):
  """This program's query tile (see `query_tile_grid`): causal tiles run in
  reverse, longest first."""
  index = pl.program_id(q_tile_axis)
  if mask.is_causal:
    index = (pl.cdiv(q_seq, block_q) - 1) - index
  return index


def query_tile_inputs(operands: Operands, mods: ModifierSpec, *,
                      block_q: int, block_k: int, order, **backward_inputs
                      ) -> tuple[KernelInputs, KernelInputs]:
  """(arrays, BlockSpecs) of the kernels with one program per query tile.

  Args:
    operands: q, k, v, lengths (filled), and the optional operands present;
      the mask as int8 (dense.py).
    mods: the modifiers the kernel applies (the dQ kernel takes no sinks).
    block_q, block_k: the kernel's tiles.
    order: as `query_tile_grid`'s.
    **backward_inputs: do, lse and delta, for the dQ kernel.
  """
  q, k = operands.query, operands.key
  batch, q_seq, num_heads, head_dim = q.shape
  kv_seq, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  head_dim_p = tiles.head_dim_padded(head_dim)
  q_spec = pl.BlockSpec((None, q_seq, None, head_dim_p),
                        order(lambda i, b, h: (b, 0, h, 0)))
  if operands.block_table is None:
    kv_spec = pl.BlockSpec((None, kv_seq, None, head_dim_p),
                           order(lambda i, b, h: (b, 0, h // group, 0)))
  else:  # Each program: every page of its kv head, [P, page_size, H_p].
    kv_spec = pl.BlockSpec((*k.shape[:2], None, head_dim_p),
                           order(lambda i, b, h: (0, 0, h // group, 0)))
  stats_spec = pl.BlockSpec((None, None, q_seq),
                            order(lambda i, b, h: (b, h, 0)))
  lengths_spec = pl.BlockSpec((batch,), order(lambda i, b, h: (0,)))
  arrays = dict(q=q, k=k, v=operands.value, q_lengths=operands.q_lengths,
                kv_lengths=operands.kv_lengths, **backward_inputs)
  specs = dict(q=q_spec, k=kv_spec, v=kv_spec, q_lengths=lengths_spec,
               kv_lengths=lengths_spec,
               **{name: q_spec if name == "do" else stats_spec
                  for name in backward_inputs})
  # Per query tile, the key tiles its segments can meet.
  optional_arrays, optional_specs = kernel_inputs.optional_inputs(
      operands, mods, block_q=block_q, block_k=block_k, own_axis="q",
      dense_spec=lambda x: dense.block_spec(x, batch, order=order),
      order=order)
  if operands.block_table is not None:
    table = operands.block_table
    arrays["block_table"] = table
    specs["block_table"] = pl.BlockSpec(table.shape,
                                        order(lambda i, b, h: (0, 0)))
  return (KernelInputs(**arrays, **optional_arrays),
          KernelInputs(**specs, **optional_specs))


def head_axis(q_tile_axis: int) -> int:
  """The head's grid axis in `query_tile_grid`'s grids: 2, or 0."""
  return 2 - q_tile_axis


def forward_call(operands: Operands, *, spec: CallSpec,
                 config: TritonConfig):
  """Launches the forward kernel.

  Args:
    operands: the call's arrays, with both lengths filled and the mask as
      int8 (see `backend.py`); shapes as `spec.Operands`.
    spec: the call.
    config: tiles and launch options.

  Returns:
    (out [batch, q_len, num_heads, head_dim] in q.dtype,
     lse2 float32 [batch, num_heads, q_len]).
  """
  q = operands.query
  batch, q_seq, num_heads, head_dim = q.shape
  kv_seq = operands.kv_seq
  block_q = config.block_sizes.block_q
  block_k = config.block_sizes.block_k
  grid, order, q_tile_axis = query_tile_grid(
      pl.cdiv(q_seq, block_q), batch, num_heads, spec.mask.is_causal, kv_seq)
  kernel = functools.partial(
      forward_kernel, mask=spec.mask, scale=spec.scale,
      soft_cap=spec.logits_soft_cap, block_q=block_q, block_k=block_k,
      head_dim=head_dim, q_tile_axis=q_tile_axis, mods=spec.modifiers)
  inputs, in_specs = query_tile_inputs(operands, spec.modifiers,
                                       block_q=block_q, block_k=block_k,
                                       order=order)
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=(in_specs,),
      out_specs=[in_specs.q,
                 pl.BlockSpec((None, None, q_seq),
                              order(lambda i, b, h: (b, h, 0)))],
      out_shape=[
          sharding.output_struct(q.shape, q.dtype, inputs),
          sharding.output_struct((batch, num_heads, q_seq), jnp.float32,
                                 inputs),
      ],
      compiler_params=plgpu.CompilerParams(
          num_warps=config.block_sizes.num_warps,
          num_stages=config.block_sizes.num_stages),
      interpret=config.interpret,
      name="jflash_forward",
  )(inputs)
