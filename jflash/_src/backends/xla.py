"""Pure-JAX attention with jflash's semantics: the "xla" backend.

It materializes the [batch, heads, q_len, kv_len] logits, so its memory is
quadratic in the sequence length; it exists for machines without a CUDA GPU
and as a readable statement of what the kernels compute. It differs from
`jax.nn.dot_product_attention` in one place only: a query row that sees no
key at all outputs 0 (jax.nn averages every value for such rows).

Run alone it is plain JAX (`direct`): JAX differentiates it, to any order
and in forward mode. It also serves either pass of a call whose other pass
runs elsewhere, through the binding's residual format (`forward`,
`backward`). It imports nothing from the kernel backends.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jflash._src import dropout
from jflash._src import modifiers
from jflash._src import numerics
from jflash._src import paged
from jflash._src import registry
from jflash._src.spec import CallSpec
from jflash._src.spec import Operands


def _masked_logits(q, k, q_lens, kv_lens, *, scale, is_causal, bottom_right,
                   logits_soft_cap, window, segment_ids, bias, mask,
                   alibi_slopes):
  """(logits, visible) of `attention_reference` (same arguments).

  logits: natural units, [batch, kv_heads, group, q_len, kv_len] in the
  accumulation dtype (`_accumulation`), MASK_VALUE where not visible;
  visible: bool, broadcastable to it.
  """
  batch, q_seq, num_heads, head_dim = q.shape
  kv_seq, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  # Query head h reads key/value head h // group: split heads as (kv, group).
  q = q.reshape(batch, q_seq, num_kv_heads, group, head_dim)
  # Logits, softmax and accumulation in float32 (float64 for float64
  # inputs, as jax.nn). float32 inputs get IEEE float32 products, as in the
  # kernels (a GPU's default for float32 is TF32, ~3e-4 relative error).
  acc, precision = _accumulation(q.dtype)
  logits = jnp.einsum("btkgd,bskd->bkgts", q, k, precision=precision,
                      preferred_element_type=acc) * scale
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)

  def grouped(x):  # [Bb, 1 or N, T, S] -> [Bb, 1 or K, 1 or G, T, S].
    if x.shape[1] == 1:
      return x[:, :, None]
    return x.reshape(x.shape[0], num_kv_heads, group, *x.shape[2:])

  if bias is not None:
    logits = logits + grouped(bias).astype(acc)
  # Masks are [batch or 1, q_len or 1, kv_len or 1]: explicit ranks, so the
  # path runs under jax_numpy_rank_promotion="raise".
  rows = jnp.arange(q_seq)[None, :, None]
  cols = jnp.arange(kv_seq)[None, None, :]
  visible = cols < kv_lens[:, None, None]
  offset = (kv_lens - q_lens)[:, None, None] if bottom_right else 0
  if alibi_slopes is not None:
    distance = jnp.abs(rows + offset - cols).astype(acc)
    logits = logits - (alibi_slopes.reshape(batch, num_kv_heads, group, 1, 1)
                       * jnp.broadcast_to(distance, (batch, q_seq, kv_seq))[
                           :, None, None])
  if is_causal:
    visible = jnp.logical_and(visible, cols <= rows + offset)
  if window is not None:
    visible = jnp.logical_and(visible, cols >= rows + offset - window[0])
    visible = jnp.logical_and(visible, cols <= rows + offset + window[1])
  if segment_ids is not None:
    q_ids, kv_ids = segment_ids
    visible = jnp.logical_and(visible,
                              q_ids[:, :, None] == kv_ids[:, None, :])
  visible = jnp.logical_and(visible, rows < q_lens[:, None, None])
  visible = visible[:, None, None]  # [batch, 1, 1, q_len, kv_len]
  if mask is not None:
    visible = jnp.logical_and(visible, grouped(mask))
  return jnp.where(visible, logits, numerics.MASK_VALUE), visible


def _accumulation(dtype):
  """(accumulation dtype, matmul precision) of inputs of `dtype`."""
  acc = jnp.promote_types(dtype, jnp.float32)
  precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
  return acc, precision


def attention_reference(q, k, v, q_lens, kv_lens, *, scale: float,
                        is_causal: bool, bottom_right: bool = False,
                        logits_soft_cap: float | None = None,
                        window: tuple[int, int] | None = None,
                        segment_ids: tuple[jax.Array, jax.Array] | None = None,
                        bias: jax.Array | None = None,
                        mask: jax.Array | None = None,
                        sinks=None, alibi_slopes=None,
                        dropout_rate: float = 0.0, dropout_seeds=None,
                        return_lse: bool = False):
  """Reference attention.

  Args:
    q: [batch, q_len, num_heads, head_dim].
    k: [batch, kv_len, num_kv_heads, head_dim].
    v: [batch, kv_len, num_kv_heads, head_dim].
    q_lens: int32 [batch], valid query rows per batch element.
    kv_lens: int32 [batch], valid keys per batch element.
    scale: logit scale.
    is_causal: causal mask; top-left (query row r sees keys c <= r) unless
      bottom_right (c <= r + kv_len - q_len, per batch element).
    bottom_right: causal alignment, see above.
    logits_soft_cap: if set, logits become cap * tanh(logits / cap).
    window: (left, right): row r sees keys within [r - left, r + right]
      around its (causally aligned) diagonal, as jax.nn's local_window_size.
    segment_ids: (q_ids int32 [batch, q_len], kv_ids int32 [batch, kv_len]):
      row r sees key c only if q_ids[b, r] == kv_ids[b, c].
    bias: [1 or batch, 1 or num_heads, q_len, kv_len], added to the (capped)
      logits.
    mask: bool, shaped as bias; False hides the entry.
    sinks: float32 [batch, num_heads] natural-log sink logits, or None: an
      extra exp(sink) term in the softmax denominator of every valid row
      (rows past q_len stay empty).
    alibi_slopes: float32 [batch, num_heads] or None: logit (r, c) gets
      -slope * |r + offset - c|, offset as for the causal mask, after the
      soft cap.
    dropout_rate: attention dropout rate; with it, dropout_seeds (uint32
      [batch, num_heads, 2]) select the kept probabilities (dropout.py, the
      kernels' very mask), which are scaled by 1 / (1 - rate).
    return_lse: also return the natural-log log-sum-exp of each row's
      visible logits, float32 [batch, q_len, num_heads] (-inf for rows
      with no visible key).

  Returns:
    [batch, q_len, num_heads, head_dim] in q.dtype, and the lse if asked.
  """
  batch, q_seq, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  acc, precision = _accumulation(q.dtype)
  logits, visible = _masked_logits(
      q, k, q_lens, kv_lens, scale=scale, is_causal=is_causal,
      bottom_right=bottom_right, logits_soft_cap=logits_soft_cap,
      window=window, segment_ids=segment_ids, bias=bias, mask=mask,
      alibi_slopes=alibi_slopes)
  kv_seq = k.shape[1]
  rows = jnp.arange(q_seq)[None, :, None]
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  if sinks is not None:
    # [batch, num_heads] -> [batch, kv_heads, group, 1, 1], like the logits.
    sinks = sinks.reshape(batch, num_kv_heads, group, 1, 1)
    row_max = jnp.maximum(row_max, sinks)
  row_max = jax.lax.stop_gradient(row_max)
  probs = jnp.where(visible, jnp.exp(logits - row_max), 0.0)
  row_sum = jnp.sum(probs, axis=-1, keepdims=True)
  if sinks is not None:
    valid_row = (rows < q_lens[:, None, None])[:, None, None]
    row_sum = row_sum + jnp.where(valid_row, jnp.exp(sinks - row_max), 0.0)
  safe_sum = jnp.where(row_sum > 0.0, row_sum, 1.0)
  probs = probs / safe_sum
  if dropout_rate:
    keep = dropout.keep_mask(dropout_seeds, q_seq, kv_seq, dropout_rate)
    keep = keep.reshape(batch, num_kv_heads, group, q_seq, kv_seq)
    probs = jnp.where(keep, probs * (1.0 / (1.0 - dropout_rate)), 0.0)
  out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v,
                   precision=precision,
                   preferred_element_type=acc)
  out = out.reshape(batch, q_seq, num_heads, head_dim).astype(q.dtype)
  if not return_lse:
    return out
  lse = jnp.where(row_sum > 0.0, row_max + jnp.log(safe_sum), -jnp.inf)
  # [batch, kv_heads, group, q_len, 1] -> [batch, q_len, num_heads].
  lse = jnp.moveaxis(lse[..., 0], -1, 1).reshape(batch, q_seq, num_heads)
  return out, lse


def direct(spec: CallSpec, config, operands: Operands):
  """The whole call in plain JAX: out, or (out, natural lse [B, T, N])."""
  del config
  q_lens, kv_lens = operands.lengths()
  ids = operands.q_segment_ids
  key, value = paged.dense_keys_values(operands)
  return attention_reference(
      operands.query, key, value, q_lens, kv_lens,
      scale=spec.scale, is_causal=spec.mask.is_causal,
      bottom_right=spec.mask.bottom_right,
      logits_soft_cap=spec.logits_soft_cap, window=spec.mask.window,
      segment_ids=None if ids is None else (ids, operands.kv_segment_ids),
      bias=operands.bias, mask=operands.mask, sinks=operands.sinks,
      alibi_slopes=operands.alibi_slopes,
      dropout_rate=spec.modifiers.dropout_rate,
      dropout_seeds=operands.dropout_seeds, return_lse=spec.return_lse)


def _with_lse(spec: CallSpec) -> CallSpec:
  return CallSpec(**{**spec.__dict__, "return_lse": True})


def forward(spec: CallSpec, config, operands: Operands):
  """(out, lse2): the residual format (numerics.py)."""
  out, lse = direct(_with_lse(spec), config, operands)
  lse2 = jnp.where(jnp.isinf(lse), jnp.inf, lse * (1.0 / math.log(2.0)))
  return out, jnp.swapaxes(lse2, 1, 2)


# Operands whose cotangent the backward differentiates for (the sinks'
# comes from the lse, `modifiers.sinks_gradient`).
_DIFFERENTIABLE = ("query", "key", "value", "bias")


def backward(spec: CallSpec, config, operands: Operands, out, lse2, dout,
             dlse=None):
  """Cotangents from the residuals, as the kernels compute them (but for
  one rounding: with 16-bit inputs the probabilities enter P V in the input
  dtype, so autodiff rounds dP to it too, where the kernels keep dP in
  float32; ~5e-3 relative in bf16, as the autodiff path before).

  The probabilities come from the given base-2 lse, p = exp(logit - lse),
  and delta = rowsum(dO * O) - dlse from the given output (FlashAttention-2's
  backward: dS = p * (dP - delta), dV = p^T dO). Nothing is renormalized
  here, so the residuals may be those of a larger call than this one: ring
  attention (ring.py) passes the output and lse of whole rows, merged over
  every key shard, with one shard's keys, and gets that shard's share of
  the gradients. In plain JAX this is the gradient of the surrogate

      F = <dO, P_kept V> - <delta, rowsum P>,  P = exp(logits - lse),

  lse and delta held constant (P_kept: P after dropout): dF/dlogits = dS
  (dropout: P * (keep * dP / (1 - rate) - delta)), dF/dV = P_kept^T dO.

  Args:
    spec: the call.
    config: unused (the backend has none).
    operands: the call's operands.
    out: [B, T, N, H], the forward's output (the row's, merged, for a key
      shard).
    lse2: float32 [B, N, T], its base-2 lse, +inf for rows without keys.
    dout: [B, T, N, H], the output's cotangent.
    dlse: the natural lse's cotangent as `numerics.natural_lse_cotangent`
      gives it ([B, N, T], zero on rows without keys), or None.

  Returns:
    `Operands` of cotangents: query, key, value, bias and sinks (None where
    absent).
  """
  del config
  q, k = operands.query, operands.key
  batch, q_seq, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  acc, precision = _accumulation(q.dtype)
  # delta in the accumulation dtype, from the stored (rounded) output, as
  # the kernels compute it.
  delta = jnp.swapaxes(jnp.sum(dout.astype(acc) * out.astype(acc), -1), 1, 2)
  if dlse is not None:
    delta = delta - dlse.astype(acc)
  per_row = lambda x: x.reshape(batch, num_kv_heads, group, q_seq)
  # Natural lse; +inf (no visible key) stays +inf, so such rows get p = 0.
  lse = per_row(lse2.astype(acc) * math.log(2.0))[..., None]
  dout_grouped = dout.astype(acc).reshape(batch, q_seq, num_kv_heads, group,
                                          head_dim)
  q_lens, kv_lens = operands.lengths()
  ids = operands.q_segment_ids
  rate = spec.modifiers.dropout_rate

  def surrogate(arrays):
    logits, visible = _masked_logits(
        arrays["query"], arrays["key"], q_lens, kv_lens, scale=spec.scale,
        is_causal=spec.mask.is_causal, bottom_right=spec.mask.bottom_right,
        logits_soft_cap=spec.logits_soft_cap, window=spec.mask.window,
        segment_ids=None if ids is None else (ids, operands.kv_segment_ids),
        bias=arrays.get("bias"), mask=operands.mask,
        alibi_slopes=operands.alibi_slopes)
    probs = jnp.where(visible, jnp.exp(logits - lse), 0.0)
    kept = probs
    if rate:
      keep = dropout.keep_mask(operands.dropout_seeds, q_seq, k.shape[1],
                               rate).reshape(probs.shape)
      kept = jnp.where(keep, probs * (1.0 / (1.0 - rate)), 0.0)
    weighted = jnp.einsum("bkgts,bskd->btkgd", kept.astype(k.dtype),
                          arrays["value"], precision=precision,
                          preferred_element_type=acc)
    return (jnp.sum(weighted * dout_grouped)
            - jnp.sum(jnp.sum(probs, axis=-1) * per_row(delta)))

  present = {name: getattr(operands, name) for name in _DIFFERENTIABLE
             if getattr(operands, name) is not None}
  grads = jax.grad(surrogate)(present)
  dsinks = None
  if operands.sinks is not None:
    dsinks = modifiers.sinks_gradient(
        operands.sinks, lse2, delta).astype(operands.sinks.dtype)
  return Operands(query=grads["query"], key=grads["key"],
                  value=grads["value"], bias=grads.get("bias"), sinks=dsinks)


BACKEND = registry.Backend(
    name="xla",
    capabilities=registry.Capabilities(
        passes=frozenset(registry.PASSES),
        dtypes=("float32", "bfloat16", "float16", "float64"),
        max_head_dim=None,
        mask_features=frozenset(registry.MASK_FEATURES),
        options=frozenset(registry.OPTIONS),
        platforms=None,
    ),
    # Quadratic memory: on a CUDA GPU, chosen only for what no kernel
    # backend runs (with a warning), or when named.
    role=lambda where: (registry.FALLBACK if where == "cuda"
                        else registry.DEFAULT),
    limits=("stores the [q_len, kv_len] scores (memory quadratic); paged "
            "caches in the forward pass only"),
    configure=lambda spec: None,
    forward=forward,
    backward=backward,
    differentiable=True,
    direct=direct,
)
