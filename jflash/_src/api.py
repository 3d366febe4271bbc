"""The public function: validate, describe the call, dispatch."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal
import warnings

import jax
import jax.numpy as jnp

from jflash._src import backends  # noqa: F401 (registers the backends)
from jflash._src import binding
from jflash._src import dropout
from jflash._src import fp8
from jflash._src import modifiers
from jflash._src import registry
from jflash._src import validation
from jflash._src.backends.mosaic.config import MosaicBlockSizes
from jflash._src.backends.triton.block_sizes import BlockSizes
from jflash._src.spec import BackendOptions
from jflash._src.spec import CallSpec
from jflash._src.spec import Operands
from jflash._src.spec import describe_call


def flash_attention(
    query: jax.typing.ArrayLike,
    key: jax.typing.ArrayLike,
    value: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    mask: jax.typing.ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.typing.ArrayLike | None = None,
    key_value_seq_lengths: jax.typing.ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    block_sizes: BlockSizes | MosaicBlockSizes | None = None,
    interpret: bool = False,
    logits_soft_cap: float | None = None,
    causal_alignment: Literal["top_left", "bottom_right"] = "top_left",
    return_residual: bool = False,
    residual_dtype: jax.typing.DTypeLike | None = None,
    return_residuals: bool = False,
    q_segment_ids: jax.typing.ArrayLike | None = None,
    kv_segment_ids: jax.typing.ArrayLike | None = None,
    sinks: jax.typing.ArrayLike | None = None,
    alibi_slopes: jax.typing.ArrayLike | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    broadcast_dropout: bool = False,
    block_table: jax.typing.ArrayLike | None = None,
    q_descale: jax.typing.ArrayLike | None = None,
    k_descale: jax.typing.ArrayLike | None = None,
    v_descale: jax.typing.ArrayLike | None = None,
    out_dtype: jax.typing.DTypeLike | None = None,
    deterministic_grads: bool = True,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  r"""Exact scaled dot-product attention, a drop-in for jax.nn's.

  Computes `softmax(scale * Q K^T) V` per head without storing the
  [q_len, kv_len] matrix, forward or backward. Arguments, layout, defaults and
  the causal convention are those of `jax.nn.dot_product_attention`.

  Shapes use B = batch, T = query length, S = key/value length, N = query
  heads, K = key/value heads, H = head dim. With K < N (GQA; MQA when K = 1),
  query head n reads key/value head n // (N // K); K/V are never repeated.

  Causal alignment is top-left by default, as in jax.nn: query row t sees
  keys s <= t, also when T != S. `causal_alignment="bottom_right"` aligns the
  last query with the last key instead (FlashAttention's convention, and
  what a KV-cache prefill of T new tokens after S - T cached ones needs):
  row t sees s <= t + S - T, with the lengths in place of T and S when given.
  For T = 2, S = 4 (x = visible)::

      top_left    bottom_right
      x . . .     x x x .
      x x . .     x x x x

  Packed sequences: with `q_segment_ids` and `kv_segment_ids`, query t of
  batch element b sees key s only if q_segment_ids[b, t] ==
  kv_segment_ids[b, s], on top of every other mask (causal, window, lengths;
  positions are those of the packed arrays, so a causal mask applies within
  each segment when each segment's queries and keys sit at the same
  positions). The kernels never visit a key tile whose segment ids cannot
  equal any of a query tile's: per query tile (and per key tile in the
  dK/dV kernel), the range of tiles of the other axis whose [min, max]
  id intervals meet its own is computed on the host (cheap XLA, per batch
  element) and intersected with the causal, window and length bounds. The
  range is the exact first and last meeting tile when ids are sorted along
  the sequence (the usual packing) and a safe superset otherwise.

  Rows with no visible key (t >= query_seq_lengths[b],
  key_value_seq_lengths[b] == 0, outside every window, or whose segment has
  no key) output exactly 0 and pass zero gradients. jax.nn also zeroes rows
  past query_seq_lengths, but gives other rows without a visible key the
  mean of all values; jflash gives 0.

  Attention sinks (gpt-oss): with `sinks`, row t of head n computes
  `out_t = sum_s exp(x_ts) v_s / (exp(sinks[n]) + sum_s exp(x_ts))` over its
  visible keys s (x = the scaled, capped logits): a softmax over the logits
  and one extra logit that has no value vector. A row t < query_seq_lengths
  that sees no key then has a finite denominator: it outputs 0, its lse is
  sinks[n], and its sink takes a gradient from the lse only. Rows past
  query_seq_lengths stay empty (output 0, lse -inf, zero gradients).

  ALiBi: with `alibi_slopes`, logit (t, s) of head n gets the bias
  `-slopes[n] * |t + offset - s|`, computed in the kernels (no [T, S] array),
  after the soft cap. The offset is the alignment's, the diagonal of the
  causal mask and windows: 0 (top-left) or S - T
  (causal_alignment="bottom_right", per batch element with the lengths). For T = 2, S = 4, the bias / slope::

      top_left        bottom_right
      0 -1 -2 -3      -2 -1  0 -1
     -1  0 -1 -2      -3 -2 -1  0

  FlashAttention's `alibi_slopes` always use bottom-right positions; with
  causal_alignment="bottom_right" (or T == S) the two
  agree. On the keys a causal row sees (s <= t + offset) the bias is
  slope * (s - t - offset), a per-row constant plus slope * s: there the
  offset moves the lse, not the output.

  Attention dropout: with `dropout_rate` r > 0, each normalized probability
  p_ts is kept with probability 1 - r and scaled by 1 / (1 - r), dropped
  (0) otherwise, before the product with V; the lse is not affected (as in
  Flax's and jax's dropout on attention weights). The keep bits are a hash
  of two uint32 seeds per (batch element, head), drawn from `dropout_rng`,
  and of (t, s): the kernels never store the mask, the backward regenerates
  it, and the "xla" implementation drops exactly the same entries. Same key,
  same mask; under `vmap` each mapped key draws its own masks, as a loop
  would. The masks differ from Flax's `jax.random.bernoulli` ones
  (same distribution, other bits).

  FP8 (inference, forward only): q, k and v may all be float8_e4m3fn (or
  all float8_e5m2), each with a float32 descale per (batch element, kv
  head): the real value of an element is its FP8 value times its descale,
  q's descale applying to every query head of its kv head's group
  (FlashAttention-3's convention):
  query[b, t, n] * q_descale[b, n // (N // K)], key[b, s, k] *
  k_descale[b, k], value[b, s, k] * v_descale[b, k]. The result is the
  attention of those real values, every mask and option included, in
  `out_dtype` (bfloat16 by default); the returned lse is that of the
  dequantized logits. `jflash.quantize_qkv` produces such inputs.
  A backend whose capabilities list the FP8 dtype runs FP8 kernels (for
  float8_e4m3fn: "mosaic", and "decode", which reads an FP8 KV cache as
  it is); every other one (`jflash.implementations()`, column "fp8") runs
  the call dequantized:
  q, k and v times their descales, rounded to bfloat16 (a paged cache is
  gathered into a dense copy first), then its bfloat16 kernels. Dropout
  runs as in any forward. Differentiating an FP8 call, with respect to any
  argument, raises NotImplementedError; `jflash.ring_attention` does not
  take FP8 inputs.

  Args:
    query: [B, T, N, H] or unbatched [T, N, H].
    key: [B, S, K, H] or [S, K, H]; N must be a multiple of K.
    value: same shape and dtype as `key`.
    bias: as jax.nn: floating, broadcastable to [B, N, T, S] (rank <= 4,
      missing leading axes are 1); added to the logits in natural units
      after the soft cap: logits = cap(scale * q.k) + bias. Differentiable:
      its gradient is summed over the axes it broadcasts along, by a
      dedicated kernel that never forms a [B, N, T, S] array when the bias is
      broadcast over batch or heads. Size-1 T or S axes are broadcast
      before the kernels ([Bb, Nb, T, S]).
    mask: as jax.nn: boolean, True = attend, broadcastable to [B, N, T, S];
      combined (AND) with every other mask. Its tiles are read inside the
      kernels; it is never used to skip tiles (use is_causal, the lengths,
      local_window_size or segment ids for masks that should save work).
    scale: logit scale, a Python float; default 1 / sqrt(H).
    is_causal: apply the top-left causal mask.
    query_seq_lengths: integer [B]: rows t >= length output 0.
    key_value_seq_lengths: integer [B]: keys s >= length are masked out.
    local_window_size: as in jax.nn: (left, right), or one int for both;
      row t sees keys s with t - left <= s <= t + right (around the shifted
      diagonal with causal_alignment="bottom_right"). Key tiles outside the
      band are never visited.
    implementation: a backend of `jflash.implementations()`: "mosaic" for
      the Mosaic GPU kernels (Hopper: H100, H200); "triton" for the
      Pallas-Triton kernels (a CUDA GPU, or any machine with
      `interpret=True`); "xla" for the pure-JAX path (it materializes the
      attention matrix); "cudnn" for jax.nn's cuDNN path. None picks, for
      the forward and the backward pass separately, the first backend that
      supports the call and runs here by default: "mosaic" on Hopper, then
      "triton" on a CUDA GPU (or with `interpret=True` or a
      `jflash.BlockSizes`), "xla" elsewhere. A named backend that cannot run
      the forward of the call raises NotImplementedError saying why (one
      that cannot run its backward raises when it is differentiated).
    block_sizes: kernel tiles and launch parameters: a `jflash.BlockSizes`
      for the Triton kernels (default: the tiles `jflash.autotune` cached
      for this device and shape, else `jflash.default_block_sizes`), or a
      `jflash.MosaicBlockSizes` for the Mosaic GPU kernels (default: by
      head dim). Setting one restricts `implementation=None` to its
      backend.
    interpret: run the very same kernels through the Pallas interpreter (on
      any backend, slowly); used by the CPU test suite.
    logits_soft_cap: if set (a positive float), logits become
      cap * tanh(logits / cap) before the softmax (Gemma 2), in both passes.
    causal_alignment: "top_left" (default, jax.nn) or "bottom_right": where
      the rows sit, for the causal mask, windows and ALiBi alike (windows
      and ALiBi use it also with is_causal=False).
    return_residual: as jax.nn: also return each row's natural-log
      log-sum-exp of its (scaled, capped) logits, [B, T, N] ([T, N]
      unbatched), in the inputs' dtype (jax.nn's choice) unless
      `residual_dtype` says otherwise; -inf for rows with no visible key.
      Unlike jax.nn's (whose gradient is zero), it is differentiable, so
      partial attentions over key shards can be merged (ring attention):
      lse = logaddexp(lse_1, lse_2), out = sum_i out_i * exp(lse_i - lse).
      With `sinks`, the lse includes the sink term: log(exp(sinks[n]) +
      sum_s exp(x_ts)); to merge key shards, compute them without sinks and
      apply the sink once to the merged result.
    residual_dtype: the lse's dtype with return_residual=True; None: the
      inputs' (as jax.nn; FP8 inputs: out_dtype's). Pass jnp.float32 to
      merge 16-bit shards: a bfloat16 lse of magnitude 10 is off by up to
      0.03 (3% after exp).
    return_residuals: deprecated (DeprecationWarning): the same as
      `return_residual=True, residual_dtype=jnp.float32`.
    q_segment_ids: integer [B, T] ([T] for unbatched inputs), the segment of
      each query of packed sequences (only equality matters; compared as
      int32). Must be given together with `kv_segment_ids`.
    kv_segment_ids: integer [B, S] ([S] for unbatched inputs), the segment
      of each key/value.
    sinks: float [N], one learnable logit per query head, in natural-log
      units and not multiplied by `scale` (see above); differentiable. A
      sink of -inf is no sink. Default None: no sinks.
    alibi_slopes: float [N] or [B, N], ALiBi slopes, in natural-log units
      per position of distance (see above). Not differentiable:
      differentiating with respect to them raises NotImplementedError (pass
      `jax.lax.stop_gradient(slopes)` for slopes held as parameters).
    dropout_rate: a Python float in [0, 1); 0 (the default) is no dropout
      and compiles the same kernels as before dropout existed.
    dropout_rng: a `jax.random` key; required when dropout_rate > 0, ignored
      otherwise.
    broadcast_dropout: use one mask for every batch element and head
      (Flax's `broadcast_dropout=True`); default False: independent masks.
    block_table: a paged KV cache (forward only: differentiating raises
      NotImplementedError): `key` and `value` are pages [num_pages,
      page_size, K, H], page_size a multiple of 16, and block_table, int
      [B, max_pages], says where each sequence's keys live: position p of
      sequence b is row p % page_size of page block_table[b, p //
      page_size] (S = max_pages * page_size). Page ids are not checked when
      the call runs: an id outside [0, num_pages) for a position below the
      sequence's length is undefined behaviour, as in FlashAttention;
      table entries and cache rows at or past key_value_seq_lengths never
      affect the result. Not combinable with bias, mask, segment ids or
      dropout.
    q_descale: with FP8 q, k and v (required then, refused otherwise): a
      float array broadcastable to [B, K] (a scalar, [B, 1], [1, K] or
      [B, K]; unbatched inputs: a scalar or [K]), cast to float32: the
      scale of query head n's elements is q_descale[b, n // (N // K)]. Not
      differentiable.
    k_descale: as q_descale, for key (kv head k: k_descale[b, k]; with a
      paged cache, the pages sequence b reads).
    v_descale: as k_descale, for value.
    out_dtype: the output's dtype for FP8 inputs: bfloat16 (default),
      float16 or float32 (a float32 output of the dequantizing path holds
      the bfloat16 result). For other inputs only None or their dtype.
    deterministic_grads: True (the default): gradients are bitwise the
      same run after run (no kernel adds floats in a varying order; not
      Flax's `deterministic`, which turns dropout off). False lets a
      backend take such kernels where they are faster: today the Mosaic
      backward with 16-bit inputs, no `block_sizes` of the caller's, no
      GQA, at head dim 64 from 4096 queries and keys and at 128 from 16384
      adds dQ into float32 with reduce-adds from the dK/dV kernel (one
      kernel, 5 matrix products instead of 7; forward+backward on an H100
      1.07-1.10x faster at 2 x 4096 and 4 x 4096 x 16 heads of 64, 1.03x at
      1 x 16384, 1.01-1.03x causal; 1.03-1.06x at head dim 128 from 16k
      tokens); the last bits of dQ then vary between runs. Other calls are
      unchanged by it. (Deterministic calls at head dim 64 without a
      window or segment ids take the same one-kernel backward from 8192
      queries and keys, causal from 16384, adding dQ in int32 fixed point:
      exact in any order, 1.01-1.09x the two kernels there.)

  Returns:
    Array of `query`'s shape and dtype (FP8 inputs: `out_dtype`); with
    return_residual=True, the tuple (output, lse).

  Raises:
    ValueError: on inconsistent shapes, ranks, dtypes, lengths or options,
      before any kernel runs.
    NotImplementedError: for valid options the named backend does not
      support (e.g. head dim > 256 or float64 on the kernels, segment ids
      with implementation="cudnn"; the message says which backend lacks
      what), for higher-order derivatives through kernels, and for any
      derivative of an FP8 call.
  """
  return_residual, residual_dtype = residual_options(
      "flash_attention", return_residual, residual_dtype, return_residuals)
  call = describe(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, block_sizes=block_sizes,
      interpret=interpret, logits_soft_cap=logits_soft_cap,
      causal_alignment=causal_alignment, return_residual=return_residual,
      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      sinks=sinks, alibi_slopes=alibi_slopes, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout,
      block_table=block_table, q_descale=q_descale, k_descale=k_descale,
      v_descale=v_descale, out_dtype=out_dtype,
      deterministic_grads=deterministic_grads)
  lse_dtype = validation.check_residual_dtype(
      residual_dtype, call.spec.output_dtype, return_residual)
  return run(call, implementation, lse_dtype)


def run(call: DescribedCall, implementation: str | None, lse_dtype=None):
  """Runs a described call on the backends `registry.plan` chooses: the
  output, and with `call.spec.return_lse` the natural lse in `lse_dtype`
  (decode_attention shares it)."""
  plan = registry.plan(call.spec, implementation, call.options)
  spec = call.spec
  attend = functools.partial(_attend, spec, plan)
  if spec.is_fp8:
    # No backend has an FP8 backward (registry.unsupported_reason): a
    # derivative with respect to anything, descales included, raises here,
    # in forward and reverse mode alike.
    attend = binding.forward_only(attend, registry.FP8_FORWARD_ONLY)
  out, lse = attend(call.operands)
  out = out.astype(spec.output_dtype)
  if call.unbatched:
    out = out[0]
    lse = None if lse is None else lse[0]
  if not spec.return_lse:
    return out
  return out, lse.astype(lse_dtype)


def _attend(spec: CallSpec, plan: registry.Plan, operands: Operands):
  """(out, natural lse or None) of the call on the plan's backends."""
  if plan.dequantize:
    # An FP8 call on a backend without FP8 kernels (the plan says so): it
    # runs the dequantized call.
    spec = spec.dequantized()
    operands = fp8.dequantize_operands(operands, spec.dtype)
  if 0 in (spec.batch, spec.q_len, spec.kv_len, spec.num_heads):
    return _empty_call(operands)
  result = binding.attention(spec, plan, operands)
  return result if spec.return_lse else (result, None)


def residual_options(function: str, return_residual, residual_dtype,
                     return_residuals):
  """(return_residual, residual_dtype) with the deprecated
  `return_residuals=True` (a float32 lse) mapped onto them, warning once
  per call site."""
  if validation.check_bool(return_residuals, "return_residuals"):
    warnings.warn(
        f"jflash.{function}: return_residuals is deprecated; use "
        "return_residual=True (jax.nn's keyword), with "
        "residual_dtype=jnp.float32 for the float32 lse return_residuals "
        "gave.", DeprecationWarning, stacklevel=3)
    return True, jnp.float32 if residual_dtype is None else residual_dtype
  return return_residual, residual_dtype


@dataclasses.dataclass(frozen=True)
class DescribedCall:
  """A validated call: its spec, its operands (batched), the backend
  options the user set, and whether the inputs were unbatched."""

  spec: CallSpec
  operands: Operands
  options: BackendOptions
  unbatched: bool


def describe(query, key, value, bias=None, mask=None, *, scale=None,
             is_causal=False, query_seq_lengths=None,
             key_value_seq_lengths=None, local_window_size=None,
             block_sizes=None, interpret=False, logits_soft_cap=None,
             causal_alignment="top_left", return_residual=False,
             q_segment_ids=None, kv_segment_ids=None, sinks=None,
             alibi_slopes=None, dropout_rate=0.0, dropout_rng=None,
             broadcast_dropout=False, block_table=None, q_descale=None,
             k_descale=None, v_descale=None, out_dtype=None,
             deterministic_grads=True) -> DescribedCall:
  """Validates `flash_attention`'s arguments (same names and meaning) and
  describes the call; raises ValueError for bad input."""
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  validation.check_operands(query, key, value,
                            same_batch=block_table is None)
  descales, out_dtype = validation.check_fp8(
      query, key, dict(q_descale=q_descale, k_descale=k_descale,
                       v_descale=v_descale), out_dtype)
  block_table = validation.check_block_table(block_table, query, key)
  if block_table is not None:
    combined = [name for name, x in (
        ("bias", bias), ("mask", mask), ("q_segment_ids", q_segment_ids),
        ("dropout_rate", dropout_rate or None)) if x is not None]
    if combined:
      raise NotImplementedError(
          f"block_table (a paged cache) does not combine with "
          f"{', '.join(combined)}.")
  if block_sizes is not None and not isinstance(
      block_sizes, (BlockSizes, MosaicBlockSizes)):
    raise ValueError(f"block_sizes must be a jflash.BlockSizes (Triton "
                     f"kernels), a jflash.MosaicBlockSizes (Mosaic GPU "
                     f"kernels) or None; got {type(block_sizes).__name__}.")
  bias = validation.check_dense(bias, "bias", query, key)
  mask = validation.check_dense(mask, "mask", query, key)
  sinks = validation.check_sinks(sinks, query.shape)
  alibi_slopes = validation.check_alibi_slopes(alibi_slopes, query.shape)
  dropout_rate = validation.check_dropout(dropout_rate, dropout_rng,
                                          broadcast_dropout)
  is_causal = validation.check_bool(is_causal, "is_causal")
  interpret = validation.check_bool(interpret, "interpret")
  deterministic_grads = validation.check_bool(deterministic_grads,
                                              "deterministic_grads")
  return_residual = validation.check_bool(return_residual,
                                          "return_residual")
  bottom_right = validation.check_causal_alignment(causal_alignment)
  window = validation.check_window(local_window_size)
  logits_soft_cap = validation.check_soft_cap(logits_soft_cap)
  segment_ids = validation.check_segment_ids(q_segment_ids, kv_segment_ids,
                                             query, key)
  unbatched = query.ndim == 3
  if unbatched:
    query, key, value = query[None], key[None], value[None]
    segment_ids = tuple(ids[None] for ids in segment_ids)
  batch, q_seq, num_heads, head_dim = query.shape
  kv_seq = key.shape[1] * (1 if block_table is None else block_table.shape[1])
  scale = (1.0 / math.sqrt(head_dim) if scale is None
           else validation.check_static_float(scale, "scale"))
  per_head = functools.partial(modifiers.per_head, batch=batch,
                               num_heads=num_heads)
  operands = Operands(
      query, key, value,
      q_lengths=validation.check_lengths(
          query_seq_lengths, "query_seq_lengths", batch, q_seq),
      kv_lengths=validation.check_lengths(
          key_value_seq_lengths, "key_value_seq_lengths", batch, kv_seq),
      q_segment_ids=segment_ids[0] if segment_ids else None,
      kv_segment_ids=segment_ids[1] if segment_ids else None,
      bias=bias, mask=mask, sinks=per_head(sinks),
      alibi_slopes=per_head(alibi_slopes),
      dropout_seeds=dropout.seeds(dropout_rng, batch, num_heads,
                                  bool(broadcast_dropout))
      if dropout_rate else None,
      block_table=block_table, q_descale=descales[0], k_descale=descales[1],
      v_descale=descales[2])
  spec = describe_call(
      operands, scale=scale, is_causal=is_causal, bottom_right=bottom_right,
      window=window, logits_soft_cap=logits_soft_cap,
      dropout_rate=dropout_rate, return_lse=return_residual,
      out_dtype=out_dtype, deterministic_grads=deterministic_grads)
  # Backend options; those set restrict the choice to backends that take
  # them (registry.plan).
  options = BackendOptions(block_sizes=block_sizes, interpret=interpret)
  return DescribedCall(spec=spec, operands=operands, options=options,
                       unbatched=unbatched)


def unsupported_reason(query, key, value, bias=None, mask=None, *,
                       implementation: str, residual_dtype=None,
                       return_residuals=False, passes=registry.PASSES,
                       **kwargs) -> str | None:
  """Why the named backend cannot run this `flash_attention` call (any of
  `passes`, default both), in one sentence, or None if it can. Arguments as
  flash_attention; raises ValueError for bad input. (The test suite skips
  with it.)"""
  del residual_dtype  # Only casts the returned lse.
  if return_residuals:
    kwargs["return_residual"] = True
  call = describe(query, key, value, bias, mask, **kwargs)
  backend = registry.get(implementation)
  for pass_ in passes:
    reason = registry.unsupported_reason(backend, call.spec, pass_,
                                         call.options.given())
    if reason is not None:
      return reason
  return None


def _empty_call(operands: Operands):
  """(out, lse) of a call with nothing to attend to (or nothing asked):
  every row is empty; rows before q_len with sinks have the sink as lse."""
  query = operands.query
  batch, q_seq, num_heads, _ = query.shape
  out = jnp.zeros(query.shape, query.dtype)
  lse = jnp.full((batch, q_seq, num_heads), -jnp.inf, jnp.float32)
  if operands.sinks is not None:
    q_lens, _ = operands.lengths()
    valid = jnp.arange(q_seq)[None, :, None] < q_lens[:, None, None]
    lse = jnp.where(valid, operands.sinks[:, None, :], lse)
  return out, lse


def implementations() -> list[dict]:
  """The attention backends jflash has, in the order it prefers them.

  `implementation=None` picks, per pass (forward, backward), the first one
  that supports the call and may run here by default; naming one forces it
  for both passes (a named backend that cannot run the backward of a call
  still runs its forward: differentiating it then raises
  NotImplementedError).

  Returns:
    One dict per backend: "name"; "available" (runs on this machine without
    `interpret`); "default_here" (may be picked by implementation=None
    here); "arguments" (the backend-specific keyword arguments it takes,
    e.g. block_sizes); "passes", "dtypes", "max_head_dim",
    "mask_features", "options", "unsupported_together" ((pass, features)
    it cannot combine),
    "platforms", "interpretable", "fallback_on" (platforms where it is
    chosen only for what no other backend runs, with a warning) and
    "named_only" (chosen only when named).
  """
  return registry.implementations()
