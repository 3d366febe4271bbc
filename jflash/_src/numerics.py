"""Numerics shared by every backend: constants, the logit pipeline, the lse.

Softmax in base 2: a logit x (natural units) is kept as x * log2(e), so
exp(x) == exp2(x * log2(e)), and the stored log-sum-exp is base 2 ("lse2").
The residual every forward pass hands to every backward pass is the output
and lse2, float32 [batch, num_heads, q_len]; the public lse is natural-log,
[batch, q_len, num_heads] (jax.nn's layout).

This module imports no Pallas backend: kernels call these functions on tiles,
the XLA path on whole arrays.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LOG2_E = math.log2(math.e)

# Logits of masked entries. Finite on purpose: with -inf, a row whose tile is
# entirely masked would compute exp2(-inf - (-inf)) = NaN in the online-softmax
# correction. Any finite logit is far above this, so exp2(MASK_VALUE - m) is
# exactly 0 once the row has seen one visible key; kernels additionally zero
# masked probabilities explicitly, so rows with no visible key stay exact too.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def logits_base2(scores: jax.Array, *, scale: float,
                 soft_cap: float | None):
  """Base-2 logits of raw scores q.k (fp32).

  Without a cap: scale * log2(e) * scores. With `soft_cap`: the natural-unit
  logit is soft_cap * tanh(scale * scores / soft_cap) (Gemma 2's capping),
  also times log2(e). Returns (logits, tanh) where tanh is None without a
  cap; the backward needs it for d(logit)/d(score) = scale * (1 - tanh^2).
  """
  if soft_cap is None:
    return scores * (scale * LOG2_E), None
  capped = jnp.tanh(scores * (scale / soft_cap))
  return capped * (soft_cap * LOG2_E), capped


def tile_logits(scores, *, scale: float, soft_cap: float | None, bias=None,
                head_mods=None, rows=None, k_start=None, block_k=None,
                offset=0):
  """The logit pipeline of every kernel, forward and backward.

  logit = cap(scale * q.k) + bias + ALiBi, in base 2; masking is left to
  the caller (`masks.visible`), since the forward masks logits and the
  backward probabilities.

  Args:
    scores: fp32 [block_q, block_k] raw scores q.k.
    scale: logit scale.
    soft_cap: soft cap, or None.
    bias: the tile's dense bias (fp32, natural units), or None.
    head_mods: the head's `modifiers.HeadModifiers`, or None.
    rows: absolute query positions [block_q, 1] (for ALiBi).
    k_start: the tile's first key position (for the columns).
    block_k: the tile's width.
    offset: `masks.causal_offset(...)`, ALiBi's diagonal.

  Returns:
    (logits, tanh, cols): tanh as in `logits_base2`; cols the tile's absolute
    key positions [1, block_k] when a modifier needed them (ALiBi, dropout),
    else None (callers that mask compute them then).
  """
  logits, capped = logits_base2(scores, scale=scale, soft_cap=soft_cap)
  if bias is not None:
    logits = logits + bias * LOG2_E
  cols = None
  if head_mods is not None and head_mods.spec.uses_positions:
    cols = tile_columns(k_start, block_k)
    logits = head_mods.add_bias(logits, rows, cols, offset)
  return logits, capped, cols


def tile_columns(k_start, block_k: int):
  """Absolute key positions of a tile, int32 [1, block_k]."""
  return (k_start + jnp.arange(block_k, dtype=jnp.int32))[None, :]


def tile_rows(q_start, block_q: int):
  """Absolute query positions of a tile, int32 [block_q, 1]."""
  return (q_start + jnp.arange(block_q, dtype=jnp.int32))[:, None]


def natural_lse(lse2):
  """Stored base-2 lse [B, N, T] -> natural-log lse [B, T, N] (jax.nn's).

  Rows with no visible key: stored as +inf, returned as log(0) = -inf.
  """
  lse = jnp.where(jnp.isinf(lse2), -jnp.inf, lse2 * math.log(2.0))
  return jnp.swapaxes(lse, 1, 2)


def natural_lse_cotangent(dlse, lse2):
  """The cotangent of `natural_lse`'s output as the backward kernels take it:
  [B, T, N] -> [B, N, T], zero for rows without keys (whose p is 0)."""
  return jnp.where(jnp.isinf(lse2), 0.0, jnp.swapaxes(dlse, 1, 2))
