"""`jflash.decode_attention`: attention of a few new tokens to a KV cache.

Host side of decoding: validation, the query packing (GQA group x tokens as
the rows of one tile), the split count, the combine of the split partials
through their lse (with attention sinks as one more partial), and the XLA
path. The kernel is backends/triton/decode.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jflash._src import masks
from jflash._src import modifiers
from jflash._src import numerics
from jflash._src import platform
from jflash._src import validation
from jflash._src.backends.triton import decode as triton_decode
from jflash._src.spec import MaskSpec

MAX_NEW_TOKENS = 16
# The fewest key tiles a split is given.
MIN_TILES_PER_SPLIT = 4
# Programs per multiprocessor that fill a GPU (two resident per SM).
PROGRAMS_PER_SM = 2
IMPLEMENTATIONS = ("triton", "xla")


DecodeLaunch = triton_decode.DecodeLaunch
# The preferred launch, read when a call is traced (benchmarks/decode.py
# --sweep patches it); calls it does not fit take a fallback
# (`triton_decode.plan_launch`).
DEFAULT_LAUNCH = DecodeLaunch()


def default_num_splits(batch: int, num_kv_heads: int, kv_seq: int,
                       block_k: int | None = None) -> int:
  """Splits per (sequence, kv head): none when B x K programs already fill
  the GPU, else enough to fill it, with at least MIN_TILES_PER_SPLIT key
  tiles each (splits past a sequence's length do no work)."""
  slots = PROGRAMS_PER_SM * platform.multiprocessor_count()
  programs = batch * num_kv_heads
  if programs >= 0.8 * slots:
    return 1
  tiles = -(-kv_seq // (block_k or DEFAULT_LAUNCH.block_k))
  return max(1, min(-(-slots // programs), tiles // MIN_TILES_PER_SPLIT))


def _positions_mask(is_causal: bool, window) -> MaskSpec:
  """Query token t at position L - T + t: the bottom-right offset of
  `masks.visible`, applied to the window too (also without causality)."""
  return MaskSpec(is_causal=is_causal, has_lengths=True, bottom_right=True,
                  window=window)


PAGE_MULTIPLE = 16


def _check(query, key_cache, value_cache, lengths, block_table):
  """ValueError for bad shapes, before anything runs; returns the lengths
  (int32) and the block table (int32, or None)."""
  validation.check_operands(query, key_cache, value_cache,
                            same_batch=block_table is None)
  if query.ndim != 4:
    raise ValueError("decode_attention takes query [batch, new_tokens, "
                     f"num_heads, head_dim]; got query.shape={query.shape}.")
  batch, num_tokens = query.shape[:2]
  if not 1 <= num_tokens <= MAX_NEW_TOKENS:
    raise ValueError(
        f"decode_attention takes 1 to {MAX_NEW_TOKENS} new tokens per "
        f"sequence; got query.shape[1]={num_tokens}. For longer queries "
        "(prefill), use jflash.flash_attention with "
        "causal_alignment='bottom_right' and key_value_seq_lengths.")
  if block_table is not None:
    block_table = jnp.asarray(block_table)
    if (block_table.ndim != 2 or block_table.shape[0] != batch
        or not jnp.issubdtype(block_table.dtype, jnp.integer)):
      raise ValueError(
          "block_table must be an integer array [batch, max_pages] = "
          f"[{batch}, max_pages]; got shape {block_table.shape} and dtype "
          f"{block_table.dtype}.")
    page_size = key_cache.shape[1]
    if page_size % PAGE_MULTIPLE:
      raise ValueError(
          f"with block_table, key_cache is [num_pages, page_size, kv_heads, "
          f"head_dim] with page_size a multiple of {PAGE_MULTIPLE}; got "
          f"key_cache.shape={key_cache.shape}.")
    block_table = block_table.astype(jnp.int32)
  elif key_cache.shape[0] != batch:
    raise ValueError(f"key_cache.shape[0]={key_cache.shape[0]} must equal "
                     f"the query's batch {batch}.")
  lengths = jnp.asarray(lengths)
  if (lengths.shape != (batch,)
      or not jnp.issubdtype(lengths.dtype, jnp.integer)):
    raise ValueError(
        "key_value_seq_lengths must be an integer array of shape "
        f"({batch},); got shape {lengths.shape} and dtype {lengths.dtype}.")
  return lengths.astype(jnp.int32), block_table


def _pack(x, num_kv_heads: int, rows_padded: int):
  """[B, T, N, ...] -> [B, K, rows_padded, ...]: row r = t * g + j holds
  token t of query head kv * g + j; padding rows are zeros."""
  batch, num_tokens, num_heads = x.shape[:3]
  group = num_heads // num_kv_heads
  x = x.reshape(batch, num_tokens, num_kv_heads, group, *x.shape[3:])
  x = jnp.moveaxis(x, 2, 1).reshape(batch, num_kv_heads,
                                    num_tokens * group, *x.shape[4:])
  pad = [(0, 0), (0, 0), (0, rows_padded - num_tokens * group)]
  return jnp.pad(x, pad + [(0, 0)] * (x.ndim - 3))


def _unpack(x, num_tokens: int, num_heads: int):
  """The inverse of `_pack`: [B, K, M, ...] -> [B, T, N, ...]."""
  batch, num_kv_heads = x.shape[:2]
  group = num_heads // num_kv_heads
  x = x[:, :, :num_tokens * group]
  x = x.reshape(batch, num_kv_heads, num_tokens, group, *x.shape[3:])
  return jnp.moveaxis(x, 1, 2).reshape(batch, num_tokens, num_heads,
                                       *x.shape[4:])


def combine(out_parts, lse2_parts, sink2=None):
  """Merges split partials through their base-2 lse.

  Args:
    out_parts: float32 [P, ..., H], each split's normalized output.
    lse2_parts: float32 [P, ...], each split's lse (-inf: saw nothing).
    sink2: float32 [...] base-2 sink logits, a partial with no value, or
      None.

  Returns:
    (out [..., H], lse2 [...]); rows that saw nothing: 0 and -inf (with a
    sink: 0 and the sink).
  """
  lse2_all = lse2_parts if sink2 is None else jnp.concatenate(
      [lse2_parts, sink2[None]], axis=0)
  top = jnp.max(lse2_all, axis=0)
  # All -inf (nothing seen, no sink): weights of 0, never exp2(nan).
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  weights = jnp.exp2(lse2_all - top[None])
  total = jnp.sum(weights, axis=0)
  safe_total = jnp.where(total > 0.0, total, 1.0)
  out = jnp.sum(weights[:lse2_parts.shape[0], ..., None] * out_parts,
                axis=0) / safe_total[..., None]
  lse2 = jnp.where(total > 0.0, top + jnp.log2(safe_total), -jnp.inf)
  return out, lse2


def _gather_pages(cache, block_table):
  """[P, page_size, K, H] pages -> the dense [B, max_pages * page_size, K,
  H] cache of each sequence (the XLA path's copy)."""
  pages = cache[block_table]  # [B, max_pages, page_size, K, H].
  return pages.reshape(block_table.shape[0], -1, *cache.shape[2:])


def _xla_decode(query, key, value, lengths, block_table, sinks, slopes, *,
                mask, scale, soft_cap):
  """The XLA path: [B, N, T, S] logits in float32 (stores the scores)."""
  if block_table is not None:
    key, value = (_gather_pages(x, block_table) for x in (key, value))
  batch, num_tokens, num_heads, _ = query.shape
  kv_seq, num_kv_heads = key.shape[1:3]
  # Entries past a sequence's length count as zeros, whatever the cache
  # holds there (a zero probability times a NaN value would still be NaN).
  written = (jnp.arange(kv_seq)[None, :] < lengths[:, None])[:, :, None, None]
  key, value = (jnp.where(written, x, 0) for x in (key, value))
  group = num_heads // num_kv_heads
  dtype = jnp.promote_types(query.dtype, jnp.float32)
  k = jnp.repeat(key.astype(dtype), group, axis=2)
  v = jnp.repeat(value.astype(dtype), group, axis=2)
  scores = jnp.einsum("btnh,bsnh->bnts", query.astype(dtype), k,
                      precision=jax.lax.Precision.HIGHEST)
  logits, _ = numerics.logits_base2(scores, scale=scale, soft_cap=soft_cap)
  rows = jnp.arange(num_tokens)[None, None, :, None]
  cols = jnp.arange(kv_seq)[None, None, None, :]
  offset = (lengths - num_tokens)[:, None, None, None]
  if slopes is not None:
    distance = jnp.abs(rows + offset - cols).astype(dtype)
    logits = logits - (slopes * numerics.LOG2_E)[:, :, None, None] * distance
  # masks.visible on whole arrays (kv_len per batch element).
  seen = masks.visible(mask, rows, cols, lengths[:, None, None, None],
                       offset)
  logits = jnp.where(seen, logits, -jnp.inf)
  top = jnp.max(logits, axis=-1)
  if sinks is not None:
    top = jnp.maximum(top, (sinks * numerics.LOG2_E)[:, :, None])
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  probs = jnp.exp2(logits - top[..., None])
  total = jnp.sum(probs, axis=-1)
  if sinks is not None:
    total = total + jnp.exp2((sinks * numerics.LOG2_E)[:, :, None] - top)
  safe = jnp.where(total > 0.0, total, 1.0)
  out = jnp.einsum("bnts,bsnh->btnh", probs / safe[..., None], v,
                   precision=jax.lax.Precision.HIGHEST)
  lse2 = jnp.where(total > 0.0, top + jnp.log2(safe), -jnp.inf)
  return out.astype(query.dtype), jnp.swapaxes(lse2, 1, 2)


def kernel_attention(query, key, value, lengths, block_table, sinks, slopes,
                     *, mask, scale, soft_cap, num_splits, interpret,
                     positions_from_end=True, q_lengths=None):
  """The split-K kernel and the combine: (out [B, T, N, H], lse2 [B, T, N],
  -inf for rows that see nothing and have no sink)."""
  batch, num_tokens, num_heads, _ = query.shape
  num_kv_heads = key.shape[2]
  group = num_heads // num_kv_heads
  # Triton tiles: a power of two, at least 16 rows.
  rows_padded = max(triton_decode.MIN_ROWS,
                    1 << (num_tokens * group - 1).bit_length())
  plan = triton_decode.plan_launch(
      rows_padded, head_dim=query.shape[-1],
      itemsize=jnp.dtype(query.dtype).itemsize,
      device_kind=platform.device_kind(), preferred=DEFAULT_LAUNCH)
  per_row = lambda x: None if x is None else _pack(
      jnp.broadcast_to(x[:, None, :], (batch, num_tokens, num_heads)),
      num_kv_heads, rows_padded)
  # One split and no sink: the kernel's output is final (written in the
  # query dtype) and the combine is skipped.
  final = num_splits == 1 and sinks is None
  q_packed, slopes_packed = _pack(query, num_kv_heads, rows_padded), per_row(
      slopes)
  # The packed rows in launches of plan.rows rows (one launch if it fits).
  rows_of = lambda x, start: None if x is None else (
      x if plan.rows == rows_padded else x[:, :, start:start + plan.rows])
  parts = [
      triton_decode.decode_call(
          rows_of(q_packed, start), key, value, lengths,
          rows_of(slopes_packed, start), block_table, q_lengths, mask=mask,
          scale=scale, soft_cap=soft_cap, num_tokens=num_tokens, group=group,
          num_splits=num_splits, block_k=plan.launch.block_k,
          num_warps=plan.launch.num_warps,
          num_stages=plan.launch.num_stages,
          out_dtype=query.dtype if final else jnp.float32,
          interpret=interpret, positions_from_end=positions_from_end,
          row_offset=start)
      for start in range(0, rows_padded, plan.rows)]
  if len(parts) == 1:
    out_parts, lse2_parts = parts[0]
  else:  # Rows are axis 3 of [P, B, K, M, ...].
    out_parts, lse2_parts = (jnp.concatenate(x, axis=3)
                             for x in zip(*parts))
  if final:
    out, lse2 = out_parts[0], lse2_parts[0]
  else:
    sink2 = per_row(None if sinks is None else sinks * numerics.LOG2_E)
    out, lse2 = combine(out_parts, lse2_parts, sink2)
  return (_unpack(out, num_tokens, num_heads).astype(query.dtype),
          _unpack(lse2, num_tokens, num_heads))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _forward_only(run, *arrays):
  return run(*arrays)


def _forward_only_fwd(run, *arrays):
  return run(*arrays), None


def _forward_only_bwd(run, residuals, cotangent):
  del run, residuals, cotangent
  raise NotImplementedError(
      "jflash.decode_attention is forward only (inference); differentiate "
      "jflash.flash_attention instead.")


_forward_only.defvjp(_forward_only_fwd, _forward_only_bwd)


def decode_attention(query, key_cache, value_cache, key_value_seq_lengths,
                     *, block_table=None, scale=None, is_causal=True,
                     local_window_size=None, logits_soft_cap=None,
                     sinks=None, alibi_slopes=None, return_residuals=False,
                     num_splits=None, implementation=None, interpret=False):
  """Attention of T = 1..16 new tokens per sequence to a KV cache.

  Shapes: B batch, T new tokens, N query heads, K kv heads (N % K == 0;
  query head n reads kv head n // (N // K)), H head dim, S cache length.

  The cache holds L = key_value_seq_lengths[b] valid entries, the T new
  tokens' keys and values included, at positions L - T .. L - 1; query
  token t sits at position L - T + t. With `is_causal` it sees cache
  positions <= L - T + t (bottom-right alignment, as flash_attention with
  causal_alignment="bottom_right" and key_value_seq_lengths=L); without, all
  L entries. A sequence with L = 0 outputs 0.

  Args:
    query: [B, T, N, H], T in 1..16.
    key_cache, value_cache: dense [B, S, K, H]; or, with `block_table`,
      pages [num_pages, page_size, K, H], page_size a multiple of 16.
    key_value_seq_lengths: int [B], valid entries, in [0, S] (paged: S =
      max_pages * page_size).
    block_table: int [B, max_pages]: sequence b's cache position p lives
      in page block_table[b, p // page_size] at row p % page_size. Page ids
      are not checked when the call runs: an id outside [0, num_pages) for
      a position below the length is undefined behaviour (as in
      FlashAttention). Table entries and cache rows past a sequence's
      length never affect the result, whatever they hold (the kernel does
      not read them).
    scale: logit scale; default 1 / sqrt(H).
    is_causal: as above.
    local_window_size: (left, right) or one int: token t sees positions
      p with L - T + t - left <= p <= L - T + t + right (only those cache
      tiles are read).
    logits_soft_cap: cap * tanh(logits / cap), as flash_attention's.
    sinks: float [N] per-head sink logits, as flash_attention's.
    alibi_slopes: float [N]: logits minus slope * |position distance|.
    return_residuals: also return the natural-log lse, float32 [B, T, N]
      (-inf for rows that see nothing).
    num_splits: key splits per (sequence, kv head); default: enough to
      fill the GPU (`default_num_splits`). Any count gives the same result
      up to float32 rounding.
    implementation: "triton" (the split-K kernel; a CUDA GPU, or any
      machine with interpret=True), "xla" (stores [B, N, T, S] scores), or
      None: "triton" on a CUDA GPU or with interpret=True, else "xla".
    interpret: run the kernel through the Pallas interpreter.

  Returns:
    out [B, T, N, H] in query's dtype; with return_residuals, (out, lse).

  Raises:
    ValueError: bad shapes, dtypes, lengths, block table or page size,
      T > 16 (with a hint), bad options.
    NotImplementedError: when differentiated.
  """
  query, key_cache, value_cache = (
      jnp.asarray(x) for x in (query, key_cache, value_cache))
  lengths, block_table = _check(query, key_cache, value_cache,
                                key_value_seq_lengths, block_table)
  batch, num_tokens, num_heads, head_dim = query.shape
  kv_seq = key_cache.shape[1]
  if block_table is not None:
    kv_seq *= block_table.shape[1]  # Pages per sequence x page size.
  is_causal = validation.check_bool(is_causal, "is_causal")
  interpret = validation.check_bool(interpret, "interpret")
  window = validation.check_window(local_window_size)
  soft_cap = validation.check_soft_cap(logits_soft_cap)
  scale = (1.0 / math.sqrt(head_dim) if scale is None
           else validation.check_static_float(scale, "scale"))
  sinks = validation.check_sinks(sinks, query.shape)
  slopes = validation.check_alibi_slopes(alibi_slopes, query.shape)
  sinks, slopes = (modifiers.per_head(x, batch, num_heads)
                   for x in (sinks, slopes))
  if implementation is None:
    implementation = ("triton" if platform.cuda_gpu_available() or interpret
                      else "xla")
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or "
                     f"None; got {implementation!r}.")
  if num_splits is None:
    num_splits = default_num_splits(batch, key_cache.shape[2], kv_seq)
  elif not isinstance(num_splits, int) or num_splits < 1:
    raise ValueError(f"num_splits must be a positive int or None; got "
                     f"{num_splits!r}.")
  mask = _positions_mask(is_causal, window)
  options = dict(mask=mask, scale=scale, soft_cap=soft_cap)
  if implementation == "triton":
    run = functools.partial(kernel_attention, num_splits=num_splits,
                            interpret=interpret, **options)
  else:
    run = functools.partial(_xla_decode, **options)
  out, lse2 = _forward_only(run, query, key_cache, value_cache, lengths,
                            block_table, sinks, slopes)
  if not return_residuals:
    return out
  return out, jnp.where(jnp.isinf(lse2), -jnp.inf, lse2 * math.log(2.0))
