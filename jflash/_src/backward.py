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

With a dense `bias`, a fourth launch, `dbias_kernel`, writes dbias = dS
(natural units) summed over the batch elements and heads the bias is
broadcast over, without a [batch, heads, q_len, kv_len] intermediate: one
program per (query tile, bias batch, bias head) walks the key tiles and, per
tile, the (batch, head) pairs that share its slice, recomputing p and dP.

With p = softmax(scale * q.k + bias) and dP = dO.V^T, the logit gradient is
dS = p * (dP - delta), and dQ = scale * dS.K, dK = scale * dS^T.Q,
dV = p^T.dO, dbias = dS (times tanh' for q.k, not for the bias, when the
logits are soft-capped).

Dropout (modifiers.py) multiplies p elementwise by Z = keep / (1 - rate)
after the softmax: O = (p * Z).V. Then dV = (p * Z)^T.dO, the gradient
reaching p is dP * Z, and the softmax's backward gives
dS = p * (dP * Z - rowsum(p * dP * Z)), where rowsum(p * Z * dP)_t =
sum_c (p * Z)_tc (dO_t . v_c) = dO_t . O_t = delta_t: delta is unchanged
(O already holds the dropout), and only dV's probabilities and dP take Z.
ALiBi adds a position-only bias to the logits (no effect on dS); sinks live
in the forward's lse, so the backward kernels never read them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from jflash._src import dense
from jflash._src import forward
from jflash._src import masks
from jflash._src import modifiers
from jflash._src import tiles
from jflash._src.forward import KernelConfig
from jflash._src.forward import head_dim_padded
from jflash._src.forward import split_extras


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
                   mask, kv_len, offset, needs_mask, q_ids=None, kv_ids=None,
                   bias=None, tile_mask=None, head_mods=None):
  """Recomputes p = 2^(s2 - lse2) for one [block_q, block_k] tile.

  q_ids, kv_ids, tile_mask: the tile's segment ids and dense-mask tile, as
  in `masks.visible`; bias: its fp32 bias tile (natural units), or None;
  head_mods: the head's `modifiers.HeadModifiers` (ALiBi), or None.

  Returns (p, tanh) with tanh as in `tiles.logits_base2` (None without cap).
  """
  logits, capped = tiles.logits_base2(tiles.matmul(q, k, trans_b=True),
                                      scale=scale, soft_cap=soft_cap)
  if bias is not None:
    logits = logits + bias * tiles.LOG2_E
  cols = None
  if head_mods is not None and head_mods.spec.uses_positions:
    cols = (k_start + jnp.arange(block_k, dtype=jnp.int32))[None, :]
    logits = head_mods.add_bias(logits, rows, cols, offset)
  probs = jnp.exp2(logits - lse[:, None])
  if needs_mask:
    if cols is None:
      cols = (k_start + jnp.arange(block_k, dtype=jnp.int32))[None, :]
    seen = masks.visible(mask, rows, cols, kv_len, offset, q_ids=q_ids,
                         kv_ids=kv_ids, dense=tile_mask)
    probs = jnp.where(seen, probs, 0.0)
  return probs, capped


def _dropout_scale(head_mods, rows, k_start, block_k):
  """The tile's dropout factor Z = keep / (1 - rate), or None."""
  if head_mods is None or not head_mods.spec.has_dropout:
    return None
  cols = (k_start + jnp.arange(block_k, dtype=jnp.int32))[None, :]
  return head_mods.dropout_scale(rows, cols)


def _logit_gradient(probs, dprobs, delta):
  """dL/d(logit), natural units: p * (dP - delta). It is also dL/d(bias)."""
  return probs * (dprobs - delta[:, None])


def _score_gradient(probs, capped, dprobs, delta):
  """dL/d(scale * q.k): p * (dP - delta), times the cap's tanh' if capped."""
  dlogits = _logit_gradient(probs, dprobs, delta)
  if capped is not None:
    dlogits = dlogits * (1.0 - capped * capped)
  return dlogits


def dkv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_len_ref, kv_len_ref,
    *refs,  # Optional mask inputs (masks.split_refs), modifier operands
            # (modifiers.py), then dK, dV.
    mask: masks.MaskSpec, scale: float, soft_cap: float | None,
    block_q: int, block_k: int, head_dim: int, group: int, has_bias: bool,
    mods: modifiers.ModifierSpec = modifiers.ModifierSpec(),
):
  # q_ref, do_ref: [q_seq, group, head_dim_p]; lse_ref, delta_ref:
  # [group, q_seq]; k_ref, v_ref, dk_ref, dv_ref: [kv_seq, head_dim_p];
  # bias and mask: [group, q_seq, kv_seq] per head, else [q_seq, kv_seq].
  segments, bias_ref, mask_ref, refs = masks.split_refs(mask, has_bias, refs)
  *mod_refs, dk_ref, dv_ref = refs
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

  def step(q_tile_index, carry, *, head, head_mods, needs_mask: bool):
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
    bias = tile_mask = None
    if bias_ref is not None:
      bias = dense.load_bias(bias_ref, q_start, block_q, k_start, block_k,
                             dense.leading_index(bias_ref, head))
    if mask_ref is not None:
      tile_mask = dense.load_mask(mask_ref, q_start, block_q, k_start,
                                  block_k, dense.leading_index(mask_ref, head))
    probs, capped = _probabilities(
        q, k, lse, scale=scale, soft_cap=soft_cap, rows=rows,
        k_start=k_start, block_k=block_k, mask=mask, kv_len=kv_len,
        offset=offset, needs_mask=needs_mask, q_ids=q_ids, kv_ids=kv_ids,
        bias=bias, tile_mask=tile_mask, head_mods=head_mods)
    dropout_scale = _dropout_scale(head_mods, rows, k_start, block_k)
    kept = probs if dropout_scale is None else probs * dropout_scale
    dv = dv + tiles.matmul(kept.astype(do.dtype), do, trans_a=True)
    dprobs = tiles.matmul(do, v, trans_b=True)
    if dropout_scale is not None:
      dprobs = dprobs * dropout_scale
    dlogits = _score_gradient(probs, capped, dprobs, delta)
    dk = dk + tiles.matmul(dlogits.astype(q.dtype), q, trans_a=True)
    return dk, dv

  # The group's first query head, as in forward_call. (Read here: the
  # interpreter resolves program ids only outside loops.)
  first_head = pl.program_id(2) * group if mods.num_operands else None

  def head_step(head, carry):
    head_mods = modifiers.HeadModifiers(mods, mod_refs,
                                        head=lambda: first_head + head)
    for lo, hi, needs_mask in blocks.segments():
      carry = lax.fori_loop(
          lo, hi, functools.partial(step, head=head, head_mods=head_mods,
                                    needs_mask=needs_mask),
          carry)
    return carry

  zeros = jnp.zeros((block_k, k_ref.shape[-1]), jnp.float32)
  dk, dv = lax.fori_loop(0, group, head_step, (zeros, zeros))
  tiles.store_tile(dk_ref, k_start, dk * scale, seq_len=kv_seq,
                   head_dim=head_dim)
  tiles.store_tile(dv_ref, k_start, dv, seq_len=kv_seq, head_dim=head_dim)


def dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_len_ref, kv_len_ref,
    *refs,  # Optional mask inputs (masks.split_refs), modifier operands
            # (modifiers.py), then dQ.
    mask: masks.MaskSpec, scale: float, soft_cap: float | None,
    block_q: int, block_k: int, head_dim: int, has_bias: bool,
    q_tile_axis: int = 0,
    mods: modifiers.ModifierSpec = modifiers.ModifierSpec(),
):
  segments, bias_ref, mask_ref, refs = masks.split_refs(mask, has_bias, refs)
  *mod_refs, dq_ref = refs
  head_mods = modifiers.HeadModifiers(
      mods, mod_refs,
      head=lambda: pl.program_id(forward.head_axis(q_tile_axis)))
  q_seq, kv_seq = q_ref.shape[0], k_ref.shape[0]
  q_tile_index = forward.query_tile_index(mask, q_tile_axis, q_seq, block_q)
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
    bias = tile_mask = None
    if bias_ref is not None:
      bias = dense.load_bias(bias_ref, q_start, block_q, k_start, block_k)
    if mask_ref is not None:
      tile_mask = dense.load_mask(mask_ref, q_start, block_q, k_start,
                                  block_k)
    probs, capped = _probabilities(
        q, k, lse, scale=scale, soft_cap=soft_cap, rows=rows,
        k_start=k_start, block_k=block_k, mask=mask, kv_len=kv_len,
        offset=offset, needs_mask=needs_mask, q_ids=q_ids, kv_ids=kv_ids,
        bias=bias, tile_mask=tile_mask, head_mods=head_mods)
    dprobs = tiles.matmul(do, v, trans_b=True)
    dropout_scale = _dropout_scale(head_mods, rows, k_start, block_k)
    if dropout_scale is not None:
      dprobs = dprobs * dropout_scale
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


def dkv_call(q, k, v, do, lse, delta, q_lens, kv_lens, *extras,
             config: KernelConfig):
  """dK and dV, each [batch, kv_len, num_kv_heads, head_dim] in k.dtype.

  extras: the optional operands, as in `forward.forward_call`.
  """
  mods = config.modifiers.for_backward()
  q_ids, kv_ids, bias, dense_mask, mod_operands = split_extras(
      config, extras, mods)
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
      block_k=block_k, head_dim=head_dim, group=group,
      has_bias=config.has_bias, mods=mods)
  num_k_tiles = pl.cdiv(kv_seq, block_k)
  inputs = [q, k, v, do, lse, delta, q_lens, kv_lens]
  in_specs = [q_group_spec, kv_spec, kv_spec, q_group_spec, stats_group_spec,
              stats_group_spec, lengths_spec, lengths_spec]
  if config.has_segments:
    # Per key tile, the query tiles its segments can meet.
    inputs += [q_ids, kv_ids, *masks.segment_tile_ranges(
        kv_ids, kv_lens, block_k, q_ids, q_lens, block_q)]
    in_specs += masks.segment_specs(q_seq, kv_seq, num_k_tiles)
  for operand in (bias, dense_mask):
    if operand is not None:
      inputs.append(operand)
      in_specs.append(dense.block_spec(operand, batch, group=group))
  inputs += mod_operands
  in_specs += mods.operand_specs(num_heads)
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


def dq_call(q, k, v, do, lse, delta, q_lens, kv_lens, *extras,
            config: KernelConfig):
  """dQ, [batch, q_len, num_heads, head_dim] in q.dtype; extras as dkv_call."""
  mods = config.modifiers.for_backward()
  q_ids, kv_ids, bias, dense_mask, mod_operands = split_extras(
      config, extras, mods)
  batch, q_seq, num_heads, head_dim = q.shape
  kv_seq, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  block_q = config.block_sizes.block_q_dq
  block_k = config.block_sizes.block_k_dq
  head_dim_p = head_dim_padded(head_dim)
  grid, order, q_tile_axis = forward.query_tile_grid(
      pl.cdiv(q_seq, block_q), batch, num_heads, config.is_causal, kv_seq)
  q_spec = pl.BlockSpec((None, q_seq, None, head_dim_p),
                        order(lambda i, b, h: (b, 0, h, 0)))
  kv_spec = pl.BlockSpec((None, kv_seq, None, head_dim_p),
                         order(lambda i, b, h: (b, 0, h // group, 0)))
  stats_spec = pl.BlockSpec((None, None, q_seq),
                            order(lambda i, b, h: (b, h, 0)))
  lengths_spec = pl.BlockSpec((batch,), order(lambda i, b, h: (0,)))
  kernel = functools.partial(
      dq_kernel, mask=config.mask, scale=config.scale,
      soft_cap=config.logits_soft_cap, block_q=block_q,
      block_k=block_k, head_dim=head_dim, has_bias=config.has_bias,
      q_tile_axis=q_tile_axis, mods=mods)
  optional, optional_specs = forward.query_tile_operands(
      config, mods, q_ids, kv_ids, bias, dense_mask, mod_operands,
      q_lens=q_lens, kv_lens=kv_lens, block_q=block_q, block_k=block_k,
      q_seq=q_seq, kv_seq=kv_seq, batch=batch, num_heads=num_heads,
      order=order)
  inputs = [q, k, v, do, lse, delta, q_lens, kv_lens, *optional]
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, stats_spec, stats_spec,
              lengths_spec, lengths_spec, *optional_specs]
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_compiler_params(config),
      interpret=config.interpret,
      name="jflash_dq",
  )(*inputs)


def dbias_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_len_ref, kv_len_ref,
    *refs,  # Segment ids (no ranges), bias, mask if present; then dbias.
    mask: masks.MaskSpec, scale: float, soft_cap: float | None,
    block_q: int, block_k: int, head_dim: int, group: int, batch_span: int,
    pair_heads: int, mask_span: int, mask_per_head: bool,
):
  # Whole-array refs: q_ref, do_ref [batch, q_seq, num_heads, head_dim_p];
  # k_ref, v_ref [batch, kv_seq, num_kv_heads, head_dim_p]; lse_ref,
  # delta_ref [batch, num_heads, q_seq]; lengths [batch]; segment ids
  # [batch, seq]; mask [mask_batch, mask_heads, q_seq, kv_seq]. bias_ref and
  # dbias_ref: this program's [q_seq, kv_seq] slice.
  segments, bias_ref, mask_ref, (dbias_ref,) = masks.split_refs(
      mask, True, refs, segment_ranges=False)
  q_seq, kv_seq = q_ref.shape[1], k_ref.shape[1]
  q_start = pl.program_id(0) * block_q
  bias_batch, bias_head = pl.program_id(1), pl.program_id(2)
  rows = (q_start + jnp.arange(block_q, dtype=jnp.int32))[:, None]

  def pair_step(pair, dbias, *, k_start, bias):
    # The pair-th (batch, head) sharing this program's bias slice: batches
    # [bias_batch * batch_span, +batch_span) times `pair_heads` heads (all of
    # them for a bias shared by all heads, else this program's head).
    b = bias_batch * batch_span + lax.div(pair, pair_heads)
    h = bias_head if pair_heads == 1 else lax.rem(pair, pair_heads)
    q_len = plgpu.load(q_len_ref.at[b])
    kv_len = plgpu.load(kv_len_ref.at[b])
    q_ids = kv_ids = tile_mask = None
    if segments is not None:
      q_ids = masks.load_ids(segments.q_ids, q_start, block_q, b)[:, None]
      kv_ids = masks.load_ids(segments.kv_ids, k_start, block_k, b)[None, :]
    if mask_ref is not None:
      tile_mask = dense.load_mask(
          mask_ref, q_start, block_q, k_start, block_k,
          (lax.div(b, mask_span), h if mask_per_head else 0))
    load = functools.partial(tiles.load_tile, head_dim=head_dim,
                             batch_index=b)
    q = load(q_ref, q_start, block_q, seq_len=q_seq, group_index=h)
    do = load(do_ref, q_start, block_q, seq_len=q_seq, group_index=h)
    k = load(k_ref, k_start, block_k, seq_len=kv_seq,
             group_index=lax.div(h, group))
    v = load(v_ref, k_start, block_k, seq_len=kv_seq,
             group_index=lax.div(h, group))
    # Rows past q_len or the array have lse = +inf: p = 0 there.
    lse = tiles.load_row_stats(lse_ref, q_start, block_q, seq_len=q_seq,
                               other=jnp.inf, group_index=h, batch_index=b)
    delta = tiles.load_row_stats(delta_ref, q_start, block_q, seq_len=q_seq,
                                 other=0.0, group_index=h, batch_index=b)
    probs, _ = _probabilities(
        q, k, lse, scale=scale, soft_cap=soft_cap, rows=rows,
        k_start=k_start, block_k=block_k, mask=mask, kv_len=kv_len,
        offset=masks.causal_offset(mask, q_len, kv_len), needs_mask=True,
        q_ids=q_ids, kv_ids=kv_ids, bias=bias, tile_mask=tile_mask)
    dprobs = tiles.matmul(do, v, trans_b=True)
    return dbias + _logit_gradient(probs, dprobs, delta)

  def key_step(k_tile_index, carry):
    # Every key tile is visited and stored (invisible entries get 0): the
    # visible tiles differ between the batch elements summed here.
    k_start = k_tile_index * block_k
    bias = dense.load_bias(bias_ref, q_start, block_q, k_start, block_k)
    dbias = lax.fori_loop(
        jnp.int32(0), jnp.int32(batch_span * pair_heads),
        functools.partial(pair_step, k_start=k_start, bias=bias),
        jnp.zeros((block_q, block_k), jnp.float32))
    dense.store_tile(dbias_ref, q_start, k_start, dbias)
    return carry

  # Traced bounds on both loops (see masks._block_range on nested loops).
  lax.fori_loop(jnp.int32(0), jnp.int32(pl.cdiv(kv_seq, block_k)), key_step,
                jnp.int32(0))


def dbias_call(q, k, v, do, lse, delta, q_lens, kv_lens, *extras,
               config: KernelConfig):
  """dL/d(bias) in the bias's shape and dtype; extras as dkv_call."""
  batch, q_seq, num_heads, head_dim = q.shape
  kv_seq, num_kv_heads = k.shape[1], k.shape[2]
  # Only the mask operands: calls with a bias take no ALiBi or dropout
  # (api.py), and sinks live in the lse.
  q_ids, kv_ids, bias, dense_mask, _ = split_extras(
      config, extras, modifiers.ModifierSpec())
  block_q = config.block_sizes.block_q_dq
  block_k = config.block_sizes.block_k_dq
  head_dim_p = head_dim_padded(head_dim)
  whole = lambda shape: pl.BlockSpec(shape, lambda i, bb, hh: (0,) * len(
      shape))
  inputs = [q, k, v, do, lse, delta, q_lens, kv_lens]
  in_specs = [whole((batch, q_seq, num_heads, head_dim_p)),
              whole((batch, kv_seq, num_kv_heads, head_dim_p)),
              whole((batch, kv_seq, num_kv_heads, head_dim_p)),
              whole((batch, q_seq, num_heads, head_dim_p)),
              whole((batch, num_heads, q_seq)),
              whole((batch, num_heads, q_seq)),
              whole((batch,)), whole((batch,))]
  if config.has_segments:
    inputs += [q_ids, kv_ids]
    in_specs += [whole((batch, q_seq)), whole((batch, kv_seq))]
  bias_spec = pl.BlockSpec((None, None, q_seq, kv_seq),
                           lambda i, bb, hh: (bb, hh, 0, 0))
  inputs.append(bias)
  in_specs.append(bias_spec)
  mask_span, mask_per_head = 1, False
  if dense_mask is not None:
    inputs.append(dense_mask)
    in_specs.append(whole(dense_mask.shape))
    mask_span = dense.batch_span(dense_mask, batch)
    mask_per_head = dense_mask.shape[1] != 1
  kernel = functools.partial(
      dbias_kernel, mask=config.mask, scale=config.scale,
      soft_cap=config.logits_soft_cap, block_q=block_q, block_k=block_k,
      head_dim=head_dim, group=num_heads // num_kv_heads,
      batch_span=dense.batch_span(bias, batch),
      pair_heads=1 if bias.shape[1] != 1 else num_heads,
      mask_span=mask_span, mask_per_head=mask_per_head)
  return pl.pallas_call(
      kernel,
      grid=(pl.cdiv(q_seq, block_q), bias.shape[0], bias.shape[1]),
      in_specs=in_specs,
      out_specs=bias_spec,
      out_shape=jax.ShapeDtypeStruct(bias.shape, bias.dtype),
      compiler_params=_compiler_params(config),
      interpret=config.interpret,
      name="jflash_dbias",
  )(*inputs)
