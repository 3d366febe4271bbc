"""Recomputing backward kernels (FlashAttention-2, Algorithm 2, split in two).

Nothing of size seq x seq is stored: probabilities are recomputed tile by tile
from q, k and the forward's base-2 log-sum-exp (see forward.py). Three launches:

1. `delta_kernel`: delta = rowsum(dO * O) per query row, fp32.
2. `dkv_kernel`: one program per key tile of one (batch, kv head); it walks the
   query tiles of every query head in the head's GQA group and accumulates
   dK and dV in registers, so GQA gradients are summed inside the kernel.
3. `dq_kernel`: one program per query tile of one (batch, head); it walks the
   key tiles and accumulates dQ.

Every output element is written by exactly one program and no atomics are
used, so gradients are bitwise deterministic.

The tiles each program visits and the element-wise mask come from `masks.py`,
exactly as in the forward. With segment ids, a key tile (dK/dV) visits only
the query tiles its segments can meet and a query tile (dQ) only such key
tiles, from per-tile ranges computed on the host for each kernel's tiles.

With p = softmax(scale * q.k) and dP = dO.V^T, the logit gradient is
dS = p * (dP - delta), and dQ = scale * dS.K, dK = scale * dS^T.Q,
dV = p^T.dO.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from jflash._src import masks
from jflash._src import tiles
from jflash._src.forward import KernelConfig
from jflash._src.forward import head_dim_padded


def delta_kernel(o_ref, do_ref, delta_ref, *, block_q: int, head_dim: int):
  q_start = pl.program_id(0) * block_q
  q_seq = o_ref.shape[0]
  o = tiles.load_tile(o_ref, q_start, block_q, seq_len=q_seq,
                      head_dim=head_dim)
  do = tiles.load_tile(do_ref, q_start, block_q, seq_len=q_seq,
                       head_dim=head_dim)
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=1)
  tiles.store_row_stats(delta_ref, q_start, delta, seq_len=q_seq)


def _probabilities(q, k, lse, *, scale, soft_cap, rows, k_start, block_k,
                   mask, kv_len, offset, needs_mask, q_ids=None, kv_ids=None):
  """Recomputes p = 2^(s2 - lse2) for one [block_q, block_k] tile.

  q_ids, kv_ids: the tile's segment ids, as in `masks.visible`.

  Returns (p, tanh) with tanh as in `tiles.logits_base2` (None without cap).
  """
  logits, capped = tiles.logits_base2(tiles.matmul(q, k, trans_b=True),
                                      scale=scale, soft_cap=soft_cap)
  probs = jnp.exp2(logits - lse[:, None])
  if needs_mask:
    cols = (k_start + jnp.arange(block_k, dtype=jnp.int32))[None, :]
    seen = masks.visible(mask, rows, cols, kv_len, offset, q_ids=q_ids,
                         kv_ids=kv_ids)
    probs = jnp.where(seen, probs, 0.0)
  return probs, capped


def _score_gradient(probs, capped, dprobs, delta):
  """dL/d(scale * q.k): p * (dP - delta), times the cap's tanh' if capped."""
  dlogits = probs * (dprobs - delta[:, None])
  if capped is not None:
    dlogits = dlogits * (1.0 - capped * capped)
  return dlogits


def dkv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_len_ref, kv_len_ref,
    *refs,  # With segments, their four inputs (masks.SegmentRefs); outputs.
    mask: masks.MaskSpec, scale: float, soft_cap: float | None,
    block_q: int, block_k: int, head_dim: int, group: int,
):
  # q_ref, do_ref: [q_seq, group, head_dim_p]; lse_ref, delta_ref:
  # [group, q_seq]; k_ref, v_ref, dk_ref, dv_ref: [kv_seq, head_dim_p].
  segments, (dk_ref, dv_ref) = masks.split_segment_refs(mask, refs)
  k_tile_index = pl.program_id(0)
  q_seq, kv_seq = q_ref.shape[0], k_ref.shape[0]
  # Lengths are always read from memory here, never static: see
  # masks.query_blocks_for_key_block for the lowering failure static bounds
  # caused in this kernel.
  q_len, kv_len = masks.load_lengths(
      dataclasses.replace(mask, has_lengths=True), q_len_ref, kv_len_ref,
      q_seq, kv_seq)
  offset = masks.causal_offset(mask, q_len, kv_len)
  k_start = k_tile_index * block_k
  k = tiles.load_tile(k_ref, k_start, block_k, seq_len=kv_seq,
                      head_dim=head_dim)
  v = tiles.load_tile(v_ref, k_start, block_k, seq_len=kv_seq,
                      head_dim=head_dim)
  blocks = masks.query_blocks(mask, k_start, block_k, block_q, q_len, kv_len,
                              offset, segments)
  kv_ids = None
  if segments is not None:
    kv_ids = masks.load_ids(segments.kv_ids, k_start, block_k)[None, :]

  def step(q_tile_index, carry, *, head, needs_mask: bool):
    dk, dv = carry
    q_start = q_tile_index * block_q
    rows = (q_start + jnp.arange(block_q, dtype=jnp.int32))[:, None]
    q_ids = None
    if segments is not None:
      q_ids = masks.load_ids(segments.q_ids, q_start, block_q)[:, None]
    q = tiles.load_tile(q_ref, q_start, block_q, seq_len=q_seq,
                        head_dim=head_dim, group_index=head)
    do = tiles.load_tile(do_ref, q_start, block_q, seq_len=q_seq,
                         head_dim=head_dim, group_index=head)
    # Rows past the array read lse = +inf, hence p = 0, like empty rows.
    lse = tiles.load_row_stats(lse_ref, q_start, block_q, seq_len=q_seq,
                               other=jnp.inf, group_index=head)
    delta = tiles.load_row_stats(delta_ref, q_start, block_q, seq_len=q_seq,
                                 other=0.0, group_index=head)
    probs, capped = _probabilities(
        q, k, lse, scale=scale, soft_cap=soft_cap, rows=rows,
        k_start=k_start, block_k=block_k, mask=mask, kv_len=kv_len,
        offset=offset, needs_mask=needs_mask, q_ids=q_ids, kv_ids=kv_ids)
    dv = dv + tiles.matmul(probs.astype(do.dtype), do, trans_a=True)
    dprobs = tiles.matmul(do, v, trans_b=True)
    dlogits = _score_gradient(probs, capped, dprobs, delta)
    dk = dk + tiles.matmul(dlogits.astype(q.dtype), q, trans_a=True)
    return dk, dv

  def head_step(head, carry):
    for lo, hi, needs_mask in blocks.segments():
      carry = lax.fori_loop(
          lo, hi, functools.partial(step, head=head, needs_mask=needs_mask),
          carry)
    return carry

  zeros = jnp.zeros((block_k, k_ref.shape[-1]), jnp.float32)
  dk, dv = lax.fori_loop(0, group, head_step, (zeros, zeros))
  tiles.store_tile(dk_ref, k_start, dk * scale, seq_len=kv_seq,
                   head_dim=head_dim)
  tiles.store_tile(dv_ref, k_start, dv, seq_len=kv_seq, head_dim=head_dim)


def dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_len_ref, kv_len_ref,
    *refs,  # With segments, their four inputs (masks.SegmentRefs); dQ.
    mask: masks.MaskSpec, scale: float, soft_cap: float | None,
    block_q: int, block_k: int, head_dim: int,
):
  segments, (dq_ref,) = masks.split_segment_refs(mask, refs)
  q_tile_index = pl.program_id(0)
  q_seq, kv_seq = q_ref.shape[0], k_ref.shape[0]
  q_len, kv_len = masks.load_lengths(mask, q_len_ref, kv_len_ref, q_seq,
                                     kv_seq)
  offset = masks.causal_offset(mask, q_len, kv_len)
  q_start = q_tile_index * block_q
  rows = (q_start + jnp.arange(block_q, dtype=jnp.int32))[:, None]
  q = tiles.load_tile(q_ref, q_start, block_q, seq_len=q_seq,
                      head_dim=head_dim)
  do = tiles.load_tile(do_ref, q_start, block_q, seq_len=q_seq,
                       head_dim=head_dim)
  lse = tiles.load_row_stats(lse_ref, q_start, block_q, seq_len=q_seq,
                             other=jnp.inf)
  delta = tiles.load_row_stats(delta_ref, q_start, block_q, seq_len=q_seq,
                               other=0.0)
  q_ids = None
  if segments is not None:
    q_ids = masks.load_ids(segments.q_ids, q_start, block_q)[:, None]

  def step(k_tile_index, dq, *, needs_mask: bool):
    k_start = k_tile_index * block_k
    kv_ids = None
    if segments is not None:
      kv_ids = masks.load_ids(segments.kv_ids, k_start, block_k)[None, :]
    seq_len = kv_seq if needs_mask else None
    k = tiles.load_tile(k_ref, k_start, block_k, seq_len=seq_len,
                        head_dim=head_dim)
    v = tiles.load_tile(v_ref, k_start, block_k, seq_len=seq_len,
                        head_dim=head_dim)
    probs, capped = _probabilities(
        q, k, lse, scale=scale, soft_cap=soft_cap, rows=rows,
        k_start=k_start, block_k=block_k, mask=mask, kv_len=kv_len,
        offset=offset, needs_mask=needs_mask, q_ids=q_ids, kv_ids=kv_ids)
    dprobs = tiles.matmul(do, v, trans_b=True)
    dlogits = _score_gradient(probs, capped, dprobs, delta)
    return dq + tiles.matmul(dlogits.astype(k.dtype), k)

  blocks = masks.key_blocks(mask, q_start, block_q, block_k, q_len, kv_len,
                            offset, segments)
  dq = jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32)
  for lo, hi, needs_mask in blocks.segments():
    dq = lax.fori_loop(lo, hi, functools.partial(step, needs_mask=needs_mask),
                       dq)
  tiles.store_tile(dq_ref, q_start, dq * scale, seq_len=q_seq,
                   head_dim=head_dim)


def _compiler_params(config: KernelConfig):
  return plgpu.CompilerParams(num_warps=config.block_sizes.num_warps_bwd,
                              num_stages=config.block_sizes.num_stages_bwd)


def delta_call(o, do, *, config: KernelConfig):
  """delta = rowsum(dO * O): float32 [batch, num_heads, q_len]."""
  batch, q_seq, num_heads, head_dim = o.shape
  block_q = config.block_sizes.block_q_dq
  tile_spec = pl.BlockSpec((None, q_seq, None, head_dim_padded(head_dim)),
                           lambda i, b, h: (b, 0, h, 0))
  return pl.pallas_call(
      functools.partial(delta_kernel, block_q=block_q, head_dim=head_dim),
      grid=(pl.cdiv(q_seq, block_q), batch, num_heads),
      in_specs=[tile_spec, tile_spec],
      out_specs=pl.BlockSpec((None, None, q_seq), lambda i, b, h: (b, h, 0)),
      out_shape=jax.ShapeDtypeStruct((batch, num_heads, q_seq), jnp.float32),
      compiler_params=_compiler_params(config),
      interpret=config.interpret,
      name="jflash_delta",
  )(o, do)


def dkv_call(q, k, v, do, lse, delta, q_lens, kv_lens, q_ids=None,
             kv_ids=None, *, config: KernelConfig):
  """dK and dV, each [batch, kv_len, num_kv_heads, head_dim] in k.dtype.

  q_ids, kv_ids: int32 segment ids [batch, q_len] and [batch, kv_len]; only
  with config.has_segments.
  """
  batch, q_seq, num_heads, head_dim = q.shape
  kv_seq, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  block_q = config.block_sizes.block_q_dkv
  block_k = config.block_sizes.block_k_dkv
  head_dim_p = head_dim_padded(head_dim)
  # The query-side blocks hold a kv head's whole group of query heads.
  q_group_spec = pl.BlockSpec((None, q_seq, group, head_dim_p),
                              lambda j, b, g: (b, 0, g, 0))
  stats_group_spec = pl.BlockSpec((None, group, q_seq),
                                  lambda j, b, g: (b, g, 0))
  kv_spec = pl.BlockSpec((None, kv_seq, None, head_dim_p),
                         lambda j, b, g: (b, 0, g, 0))
  lengths_spec = pl.BlockSpec((batch,), lambda j, b, g: (0,))
  kernel = functools.partial(
      dkv_kernel, mask=config.mask, scale=config.scale,
      soft_cap=config.logits_soft_cap, block_q=block_q,
      block_k=block_k, head_dim=head_dim, group=group)
  num_k_tiles = pl.cdiv(kv_seq, block_k)
  inputs = [q, k, v, do, lse, delta, q_lens, kv_lens]
  in_specs = [q_group_spec, kv_spec, kv_spec, q_group_spec, stats_group_spec,
              stats_group_spec, lengths_spec, lengths_spec]
  if config.has_segments:
    # Per key tile, the query tiles its segments can meet.
    inputs += [q_ids, kv_ids, *masks.segment_tile_ranges(
        kv_ids, kv_lens, block_k, q_ids, q_lens, block_q)]
    in_specs += masks.segment_specs(q_seq, kv_seq, num_k_tiles)
  return pl.pallas_call(
      kernel,
      grid=(num_k_tiles, batch, num_kv_heads),
      in_specs=in_specs,
      out_specs=[kv_spec, kv_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_compiler_params(config),
      interpret=config.interpret,
      name="jflash_dkv",
  )(*inputs)


def dq_call(q, k, v, do, lse, delta, q_lens, kv_lens, q_ids=None,
            kv_ids=None, *, config: KernelConfig):
  """dQ, [batch, q_len, num_heads, head_dim] in q.dtype; ids as dkv_call."""
  batch, q_seq, num_heads, head_dim = q.shape
  kv_seq, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  block_q = config.block_sizes.block_q_dq
  block_k = config.block_sizes.block_k_dq
  head_dim_p = head_dim_padded(head_dim)
  q_spec = pl.BlockSpec((None, q_seq, None, head_dim_p),
                        lambda i, b, h: (b, 0, h, 0))
  kv_spec = pl.BlockSpec((None, kv_seq, None, head_dim_p),
                         lambda i, b, h: (b, 0, h // group, 0))
  stats_spec = pl.BlockSpec((None, None, q_seq), lambda i, b, h: (b, h, 0))
  lengths_spec = pl.BlockSpec((batch,), lambda i, b, h: (0,))
  kernel = functools.partial(
      dq_kernel, mask=config.mask, scale=config.scale,
      soft_cap=config.logits_soft_cap, block_q=block_q,
      block_k=block_k, head_dim=head_dim)
  num_q_tiles = pl.cdiv(q_seq, block_q)
  inputs = [q, k, v, do, lse, delta, q_lens, kv_lens]
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, stats_spec, stats_spec,
              lengths_spec, lengths_spec]
  if config.has_segments:
    inputs += [q_ids, kv_ids, *masks.segment_tile_ranges(
        q_ids, q_lens, block_q, kv_ids, kv_lens, block_k)]
    in_specs += masks.segment_specs(q_seq, kv_seq, num_q_tiles)
  return pl.pallas_call(
      kernel,
      grid=(num_q_tiles, batch, num_heads),
      in_specs=in_specs,
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_compiler_params(config),
      interpret=config.interpret,
      name="jflash_dq",
  )(*inputs)
