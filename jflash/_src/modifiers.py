"""Per-head score modifiers, shared by the forward and backward kernels.

Options that change the softmax but not which keys are visible:

- attention sinks (`sinks`, one natural-log logit per query head): an extra
  term exp(sink) in every row's softmax denominator, with no value vector.
  The forward starts each row's online softmax from it (row max = the sink,
  row sum = 1), so the stored lse includes it and the backward's recomputed
  probabilities need nothing more; only the forward reads the sinks.
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
any kernel (the default kernels' jaxprs are unchanged). Per-head operands
reach the kernels as float32 [batch, num_heads] arrays (batch axis first, as
`kernel_vjp.fold_vmap_into_batch` requires); a program reads its head's entry.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from jflash._src import dropout
from jflash._src import tiles


class Operands(NamedTuple):
  """The modifiers' arrays (None when off), batch axis first.

  Attributes:
    sinks: float32 [batch, num_heads], natural-log sink logits.
    slopes: float32 [batch, num_heads], ALiBi slopes.
    seeds: uint32 [batch, num_heads, 2], dropout seeds (dropout.seeds).
  """

  sinks: jax.Array | None = None
  slopes: jax.Array | None = None
  seeds: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class ModifierSpec:
  """Static part of the modifiers: which are on.

  Attributes:
    has_sinks: per-head attention sinks (forward kernel only).
    has_alibi: ALiBi position bias (all kernels).
    dropout_rate: attention dropout rate in [0, 1) (all kernels); 0: none.
  """

  has_sinks: bool = False
  has_alibi: bool = False
  dropout_rate: float = 0.0

  def for_backward(self) -> ModifierSpec:
    """The modifiers the backward kernels see (sinks live in the lse)."""
    return dataclasses.replace(self, has_sinks=False)

  @property
  def has_dropout(self) -> bool:
    return self.dropout_rate > 0.0

  @property
  def num_operands(self) -> int:
    return len(self.select(Operands(*([None] * len(Operands._fields)))))

  @property
  def uses_positions(self) -> bool:
    """Whether tiles need their column positions even where unmasked."""
    return self.has_alibi or self.has_dropout

  def select(self, operands: Operands) -> list[jax.Array | None]:
    """The kernel operands of these modifiers, in kernel order.

    All are [batch, num_heads]; the dropout seeds go as two uint32 arrays
    (a scalar load with a constant index on a trailing axis does not
    discharge in the interpreter).
    """
    result = []
    if self.has_sinks:
      result.append(operands.sinks)
    if self.has_alibi:
      result.append(operands.slopes)
    if self.has_dropout:
      seeds = operands.seeds
      result += [None, None] if seeds is None else [seeds[..., 0],
                                                    seeds[..., 1]]
    return result

  def operand_specs(self, num_heads: int,
                    order=lambda f: f) -> list[pl.BlockSpec]:
    """BlockSpecs of the operands: each program gets its batch row.

    Every jflash grid has the batch on axis 1; `order` adapts an index map
    written for (tile, batch, head) grids (`forward.query_tile_grid`).
    """
    return [pl.BlockSpec((None, num_heads), order(lambda i, b, h: (b, 0)))
            for _ in range(self.num_operands)]


class HeadModifiers:
  """The modifiers of one query head, as a kernel program sees them.

  Built once per head (before the loop over tiles), so per-head scalars are
  loaded from memory once.
  """

  def __init__(self, spec: ModifierSpec, refs, head: Callable[[], jax.Array]):
    """Loads the head's scalars.

    Args:
      spec: the static modifiers.
      refs: the modifier operand refs, in `ModifierSpec.select` order.
      head: returns the query head's index; only called (traced) when some
        modifier is on, so that the default kernels are unchanged.
    """
    refs = list(refs)
    self.spec = spec
    head = head() if refs else None
    # Both in base 2, like the kernels' logits.
    self.sink2 = self.slope2 = self.seeds = None
    if spec.has_sinks:
      self.sink2 = plgpu.load(refs.pop(0).at[head]) * tiles.LOG2_E
    if spec.has_alibi:
      self.slope2 = plgpu.load(refs.pop(0).at[head]) * tiles.LOG2_E
    if spec.has_dropout:
      self.seeds = (plgpu.load(refs.pop(0).at[head]),
                    plgpu.load(refs.pop(0).at[head]))

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
