"""Per-head score modifiers: the math, shared by every backend.

Options that change the softmax but not which keys are visible
(`spec.ModifierSpec` says which are on):

- attention sinks (`sinks`, one natural-log logit per query head): an extra
  term exp(sink) in every row's softmax denominator, with no value vector.
  A forward pass starts each row's online softmax from it (row max = the
  sink, row sum = 1), so the stored lse includes it and the backward's
  recomputed probabilities need nothing more; only the forward reads the
  sinks. Their gradient comes from the lse and delta (`sinks_gradient`).
- ALiBi (`alibi_slopes`, one slope per (batch,) head): every logit gets the
  bias -slope * |t + offset - s| (natural-log units), offset being the
  causal alignment's (`masks.causal_offset`: 0 top-left, kv_len - q_len
  bottom-right). Computed from positions in every kernel, forward and
  backward; d(bias)/d(score) = 0, so the score gradient is unchanged.
- attention dropout (`dropout_rate`): each normalized probability is kept
  with probability 1 - rate and scaled by 1 / (1 - rate), after the softmax
  (the lse is unaffected). Keep bits come from `dropout.keep`, a hash of
  the (batch, head)'s two uint32 seeds and the element's position, so the
  forward and both backward kernels regenerate the same mask.

Each modifier is off by default and then adds no operand and no operation to
any kernel. How a kernel loads a head's scalars is the backend's business;
`HeadModifiers` takes them loaded. This module imports no Pallas backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jflash._src import dropout
from jflash._src import numerics
from jflash._src.spec import ModifierSpec


class HeadModifiers:
  """The modifiers of one query head, as a kernel program sees them.

  Built once per head (before the loop over tiles) from the head's scalars.
  """

  def __init__(self, spec: ModifierSpec, *, sink2=None, slope2=None,
               seeds=None):
    """Holds the head's scalars.

    Args:
      spec: the static modifiers.
      sink2: the head's sink in base 2 (times log2(e)), or None.
      slope2: the head's ALiBi slope in base 2, or None.
      seeds: the head's two uint32 dropout seeds, or None.
    """
    self.spec = spec
    self.sink2, self.slope2, self.seeds = sink2, slope2, seeds

  def dropout_keep(self, rows, cols):
    """bool [block_q, block_k]: the tile's dropout keep bits."""
    return dropout.keep(*self.seeds, rows, cols, self.spec.dropout_rate)

  def dropout_scale(self, rows, cols):
    """The tile's Z = keep / (1 - rate), float32 (the backward's factor)."""
    return jnp.where(self.dropout_keep(rows, cols),
                     1.0 / (1.0 - self.spec.dropout_rate), 0.0)

  def add_bias(self, logits, rows, cols, offset):
    """Base-2 logits of a tile plus the ALiBi bias (unchanged without).

    Args:
      logits: [block_q, block_k] base-2 logits.
      rows: absolute query positions, [block_q, 1].
      cols: absolute key positions, [1, block_k].
      offset: `masks.causal_offset(...)`: row t's diagonal is t + offset.
    """
    if self.slope2 is None:
      return logits
    diagonal = rows if isinstance(offset, int) and offset == 0 else (
        rows + offset)
    distance = jnp.abs((diagonal - cols).astype(jnp.float32))
    return logits - self.slope2 * distance

  def initial_row_stats(self, block_q: int):
    """Online-softmax start (row max, row sum), or None without sinks.

    With a sink the row starts as if it had seen one key of logit `sink`
    that contributes no value: max = sink, sum = exp2(sink - max) = 1.
    """
    if self.sink2 is None:
      return None
    return (jnp.full((block_q,), self.sink2, jnp.float32),
            jnp.ones((block_q,), jnp.float32))


def sinks_gradient(sinks, lse2, delta):
  """d loss / d sinks, float32 [batch, num_heads].

  The sink enters row t only through its normalizer: with
  p_sink = exp(sink - lse), d lse / d sink = p_sink and d p_c / d sink =
  -p_c p_sink, so d out_t / d sink = -p_sink out_t and the row contributes
  p_sink * (dlse_t - dO_t . O_t) = -p_sink * delta_t (delta already shifted
  by dlse). Rows with lse2 = +-inf (padding rows, or a -inf sink and no key)
  contribute 0.

  Args:
    sinks: float32 [batch, num_heads], natural-log.
    lse2: float32 [batch, num_heads, q_len], the base-2 lse.
    delta: float32 [batch, num_heads, q_len], rowsum(dO * O) - dlse.
  """
  p_sink = jnp.where(jnp.isinf(lse2), 0.0,
                     jnp.exp2(sinks[..., None] * numerics.LOG2_E - lse2))
  return -jnp.sum(p_sink * delta, axis=-1)


def per_head(x: jax.Array | None, batch: int, num_heads: int):
  """A per-head operand as the backends take it: float32 [batch, heads]."""
  if x is None:
    return None
  return jnp.broadcast_to(x.astype(jnp.float32), (batch, num_heads))
