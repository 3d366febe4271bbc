"""Dense `bias` and `mask` operands: how kernels see and read them.

Both are [bias_batch, bias_heads, q_len, kv_len] in HBM, where bias_batch is
1 or the batch and bias_heads 1 or the number of query heads (jax.nn's
broadcasting; the public function expands lower ranks and materializes
broadcasts along q_len / kv_len only). Broadcast batch and head axes are never
materialized: a kernel's BlockSpec picks the slice of its (batch, head) by an
index map that uses 0 on a broadcast axis, so every program sees a
[q_len, kv_len] (or, in the dK/dV kernel with per-head operands,
[group, q_len, kv_len]) ref and reads [block_q, block_k] tiles of it.

Masks travel as int8 (1 = attend): the kernels read and compare bytes.
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp


def batch_span(operand, batch: int) -> int:
  """How many consecutive batch elements share one slice of the operand."""
  return batch // operand.shape[0]


def block_spec(operand, batch: int, *, group: int | None = None,
               order=lambda f: f):
  """BlockSpec of a dense operand for grids (tile, batch, head).

  Args:
    operand: [bias_batch, bias_heads, q_len, kv_len].
    batch: the kernels' batch size (a multiple of bias_batch).
    group: None for grids over query heads (forward, dQ); the GQA group
      size for grids over key/value heads (dK/dV), whose programs then see
      the whole group's slices [group, q_len, kv_len] of a per-head operand.
    order: as `forward.query_tile_grid`'s, for grids in another axis order.
  """
  span = batch_span(operand, batch)
  per_head = operand.shape[1] != 1
  q_seq, kv_seq = operand.shape[2:]
  if group is not None and per_head:
    return pl.BlockSpec((None, group, q_seq, kv_seq),
                        lambda i, b, g: (b // span, g, 0, 0))
  return pl.BlockSpec(
      (None, None, q_seq, kv_seq),
      order(lambda i, b, h: (b // span, h if per_head else 0, 0, 0)))


def _tile_index(ref, q_start, block_q: int, k_start, block_k: int, leading):
  """Index and in-bounds mask of a [block_q, block_k] tile."""
  q_seq, kv_seq = ref.shape[-2:]
  rows = q_start + jnp.arange(block_q, dtype=jnp.int32)
  cols = k_start + jnp.arange(block_k, dtype=jnp.int32)
  inside = jnp.logical_and((rows < q_seq)[:, None], (cols < kv_seq)[None, :])
  # Python ints as scalar indices trip the interpreter's load rule: int32.
  leading = tuple(jnp.asarray(i, jnp.int32) for i in leading)
  return (*leading, pl.ds(q_start, block_q), pl.ds(k_start, block_k)), inside


def load_bias(ref, q_start, block_q: int, k_start, block_k: int,
              leading=()) -> jax.Array:
  """fp32 [block_q, block_k] tile of a bias ref; 0 outside the array.

  `leading`: indices of the ref's axes before [q_len, kv_len] (the head in
  a group, or (batch, head) for whole-array refs).
  """
  idx, inside = _tile_index(ref, q_start, block_q, k_start, block_k, leading)
  return plgpu.load(ref.at[idx], mask=inside, other=0).astype(jnp.float32)


def load_mask(ref, q_start, block_q: int, k_start, block_k: int,
              leading=()) -> jax.Array:
  """bool [block_q, block_k] tile of an int8 mask ref; False outside."""
  idx, inside = _tile_index(ref, q_start, block_q, k_start, block_k, leading)
  return plgpu.load(ref.at[idx], mask=inside, other=0) != 0


def store_tile(ref, q_start, k_start, value):
  """Stores a [block_q, block_k] tile into a [q_len, kv_len] ref."""
  idx, inside = _tile_index(ref, q_start, value.shape[0], k_start,
                            value.shape[1], ())
  plgpu.store(ref.at[idx], value.astype(ref.dtype), mask=inside)


def leading_index(ref, head):
  """Leading index of a dK/dV-kernel ref: the head for per-head operands."""
  return (head,) if ref.ndim == 3 else ()
