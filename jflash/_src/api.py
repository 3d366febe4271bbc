"""The public function: validates, fills defaults, dispatches."""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jflash._src import autotune
from jflash._src import dropout
from jflash._src import kernel_vjp
from jflash._src import modifiers
from jflash._src import platform
from jflash._src import reference
from jflash._src.block_sizes import BlockSizes
from jflash._src.block_sizes import default_block_sizes
from jflash._src.forward import KernelConfig

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                    jnp.dtype(jnp.float16))
IMPLEMENTATIONS = ("triton", "xla")


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
    implementation: Literal["triton", "xla"] | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    logits_soft_cap: float | None = None,
    causal_alignment: Literal["top_left", "bottom_right"] = "top_left",
    return_residuals: bool = False,
    q_segment_ids: jax.typing.ArrayLike | None = None,
    kv_segment_ids: jax.typing.ArrayLike | None = None,
    sinks: jax.typing.ArrayLike | None = None,
    alibi_slopes: jax.typing.ArrayLike | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    broadcast_dropout: bool = False,
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
  after the soft cap. The offset is the causal alignment's, the diagonal of
  the causal mask and windows: 0 (top-left; always when is_causal=False) or
  S - T (causal with causal_alignment="bottom_right", per batch element with
  the lengths). For T = 2, S = 4, the bias / slope::

      top_left        bottom_right
      0 -1 -2 -3      -2 -1  0 -1
     -1  0 -1 -2      -3 -2 -1  0

  FlashAttention's `alibi_slopes` always use bottom-right positions; with
  is_causal=True and causal_alignment="bottom_right" (or T == S) the two
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
    implementation: "triton" for the Pallas-Triton kernels (a CUDA GPU, or
      any machine with `interpret=True`); "xla" for the pure-JAX path (it
      materializes the attention matrix); None picks "triton" on a CUDA GPU
      (or when `interpret=True`) and "xla" elsewhere.
    block_sizes: kernel tiles and launch parameters; default: the tiles
      `jflash.autotune` cached for this device and shape, else
      `jflash.default_block_sizes`.
    interpret: run the very same kernels through the Pallas interpreter (on
      any backend, slowly); used by the CPU test suite.
    logits_soft_cap: if set (a positive float), logits become
      cap * tanh(logits / cap) before the softmax (Gemma 2), in both passes.
    causal_alignment: "top_left" (default, jax.nn) or "bottom_right"; only
      used with is_causal=True.
    return_residuals: also return each row's natural-log log-sum-exp of its
      (scaled, capped) logits, float32 [B, T, N] (jax.nn's layout), -inf
      for rows with no visible key. It is differentiable, so partial
      attentions over key shards can be merged (ring attention):
      lse = logaddexp(lse_1, lse_2), out = sum_i out_i * exp(lse_i - lse).
    q_segment_ids: integer [B, T] ([T] for unbatched inputs), the segment of
      each query of packed sequences (only equality matters; compared as
      int32). Must be given together with `kv_segment_ids`.
    kv_segment_ids: integer [B, S] ([S] for unbatched inputs), the segment
      of each key/value.
      With `sinks`, the lse includes the sink term: log(exp(sinks[n]) +
      sum_s exp(x_ts)); to merge key shards, compute them without sinks and
      apply the sink once to the merged result.
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

  Returns:
    Array of `query`'s shape and dtype; with return_residuals=True, the
    tuple (output, lse).

  Raises:
    ValueError: on inconsistent shapes, ranks, dtypes, lengths or options,
      before any kernel runs.
    NotImplementedError: for valid options the kernels do not support yet
      (head dim > 256, dtypes other than float32 / bfloat16 / float16,
      `vmap` of a call with bias or mask) and for higher-order derivatives.
  """
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  _check_operands(query, key, value)
  bias = _check_dense(bias, "bias", query, key)
  mask = _check_dense(mask, "mask", query, key)
  sinks = _check_sinks(sinks, query.shape)
  alibi_slopes = _check_alibi_slopes(alibi_slopes, query.shape)
  dropout_rate = _check_dropout(dropout_rate, dropout_rng, broadcast_dropout)
  if bias is not None and (alibi_slopes is not None or dropout_rate > 0.0):
    # The dbias kernel recomputes p without the per-head modifiers.
    raise NotImplementedError(
        "flash_attention: `bias` together with `alibi_slopes` or "
        "`dropout_rate` > 0 is not supported yet (fold ALiBi into the bias "
        "instead).")
  if not isinstance(is_causal, (bool, np.bool_)):
    raise ValueError(f"is_causal must be a bool, got {is_causal!r}.")
  if not isinstance(interpret, (bool, np.bool_)):
    raise ValueError(f"interpret must be a bool, got {interpret!r}.")
  if not isinstance(return_residuals, (bool, np.bool_)):
    raise ValueError(
        f"return_residuals must be a bool, got {return_residuals!r}.")
  if causal_alignment not in ("top_left", "bottom_right"):
    raise ValueError("causal_alignment must be 'top_left' or 'bottom_right'; "
                     f"got {causal_alignment!r}.")
  bottom_right = bool(is_causal) and causal_alignment == "bottom_right"
  window = _check_window(local_window_size)
  if logits_soft_cap is not None:
    soft_cap = _check_static_float(logits_soft_cap, "logits_soft_cap")
    if soft_cap <= 0.0:
      raise ValueError(f"logits_soft_cap must be positive; got "
                       f"{logits_soft_cap!r}.")
    logits_soft_cap = soft_cap

  segment_ids = _check_segment_ids(q_segment_ids, kv_segment_ids, query, key)
  unbatched = query.ndim == 3
  if unbatched:
    query, key, value = query[None], key[None], value[None]
    segment_ids = tuple(ids[None] for ids in segment_ids)
  batch, q_seq, num_heads, head_dim = query.shape
  kv_seq = key.shape[1]
  scale = (1.0 / math.sqrt(head_dim) if scale is None
           else _check_static_float(scale, "scale"))
  q_lens = _check_lengths(query_seq_lengths, "query_seq_lengths", batch,
                          q_seq)
  kv_lens = _check_lengths(key_value_seq_lengths, "key_value_seq_lengths",
                           batch, kv_seq)
  use_kernels = _choose_implementation(implementation, interpret, block_sizes)
  per_head = lambda x: None if x is None else jnp.broadcast_to(
      x.astype(jnp.float32), (batch, num_heads))
  mods = modifiers.Operands(
      sinks=per_head(sinks), slopes=per_head(alibi_slopes),
      seeds=dropout.seeds(dropout_rng, batch, num_heads,
                          bool(broadcast_dropout)) if dropout_rate else None)

  lse = None
  if 0 in (batch, q_seq, kv_seq, num_heads):
    # Nothing to attend to (or nothing asked): every row is empty.
    out = jnp.zeros(query.shape, query.dtype)
    lse = jnp.full((batch, q_seq, num_heads), -jnp.inf, jnp.float32)
    if sinks is not None:  # Rows before q_len: the sink alone.
      valid = jnp.arange(q_seq)[None, :, None] < q_lens[:, None, None]
      lse = jnp.where(valid, mods.sinks[:, None, :], lse)
  elif use_kernels:
    if block_sizes is None:
      shape = dict(q_len=q_seq, kv_len=kv_seq, head_dim=head_dim,
                   dtype=query.dtype, is_causal=bool(is_causal),
                   device_kind=platform.device_kind())
      block_sizes = autotune.tuned_block_sizes(
          num_heads=num_heads, num_kv_heads=key.shape[2], **shape)
      if block_sizes is None:
        block_sizes = default_block_sizes(**shape)
    has_lengths = (query_seq_lengths is not None
                   or key_value_seq_lengths is not None)
    config = KernelConfig(scale=scale, is_causal=bool(is_causal),
                          block_sizes=block_sizes, interpret=bool(interpret),
                          has_lengths=has_lengths, bottom_right=bottom_right,
                          logits_soft_cap=logits_soft_cap, window=window,
                          has_segments=bool(segment_ids),
                          has_bias=bias is not None,
                          has_dense_mask=mask is not None,
                          modifiers=modifiers.ModifierSpec(
                              has_sinks=sinks is not None,
                              has_alibi=alibi_slopes is not None,
                              dropout_rate=dropout_rate))
    # Masks travel as int8 (the kernels compare bytes).
    dense_mask = None if mask is None else mask.astype(jnp.int8)
    kernels = (kernel_vjp.flash_attention_kernels_with_lse
               if return_residuals else kernel_vjp.flash_attention_kernels)
    result = kernels(query, key, value, q_lens, kv_lens, segment_ids, bias,
                     dense_mask, mods, config)
    out, lse = result if return_residuals else (result, None)
  else:
    result = reference.attention_reference(
        query, key, value, q_lens, kv_lens, scale=scale,
        is_causal=bool(is_causal), bottom_right=bottom_right,
        logits_soft_cap=logits_soft_cap, window=window,
        segment_ids=segment_ids or None, bias=bias, mask=mask,
        sinks=mods.sinks, alibi_slopes=mods.slopes,
        dropout_rate=dropout_rate, dropout_seeds=mods.seeds,
        return_lse=bool(return_residuals))
    out, lse = result if return_residuals else (result, None)
  if unbatched:
    out = out[0]
    lse = None if lse is None else lse[0]
  return (out, lse) if return_residuals else out


def _check_operands(query, key, value):
  shapes = f"query.shape={query.shape}, key.shape={key.shape}, " \
           f"value.shape={value.shape}"
  if query.ndim not in (3, 4) or key.ndim != query.ndim or \
      value.ndim != query.ndim:
    raise ValueError(
        "query, key and value must all be 4-D [batch, seq_len, num_heads, "
        f"head_dim] or all 3-D [seq_len, num_heads, head_dim]; got {shapes}.")
  if key.shape != value.shape:
    raise ValueError(f"key and value must have the same shape; got {shapes}.")
  if query.ndim == 4 and query.shape[0] != key.shape[0]:
    raise ValueError(f"query and key must have the same batch size; got "
                     f"{shapes}.")
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(f"query and key must have the same head_dim; got "
                     f"{shapes}.")
  num_heads, num_kv_heads = query.shape[-2], key.shape[-2]
  if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
    raise ValueError(
        f"The number of query heads ({num_heads}) must be a multiple of the "
        f"number of key/value heads ({num_kv_heads}); got {shapes}.")
  if not query.dtype == key.dtype == value.dtype:
    raise ValueError(
        f"query, key and value must have the same dtype; got "
        f"query.dtype={query.dtype}, key.dtype={key.dtype}, "
        f"value.dtype={value.dtype}.")
  if query.dtype not in SUPPORTED_DTYPES:
    names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
    raise NotImplementedError(
        f"flash_attention supports dtypes {names}; got {query.dtype}.")
  head_dim = query.shape[-1]
  if head_dim > MAX_HEAD_DIM:
    raise NotImplementedError(
        f"flash_attention supports head_dim <= {MAX_HEAD_DIM}; got "
        f"{head_dim=} ({shapes}).")
  if head_dim == 0:
    raise ValueError(f"head_dim must be positive; got {shapes}.")


def _check_sinks(sinks, query_shape):
  """Validates sinks: a float [num_heads] array, or None."""
  if sinks is None:
    return None
  sinks = jnp.asarray(sinks)
  num_heads = query_shape[-2]
  if sinks.shape != (num_heads,):
    raise ValueError(
        f"sinks must have shape (num_heads,) = ({num_heads},), one logit per "
        f"query head; got sinks.shape={sinks.shape} (query.shape="
        f"{query_shape}).")
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise ValueError(f"sinks must be a float array; got "
                     f"sinks.dtype={sinks.dtype}.")
  return sinks


def _check_alibi_slopes(slopes, query_shape):
  """Validates ALiBi slopes; returns them, not differentiable, or None."""
  if slopes is None:
    return None
  slopes = jnp.asarray(slopes)
  num_heads = query_shape[-2]
  shapes = [(num_heads,)]
  if len(query_shape) == 4:
    shapes.append((query_shape[0], num_heads))
  if slopes.shape not in shapes:
    expected = " or ".join(str(x) for x in shapes)
    raise ValueError(
        f"alibi_slopes must have shape (num_heads,) or (batch, num_heads) = "
        f"{expected}; got alibi_slopes.shape={slopes.shape} "
        f"(query.shape={query_shape}).")
  if not jnp.issubdtype(slopes.dtype, jnp.floating):
    raise ValueError(f"alibi_slopes must be a float array; got "
                     f"alibi_slopes.dtype={slopes.dtype}.")
  return _not_differentiable(slopes)


def _check_dropout(rate, rng, broadcast) -> float:
  """Validates the dropout options; returns the rate as a float."""
  rate = _check_static_float(rate, "dropout_rate")
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1); got {rate!r}.")
  if not isinstance(broadcast, (bool, np.bool_)):
    raise ValueError(
        f"broadcast_dropout must be a bool, got {broadcast!r}.")
  if rate == 0.0:
    return rate
  if rng is None:
    raise ValueError(f"dropout_rng (a jax.random key) is required when "
                     f"dropout_rate > 0; got {rate=} and dropout_rng=None.")
  rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
  typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
  if (typed and rng.shape != ()) or (not typed and (
      rng.dtype != jnp.uint32 or rng.ndim != 1)):
    raise ValueError(
        f"dropout_rng must be one jax.random key (jax.random.key(...), or a "
        f"raw uint32 jax.random.PRNGKey); got dropout_rng.shape={rng.shape}, "
        f"dropout_rng.dtype={rng.dtype}.")
  return rate


@jax.custom_jvp
def _not_differentiable(slopes):
  return slopes


@_not_differentiable.defjvp
def _not_differentiable_jvp(primals, tangents):
  del primals, tangents
  raise NotImplementedError(
      "flash_attention: alibi_slopes are not differentiable; wrap them in "
      "jax.lax.stop_gradient if they are parameters.")


def _check_static_float(value, name: str) -> float:
  """A float option known at trace time (kernels are compiled for it)."""
  if isinstance(value, (str, bytes, bool)):
    raise ValueError(f"{name} must be a Python float; got {value!r}.")
  try:
    result = float(value)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(
        f"{name} must be a Python float known at trace time; got {value!r}."
    ) from e
  if not math.isfinite(result):
    raise ValueError(f"{name} must be finite; got {value!r}.")
  return result


def _check_window(local_window_size) -> tuple[int, int] | None:
  """Validates local_window_size; returns (left, right) or None."""
  if local_window_size is None:
    return None
  window = local_window_size
  if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
    window = (window, window)
  if (not isinstance(window, (tuple, list)) or len(window) != 2
      or not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool)
                 and w >= 0 for w in window)):
    raise ValueError("local_window_size must be a non-negative int or a pair "
                     f"(left, right) of them; got {local_window_size!r}.")
  return int(window[0]), int(window[1])


def _check_dense(operand, name: str, query, key):
  """Validates `bias` or `mask`; returns None or [Bb, Nb, T, S].

  As jax.nn: rank <= 4, leading axes added as size 1, each axis 1 or the
  operands' (B, N, T, S) (B = 1 for unbatched operands). Size-1 query or key
  axes are broadcast here (materializing [Bb, Nb, T, S]); batch and head
  axes never are (the kernels index them).
  """
  if operand is None:
    return None
  operand = jnp.asarray(operand)
  batch = query.shape[0] if query.ndim == 4 else 1
  full = (batch, query.shape[-2], query.shape[-3], key.shape[-3])
  shapes = (f"{name}.shape={operand.shape}, query.shape={query.shape}, "
            f"key.shape={key.shape}")
  if operand.ndim > 4:
    raise ValueError(f"{name} must have at most 4 dimensions, broadcastable "
                     f"to [B, N, T, S] = {full}; got {shapes}.")
  operand = operand.reshape((1,) * (4 - operand.ndim) + operand.shape)
  if any(d not in (1, f) for d, f in zip(operand.shape, full)):
    raise ValueError(f"{name} must be broadcastable to [B, N, T, S] = {full} "
                     f"(each axis 1 or full); got {shapes}.")
  if name == "mask" and operand.dtype != jnp.bool_:
    raise ValueError(f"mask must be a boolean array (True = attend); got "
                     f"mask.dtype={operand.dtype}.")
  if name == "bias" and not jnp.issubdtype(operand.dtype, jnp.floating):
    raise ValueError(f"bias must be a floating-point array; got "
                     f"bias.dtype={operand.dtype}.")
  return jnp.broadcast_to(operand, operand.shape[:2] + full[2:])


def _check_segment_ids(q_segment_ids, kv_segment_ids, query, key):
  """Validates segment ids; returns () or the int32 pair (q_ids, kv_ids).

  Shapes are those of the (possibly unbatched) operands: [B, T] and [B, S],
  or [T] and [S].
  """
  if q_segment_ids is None and kv_segment_ids is None:
    return ()
  if q_segment_ids is None or kv_segment_ids is None:
    given, missing = (("q_segment_ids", "kv_segment_ids")
                      if kv_segment_ids is None
                      else ("kv_segment_ids", "q_segment_ids"))
    shape = jnp.shape(q_segment_ids if kv_segment_ids is None
                      else kv_segment_ids)
    raise ValueError(f"{given} (shape {shape}) was given without {missing}; "
                     "pass both or neither.")
  result = []
  for name, ids, operand, axis in (
      ("q_segment_ids", q_segment_ids, query, "T"),
      ("kv_segment_ids", kv_segment_ids, key, "S")):
    ids = jnp.asarray(ids)
    expected = operand.shape[:-2]
    dims = "[B, T]" if query.ndim == 4 else "[T]"
    dims = dims.replace("T", axis)
    if ids.shape != expected:
      raise ValueError(
          f"{name} must have shape {dims} = {expected}; got "
          f"{name}.shape={ids.shape} (query.shape={query.shape}, "
          f"key.shape={key.shape}).")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer array; got "
                       f"{name}.dtype={ids.dtype}.")
    result.append(ids.astype(jnp.int32))
  return tuple(result)


def _check_lengths(lengths, name: str, batch: int, seq_len: int):
  """Validates a lengths argument; returns int32 [batch] clipped to seq_len."""
  if lengths is None:
    return jnp.full((batch,), seq_len, jnp.int32)
  lengths = jnp.asarray(lengths)
  if lengths.shape != (batch,):
    raise ValueError(f"{name} must have shape (batch,) = ({batch},); got "
                     f"{name}.shape={lengths.shape}.")
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array; got "
                     f"{name}.dtype={lengths.dtype}.")
  return jnp.clip(lengths, 0, seq_len).astype(jnp.int32)


def _choose_implementation(implementation, interpret: bool,
                           block_sizes) -> bool:
  """Returns True for the Pallas kernels, False for the XLA path."""
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or "
                     f"None; got {implementation!r}.")
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a jflash.BlockSizes or None; got "
                     f"{type(block_sizes).__name__}.")
  if implementation == "xla":
    if interpret:
      raise ValueError("interpret=True runs the Triton kernels; it cannot be "
                       "combined with implementation='xla'.")
    if block_sizes is not None:
      raise ValueError("block_sizes configures the Triton kernels; it cannot "
                       "be combined with implementation='xla'.")
    return False
  if interpret or platform.cuda_gpu_available():
    return True
  if implementation == "triton":
    raise ValueError(
        "implementation='triton' needs a CUDA GPU, and JAX's default backend "
        f"is {jax.default_backend()!r}. Pass interpret=True to run the same "
        "kernels through the Pallas interpreter, or implementation='xla'.")
  if block_sizes is not None:
    raise ValueError("block_sizes configures the Triton kernels, which run "
                     "only on a CUDA GPU or with interpret=True.")
  return False
