"""The one mask description shared by the forward and backward kernels.

A query row `r` sees key column `c` when

    c < kv_len                      (key/value length of this batch element)
    and (not is_causal or c <= r)   (top-left causal alignment, as jax.nn)

Rows `r >= q_len` see nothing. The same predicate decides, per tile, which
tiles are visited at all (loop bounds) and which tiles need the element-wise
mask (the ones the predicate cuts through), so the forward and the two
backward kernels can never disagree about what is masked.

All bounds are computed inside kernels from traced `int32` scalars, so they
use `lax.div` and `jnp.minimum` rather than Python arithmetic.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """Static part of the mask.

  Attributes:
    is_causal: top-left causal mask.
    bottom_right: causal alignment (with is_causal): False for top-left
      (query row r sees keys c <= r, jax.nn's convention), True for
      bottom-right (c <= r + kv_len - q_len, FlashAttention's and KV-cache
      prefill's convention; rows with r + kv_len - q_len < 0 see nothing).
    has_lengths: whether per-batch lengths were given. Without them the
      lengths are the static array lengths, and every loop bound that does not
      depend on the program id is a compile-time constant (Triton pipelines
      constant-trip-count loops best).
  """

  is_causal: bool
  has_lengths: bool = True
  bottom_right: bool = False


def load_lengths(mask: MaskSpec, q_len_ref, kv_len_ref, q_seq: int,
                 kv_seq: int):
  """(q_len, kv_len) of this program's batch element (grid axis 1).

  The array lengths `q_seq`, `kv_seq` as Python ints when the call has no
  lengths, else traced int32 scalars read from the length arrays.
  """
  if not mask.has_lengths:
    return q_seq, kv_seq
  batch_index = pl.program_id(1)
  return (plgpu.load(q_len_ref.at[batch_index]),
          plgpu.load(kv_len_ref.at[batch_index]))


# Bound arithmetic that stays in Python while every operand is static.
def _static(*xs) -> bool:
  return all(isinstance(x, int) for x in xs)


def _cdiv(a, b: int):
  return -(-a // b) if _static(a) else lax.div(a + (b - 1), b)


def _div(a, b: int):
  return a // b if _static(a) else lax.div(a, b)


def _minimum(a, b):
  return min(a, b) if _static(a, b) else jnp.minimum(a, b)


def _maximum(a, b):
  return max(a, b) if _static(a, b) else jnp.maximum(a, b)


def _is_zero(x) -> bool:
  return isinstance(x, int) and x == 0


def _select(cond, a, b):
  if isinstance(cond, bool):
    return a if cond else b
  return jnp.where(cond, a, b)


def causal_offset(mask: MaskSpec, q_len, kv_len):
  """How far right of the diagonal a row sees: 0 (top-left) or S - T."""
  if not (mask.is_causal and mask.bottom_right):
    return 0
  return kv_len - q_len


def visible(mask: MaskSpec, rows: jax.Array, cols: jax.Array, kv_len,
            offset=0):
  """Element-wise visibility of a tile.

  Args:
    mask: the static mask description.
    rows: absolute query positions, shape [block_q, 1].
    cols: absolute key positions, shape [1, block_k].
    kv_len: key/value length of this batch element (traced int32 scalar).
    offset: `causal_offset(mask, q_len, kv_len)`.

  Returns:
    bool [block_q, block_k]: True where row may attend to column. Rows past
    `q_len` are not masked here: the kernels zero them through the stored
    log-sum-exp (see forward.py).
  """
  result = cols < kv_len
  if mask.is_causal:
    limit = rows if _is_zero(offset) else rows + offset
    result = jnp.logical_and(result, cols <= limit)
  return result


@dataclasses.dataclass(frozen=True)
class BlockRange:
  """Tiles to visit along one axis: [start, split) and [split, stop).

  Tiles in `[start, split)` are on one side of the mask boundary and tiles in
  `[split, stop)` on the other; which side needs element-wise masking is
  stated by the function that built the range.
  """

  start: jax.Array
  split: jax.Array
  stop: jax.Array


def _block_range(start, split, stop) -> BlockRange:
  """Bounds that are all Python ints, or all int32 scalars.

  A loop with constant bounds becomes a constant-trip-count loop; one with a
  traced bound must have all its bounds traced: on GPU, a `fori_loop` whose
  lower bound is a Python int and upper bound traced is not matched as a
  for-loop by the Pallas Triton lowering (it lost pipelining in the forward,
  and failed to lower inside the dK/dV kernel's loop over GQA heads).
  """
  if _static(start, split, stop):
    return BlockRange(start=start, split=split, stop=stop)
  start, split, stop = (jnp.asarray(x, jnp.int32) for x in (start, split, stop))
  return BlockRange(start=start, split=split, stop=stop)


def key_blocks_for_query_block(
    mask: MaskSpec, q_start, block_q: int, block_k: int, q_len, kv_len,
    offset=0,
) -> BlockRange:
  """Key tiles that a query tile must visit (forward and dQ kernels).

  Key tiles in `[0, split)` are fully visible to every row of the query tile
  (no element-wise mask needed); tiles in `[split, stop)` are cut by the mask.
  Key tiles at or past `stop` are invisible to every row and never visited.

  Args:
    mask: the static mask description.
    q_start: first query position of the tile (traced int32).
    block_q: query tile size.
    block_k: key tile size.
    q_len: query length of this batch element (int when static).
    kv_len: key/value length of this batch element (int when static).
    offset: `causal_offset(mask, q_len, kv_len)`.
  """
  visible_end = kv_len  # One past the last column any row of the tile sees.
  full_end = kv_len  # One past the last column every row of the tile sees.
  if mask.is_causal:
    if _is_zero(offset):
      visible_end = _minimum(visible_end, q_start + block_q)
      full_end = _minimum(full_end, q_start + 1)
    else:
      # Bottom-right: rows may see nothing at all (clamp at 0 tiles).
      visible_end = _maximum(_minimum(visible_end, q_start + block_q + offset),
                             0)
      full_end = _maximum(_minimum(full_end, q_start + 1 + offset), 0)
  stop = _cdiv(visible_end, block_k)
  if mask.has_lengths:
    # A query tile entirely past q_len has nothing to compute. (Without
    # lengths the grid holds no such tile.)
    stop = _select(q_start < q_len, stop, 0)
  split = _minimum(_div(full_end, block_k), stop)
  return _block_range(0, split, stop)


def query_blocks_for_key_block(
    mask: MaskSpec, k_start, block_k: int, block_q: int, q_len, kv_len,
    offset=0,
) -> BlockRange:
  """Query tiles that a key tile must visit (dK/dV kernel).

  Query tiles in `[start, split)` are cut by the mask (element-wise masking
  needed); tiles in `[split, stop)` see every column of the key tile. Query
  tiles outside `[start, stop)` see none of it and are never visited.

  Args:
    mask: the static mask description.
    k_start: first key position of the tile (traced int32).
    block_k: key tile size.
    block_q: query tile size.
    q_len: query length of this batch element (int when static).
    kv_len: key/value length of this batch element (int when static).
    offset: `causal_offset(mask, q_len, kv_len)`.
  """
  # Always traced bounds here (the dK/dV kernel reads the lengths from
  # memory): with static or literal bounds, this loop, nested in the loop over
  # GQA heads, hit a Pallas Triton lowering failure on JAX 0.11.2 ('i1' vs
  # 'i32' in the while-loop body). See WORKSPACE_NOTES.md.
  stop = _cdiv(q_len, block_q)
  if mask.is_causal:
    # Row r sees column c only if r + offset >= c: rows before
    # k_start - offset see nothing of the tile, rows from
    # k_start + block_k - 1 - offset on see all of it.
    first_row = k_start if _is_zero(offset) else jnp.maximum(
        k_start - offset, 0)
    start = jnp.minimum(lax.div(first_row, block_q), stop)
    last_col = k_start + block_k - 1
    split = _cdiv(last_col if _is_zero(offset) else jnp.maximum(
        last_col - offset, 0), block_q)
  else:
    start = jnp.int32(0)
    split = start
  # A key tile that crosses kv_len needs the element-wise mask everywhere; one
  # entirely past kv_len is visited by no query tile.
  split = jnp.where(k_start + block_k <= kv_len, split, stop)
  split = jnp.clip(split, start, stop)
  start = jnp.where(k_start < kv_len, start, stop)
  split = jnp.maximum(split, start)
  return _block_range(start, split, stop)
