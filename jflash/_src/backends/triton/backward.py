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

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from jflash._src import masks
from jflash._src import numerics
from jflash._src import sharding
from jflash._src.backends.triton import dense
from jflash._src.backends.triton import forward
from jflash._src.backends.triton import kernel_inputs
from jflash._src.backends.triton import tiles
from jflash._src.backends.triton.config import TritonConfig
from jflash._src.backends.triton.kernel_inputs import KernelInputs
from jflash._src.spec import CallSpec
from jflash._src.spec import MaskSpec
from jflash._src.spec import ModifierSpec
from jflash._src.spec import Operands


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

  The logits come from `numerics.tile_logits`, as in the forward; q_ids,
  kv_ids, tile_mask: the tile's segment ids and dense-mask tile, as in
  `masks.visible`; bias: its fp32 bias tile (natural units), or None;
  head_mods: the head's `modifiers.HeadModifiers` (ALiBi), or None.

  Returns (p, tanh) with tanh as in `numerics.logits_base2` (None without
  cap).
  """
  logits, capped, cols = numerics.tile_logits(
      tiles.matmul(q, k, trans_b=True), scale=scale, soft_cap=soft_cap,
      bias=bias, head_mods=head_mods, rows=rows, k_start=k_start,
      block_k=block_k, offset=offset)
  probs = jnp.exp2(logits - lse[:, None])
  if needs_mask:
    if cols is None:
      cols = numerics.tile_columns(k_start, block_k)
    seen = masks.visible(mask, rows, cols, kv_len, offset, q_ids=q_ids,
                         kv_ids=kv_ids, dense=tile_mask)
    probs = jnp.where(seen, probs, 0.0)
  return probs, capped


def _dropout_scale(head_mods, rows, k_start, block_k):
  """The tile's dropout factor Z = keep / (1 - rate), or None."""
  if head_mods is None or not head_mods.spec.has_dropout:
    return None
  return head_mods.dropout_scale(rows,
                                 numerics.tile_columns(k_start, block_k))


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
    refs: KernelInputs, dk_ref, dv_ref, *,
    mask: MaskSpec, scale: float, soft_cap: float | None,
    block_q: int, block_k: int, head_dim: int, group: int,
    mods: ModifierSpec = ModifierSpec(),
):
  # refs.q, refs.do: [q_seq, group, head_dim_p]; refs.lse, refs.delta:
  # [group, q_seq]; refs.k, refs.v, dk_ref, dv_ref: [kv_seq, head_dim_p];
  # bias and mask: [group, q_seq, kv_seq] per head, else [q_seq, kv_seq].
  k_tile_index = pl.program_id(0)
  q_seq, kv_seq = refs.q.shape[0], refs.k.shape[0]
  # Lengths are always read from memory here, never static: see
  # masks.query_blocks_for_key_block for the lowering failure static bounds
  # caused in this kernel.
  q_len, kv_len = kernel_inputs.load_lengths(
      dataclasses.replace(mask, has_lengths=True), refs.q_lengths,
      refs.kv_lengths, q_seq, kv_seq)
  offset = masks.causal_offset(mask, q_len, kv_len)
  k_start = k_tile_index * block_k
  k = tiles.load_tile(refs.k, k_start, block_k, seq_len=kv_seq,
                      head_dim=head_dim)
  v = tiles.load_tile(refs.v, k_start, block_k, seq_len=kv_seq,
                      head_dim=head_dim)
  blocks = masks.query_blocks(mask, k_start, block_k, block_q, q_len, kv_len,
                              offset, kernel_inputs.segment_range(refs))
  kv_ids = None
  if refs.kv_segment_ids is not None:
    kv_ids = kernel_inputs.load_ids(refs.kv_segment_ids, k_start,
                                    block_k)[None, :]

  def step(q_tile_index, carry, *, head, head_mods, needs_mask: bool):
    dk, dv = carry
    q_start = q_tile_index * block_q
    rows = numerics.tile_rows(q_start, block_q)
    q_ids = None
    if refs.q_segment_ids is not None:
      q_ids = kernel_inputs.load_ids(refs.q_segment_ids, q_start,
                                     block_q)[:, None]
    q = tiles.load_tile(refs.q, q_start, block_q, seq_len=q_seq,
                        head_dim=head_dim, group_index=head)
    do = tiles.load_tile(refs.do, q_start, block_q, seq_len=q_seq,
                         head_dim=head_dim, group_index=head)
    # Rows past the array read lse = +inf, hence p = 0, like empty rows.
    lse = tiles.load_row_stats(refs.lse, q_start, block_q, seq_len=q_seq,
                               other=jnp.inf, group_index=head)
    delta = tiles.load_row_stats(refs.delta, q_start, block_q, seq_len=q_seq,
                                 other=0.0, group_index=head)
    bias = tile_mask = None
    if refs.bias is not None:
      bias = dense.load_bias(refs.bias, q_start, block_q, k_start, block_k,
                             dense.leading_index(refs.bias, head))
    if refs.mask is not None:
      tile_mask = dense.load_mask(refs.mask, q_start, block_q, k_start,
                                  block_k, dense.leading_index(refs.mask, head))
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
  first_head = pl.program_id(2) * group if refs.modifier_refs() else None

  def head_step(head, carry):
    head_mods = kernel_inputs.load_head_modifiers(
        mods, refs, head=lambda: first_head + head)
    for lo, hi, needs_mask in blocks.runs():
      carry = lax.fori_loop(
          lo, hi, functools.partial(step, head=head, head_mods=head_mods,
                                    needs_mask=needs_mask),
          carry)
    return carry

  zeros = jnp.zeros((block_k, refs.k.shape[-1]), jnp.float32)
  dk, dv = lax.fori_loop(0, group, head_step, (zeros, zeros))
  tiles.store_tile(dk_ref, k_start, dk * scale, seq_len=kv_seq,
                   head_dim=head_dim)
  tiles.store_tile(dv_ref, k_start, dv, seq_len=kv_seq, head_dim=head_dim)


def dq_kernel(
    refs: KernelInputs, dq_ref, *,
    mask: MaskSpec, scale: float, soft_cap: float | None,
    block_q: int, block_k: int, head_dim: int, q_tile_axis: int = 0,
    mods: ModifierSpec = ModifierSpec(),
):
  head_mods = kernel_inputs.load_head_modifiers(
      mods, refs, head=lambda: pl.program_id(forward.head_axis(q_tile_axis)))
  q_seq, kv_seq = refs.q.shape[0], refs.k.shape[0]
  q_tile_index = forward.query_tile_index(mask, q_tile_axis, q_seq, block_q)
  q_len, kv_len = kernel_inputs.load_lengths(
      mask, refs.q_lengths, refs.kv_lengths, q_seq, kv_seq)
  offset = masks.causal_offset(mask, q_len, kv_len)
  q_start = q_tile_index * block_q
  rows = numerics.tile_rows(q_start, block_q)
  q = tiles.load_tile(refs.q, q_start, block_q, seq_len=q_seq,
                      head_dim=head_dim)
  do = tiles.load_tile(refs.do, q_start, block_q, seq_len=q_seq,
                       head_dim=head_dim)
  lse = tiles.load_row_stats(refs.lse, q_start, block_q, seq_len=q_seq,
                             other=jnp.inf)
  delta = tiles.load_row_stats(refs.delta, q_start, block_q, seq_len=q_seq,
                               other=0.0)
  q_ids = None
  if refs.q_segment_ids is not None:
    q_ids = kernel_inputs.load_ids(refs.q_segment_ids, q_start,
                                   block_q)[:, None]

  def step(k_tile_index, dq, *, needs_mask: bool):
    k_start = k_tile_index * block_k
    kv_ids = None
    if refs.kv_segment_ids is not None:
      kv_ids = kernel_inputs.load_ids(refs.kv_segment_ids, k_start,
                                      block_k)[None, :]
    seq_len = kv_seq if needs_mask else None
    k = tiles.load_tile(refs.k, k_start, block_k, seq_len=seq_len,
                        head_dim=head_dim)
    v = tiles.load_tile(refs.v, k_start, block_k, seq_len=seq_len,
                        head_dim=head_dim)
    bias = tile_mask = None
    if refs.bias is not None:
      bias = dense.load_bias(refs.bias, q_start, block_q, k_start, block_k)
    if refs.mask is not None:
      tile_mask = dense.load_mask(refs.mask, q_start, block_q, k_start,
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
                            offset, kernel_inputs.segment_range(refs))
  dq = jnp.zeros((block_q, refs.q.shape[-1]), jnp.float32)
  for lo, hi, needs_mask in blocks.runs():
    dq = lax.fori_loop(lo, hi, functools.partial(step, needs_mask=needs_mask),
                       dq)
  tiles.store_tile(dq_ref, q_start, dq * scale, seq_len=q_seq,
                   head_dim=head_dim)


def _compiler_params(config: TritonConfig):
  return plgpu.CompilerParams(num_warps=config.block_sizes.num_warps_bwd,
                              num_stages=config.block_sizes.num_stages_bwd)


def delta_call(o, do, *, config: TritonConfig):
  """delta = rowsum(dO * O): float32 [batch, num_heads, q_len]."""
  batch, q_seq, num_heads, head_dim = o.shape
  block_q = config.block_sizes.block_q_dq
  tile_spec = pl.BlockSpec((None, q_seq, None,
                            tiles.head_dim_padded(head_dim)),
                           lambda i, b, h: (b, 0, h, 0))
  return pl.pallas_call(
      functools.partial(delta_kernel, block_q=block_q, head_dim=head_dim),
      grid=(pl.cdiv(q_seq, block_q), batch, num_heads),
      in_specs=[tile_spec, tile_spec],
      out_specs=pl.BlockSpec((None, None, q_seq), lambda i, b, h: (b, h, 0)),
      out_shape=sharding.output_struct((batch, num_heads, q_seq),
                                       jnp.float32, o, do),
      compiler_params=_compiler_params(config),
      interpret=config.interpret,
      name="jflash_delta",
  )(o, do)


def dkv_call(operands: Operands, do, lse, delta, *, spec: CallSpec,
             config: TritonConfig):
  """dK and dV, each [batch, kv_len, num_kv_heads, head_dim] in k.dtype.

  Args:
    operands: as `forward.forward_call`'s.
    do: the output cotangent, [batch, q_len, num_heads, head_dim].
    lse: the forward's base-2 lse, float32 [batch, num_heads, q_len].
    delta: rowsum(dO * O) - dlse, float32 [batch, num_heads, q_len].
    spec: the call.
    config: tiles and launch options.
  """
  mods = spec.modifiers.for_backward()
  q, k = operands.query, operands.key
  batch, q_seq, num_heads, head_dim = q.shape
  kv_seq, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  block_q = config.block_sizes.block_q_dkv
  block_k = config.block_sizes.block_k_dkv
  head_dim_p = tiles.head_dim_padded(head_dim)
  # The query-side blocks hold a kv head's whole group of query heads.
  q_group_spec = pl.BlockSpec((None, q_seq, group, head_dim_p),
                              lambda j, b, g: (b, 0, g, 0))
  stats_group_spec = pl.BlockSpec((None, group, q_seq),
                                  lambda j, b, g: (b, g, 0))
  kv_spec = pl.BlockSpec((None, kv_seq, None, head_dim_p),
                         lambda j, b, g: (b, 0, g, 0))
  lengths_spec = pl.BlockSpec((batch,), lambda j, b, g: (0,))
  kernel = functools.partial(
      dkv_kernel, mask=spec.mask, scale=spec.scale,
      soft_cap=spec.logits_soft_cap, block_q=block_q, block_k=block_k,
      head_dim=head_dim, group=group, mods=mods)
  arrays = dict(q=q, k=k, v=operands.value, do=do, lse=lse, delta=delta,
                q_lengths=operands.q_lengths, kv_lengths=operands.kv_lengths)
  specs = dict(q=q_group_spec, k=kv_spec, v=kv_spec, do=q_group_spec,
               lse=stats_group_spec, delta=stats_group_spec,
               q_lengths=lengths_spec, kv_lengths=lengths_spec)
  # Per key tile, the query tiles its segments can meet.
  optional_arrays, optional_specs = kernel_inputs.optional_inputs(
      operands, mods, block_q=block_q, block_k=block_k, own_axis="kv",
      dense_spec=lambda x: dense.block_spec(x, batch, group=group))
  arrays.update(optional_arrays)
  specs.update(optional_specs)
  return pl.pallas_call(
      kernel,
      grid=(pl.cdiv(kv_seq, block_k), batch, num_kv_heads),
      in_specs=(KernelInputs(**specs),),
      out_specs=[kv_spec, kv_spec],
      out_shape=[sharding.output_struct(k.shape, k.dtype, arrays),
                 sharding.output_struct(operands.value.shape,
                                        operands.value.dtype, arrays)],
      compiler_params=_compiler_params(config),
      interpret=config.interpret,
      name="jflash_dkv",
  )(KernelInputs(**arrays))


def dq_call(operands: Operands, do, lse, delta, *, spec: CallSpec,
            config: TritonConfig):
  """dQ, [batch, q_len, num_heads, head_dim] in q.dtype; args as dkv_call."""
  mods = spec.modifiers.for_backward()
  q = operands.query
  batch, q_seq, num_heads, head_dim = q.shape
  kv_seq = operands.key.shape[1]
  block_q = config.block_sizes.block_q_dq
  block_k = config.block_sizes.block_k_dq
  grid, order, q_tile_axis = forward.query_tile_grid(
      pl.cdiv(q_seq, block_q), batch, num_heads, spec.mask.is_causal, kv_seq)
  kernel = functools.partial(
      dq_kernel, mask=spec.mask, scale=spec.scale,
      soft_cap=spec.logits_soft_cap, block_q=block_q, block_k=block_k,
      head_dim=head_dim, q_tile_axis=q_tile_axis, mods=mods)
  inputs, in_specs = forward.query_tile_inputs(
      operands, mods, block_q=block_q, block_k=block_k, order=order, do=do,
      lse=lse, delta=delta)
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=(in_specs,),
      out_specs=in_specs.q,
      out_shape=sharding.output_struct(q.shape, q.dtype, inputs),
      compiler_params=_compiler_params(config),
      interpret=config.interpret,
      name="jflash_dq",
  )(inputs)


def dbias_kernel(
    refs: KernelInputs, dbias_ref, *,
    mask: MaskSpec, scale: float, soft_cap: float | None,
    block_q: int, block_k: int, head_dim: int, group: int, batch_span: int,
    pair_heads: int, mask_span: int, mask_per_head: bool,
    mods: ModifierSpec = ModifierSpec(),
):
  # Whole-array refs: q, do [batch, q_seq, num_heads, head_dim_p]; k, v
  # [batch, kv_seq, num_kv_heads, head_dim_p]; lse, delta [batch, num_heads,
  # q_seq]; lengths [batch]; segment ids [batch, seq]; mask [mask_batch,
  # mask_heads, q_seq, kv_seq]; ALiBi slopes and dropout seeds [batch,
  # num_heads]. refs.bias and dbias_ref: this program's [q_seq, kv_seq]
  # slice.
  q_seq, kv_seq = refs.q.shape[1], refs.k.shape[1]
  q_start = pl.program_id(0) * block_q
  bias_batch, bias_head = pl.program_id(1), pl.program_id(2)
  rows = numerics.tile_rows(q_start, block_q)

  def pair_step(pair, dbias, *, k_start, bias):
    # The pair-th (batch, head) sharing this program's bias slice: batches
    # [bias_batch * batch_span, +batch_span) times `pair_heads` heads (all of
    # them for a bias shared by all heads, else this program's head).
    b = bias_batch * batch_span + lax.div(pair, pair_heads)
    h = bias_head if pair_heads == 1 else lax.rem(pair, pair_heads)
    q_len = plgpu.load(refs.q_lengths.at[b])
    kv_len = plgpu.load(refs.kv_lengths.at[b])
    q_ids = kv_ids = tile_mask = None
    if refs.q_segment_ids is not None:
      q_ids = kernel_inputs.load_ids(refs.q_segment_ids, q_start, block_q,
                                     b)[:, None]
      kv_ids = kernel_inputs.load_ids(refs.kv_segment_ids, k_start, block_k,
                                      b)[None, :]
    if refs.mask is not None:
      tile_mask = dense.load_mask(
          refs.mask, q_start, block_q, k_start, block_k,
          (lax.div(b, mask_span), h if mask_per_head else 0))
    load = functools.partial(tiles.load_tile, head_dim=head_dim,
                             batch_index=b)
    q = load(refs.q, q_start, block_q, seq_len=q_seq, group_index=h)
    do = load(refs.do, q_start, block_q, seq_len=q_seq, group_index=h)
    k = load(refs.k, k_start, block_k, seq_len=kv_seq,
             group_index=lax.div(h, group))
    v = load(refs.v, k_start, block_k, seq_len=kv_seq,
             group_index=lax.div(h, group))
    # Rows past q_len or the array have lse = +inf: p = 0 there.
    lse = tiles.load_row_stats(refs.lse, q_start, block_q, seq_len=q_seq,
                               other=jnp.inf, group_index=h, batch_index=b)
    delta = tiles.load_row_stats(refs.delta, q_start, block_q, seq_len=q_seq,
                                 other=0.0, group_index=h, batch_index=b)
    head_mods = None
    if refs.modifier_refs():  # ALiBi, dropout: the pair's own scalars.
      head_mods = kernel_inputs.load_head_modifiers(mods, refs, lambda: h,
                                                    batch_index=b)
    probs, _ = _probabilities(
        q, k, lse, scale=scale, soft_cap=soft_cap, rows=rows,
        k_start=k_start, block_k=block_k, mask=mask, kv_len=kv_len,
        offset=masks.causal_offset(mask, q_len, kv_len), needs_mask=True,
        q_ids=q_ids, kv_ids=kv_ids, bias=bias, tile_mask=tile_mask,
        head_mods=head_mods)
    dprobs = tiles.matmul(do, v, trans_b=True)
    dropout_scale = _dropout_scale(head_mods, rows, k_start, block_k)
    if dropout_scale is not None:
      dprobs = dprobs * dropout_scale
    return dbias + _logit_gradient(probs, dprobs, delta)

  def key_step(k_tile_index, carry):
    # Every key tile is visited and stored (invisible entries get 0): the
    # visible tiles differ between the batch elements summed here.
    k_start = k_tile_index * block_k
    bias = dense.load_bias(refs.bias, q_start, block_q, k_start, block_k)
    dbias = lax.fori_loop(
        jnp.int32(0), jnp.int32(batch_span * pair_heads),
        functools.partial(pair_step, k_start=k_start, bias=bias),
        jnp.zeros((block_q, block_k), jnp.float32))
    dense.store_tile(dbias_ref, q_start, k_start, dbias)
    return carry

  # Traced bounds on both loops (see masks._block_range on nested loops).
  lax.fori_loop(jnp.int32(0), jnp.int32(pl.cdiv(kv_seq, block_k)), key_step,
                jnp.int32(0))


def dbias_call(operands: Operands, do, lse, delta, *, spec: CallSpec,
               config: TritonConfig):
  """dL/d(bias) in the bias's shape and dtype; args as dkv_call."""
  q, k, bias = operands.query, operands.key, operands.bias
  batch, q_seq, num_heads, head_dim = q.shape
  kv_seq, num_kv_heads = k.shape[1], k.shape[2]
  block_q = config.block_sizes.block_q_dq
  block_k = config.block_sizes.block_k_dq
  head_dim_p = tiles.head_dim_padded(head_dim)
  whole = lambda shape: pl.BlockSpec(shape, lambda i, bb, hh: (0,) * len(
      shape))
  # The mask operands and the modifiers the backward applies (ALiBi,
  # dropout; sinks live in the lse), all as whole arrays.
  mods = spec.modifiers.for_backward()
  modifier_operands = kernel_inputs.modifier_operands(
      mods, operands.sinks, operands.alibi_slopes, operands.dropout_seeds)
  arrays = dict(**modifier_operands, q=q, k=k, v=operands.value, do=do,
                lse=lse, delta=delta, q_lengths=operands.q_lengths,
                kv_lengths=operands.kv_lengths,
                q_segment_ids=operands.q_segment_ids,
                kv_segment_ids=operands.kv_segment_ids, bias=bias,
                mask=operands.mask)
  specs = dict(q=whole((batch, q_seq, num_heads, head_dim_p)),
               k=whole((batch, kv_seq, num_kv_heads, head_dim_p)),
               v=whole((batch, kv_seq, num_kv_heads, head_dim_p)),
               do=whole((batch, q_seq, num_heads, head_dim_p)),
               lse=whole((batch, num_heads, q_seq)),
               delta=whole((batch, num_heads, q_seq)),
               q_lengths=whole((batch,)), kv_lengths=whole((batch,)),
               bias=pl.BlockSpec((None, None, q_seq, kv_seq),
                                 lambda i, bb, hh: (bb, hh, 0, 0)))
  if operands.q_segment_ids is not None:
    specs.update(q_segment_ids=whole((batch, q_seq)),
                 kv_segment_ids=whole((batch, kv_seq)))
  specs.update({name: None if x is None else whole(x.shape)
                for name, x in modifier_operands.items()})
  mask_span, mask_per_head = 1, False
  if operands.mask is not None:
    specs["mask"] = whole(operands.mask.shape)
    mask_span = dense.batch_span(operands.mask, batch)
    mask_per_head = operands.mask.shape[1] != 1
  kernel = functools.partial(
      dbias_kernel, mask=spec.mask, scale=spec.scale,
      soft_cap=spec.logits_soft_cap, block_q=block_q, block_k=block_k,
      head_dim=head_dim, group=num_heads // num_kv_heads,
      batch_span=dense.batch_span(bias, batch),
      pair_heads=1 if bias.shape[1] != 1 else num_heads,
      mask_span=mask_span, mask_per_head=mask_per_head, mods=mods)
  return pl.pallas_call(
      kernel,
      grid=(pl.cdiv(q_seq, block_q), bias.shape[0], bias.shape[1]),
      in_specs=(KernelInputs(**specs),),
      out_specs=specs["bias"],
      out_shape=sharding.output_struct(bias.shape, bias.dtype, arrays),
      compiler_params=_compiler_params(config),
      interpret=config.interpret,
      name="jflash_dbias",
  )(KernelInputs(**arrays))
