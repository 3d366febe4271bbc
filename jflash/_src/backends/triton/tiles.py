"""Building blocks of the Triton kernels: tile loads and stores, the matmul.

Kernels see refs laid out as [seq_len, head_dim_padded] (or with a head-group
axis in the middle, [seq_len, group, head_dim_padded], for the dK/dV kernel).
The head dimension is padded to a power of two (Triton tiles must be powers of
two); the padding columns are never read from or written to memory: loads
mask them to zero and stores mask them out. Rows past the end of the array
are handled the same way, so any sequence length works without padding the
inputs in HBM.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp


def _index(start, size: int, group_index, batch_index=None):
  leading = () if batch_index is None else (batch_index,)
  if group_index is None:
    return (*leading, pl.ds(start, size), slice(None))
  return (*leading, pl.ds(start, size), group_index, slice(None))


def _mask(start, size: int, seq_len: int | None, head_dim: int,
          head_dim_padded: int):
  """Mask of in-bounds elements of a [size, head_dim_padded] tile, or None."""
  mask = None
  if seq_len is not None:
    rows = start + jnp.arange(size, dtype=jnp.int32)
    mask = (rows < seq_len)[:, None]
  if head_dim < head_dim_padded:
    cols = (jnp.arange(head_dim_padded, dtype=jnp.int32) < head_dim)[None, :]
    mask = cols if mask is None else jnp.logical_and(mask, cols)
  if mask is not None:
    mask = jnp.broadcast_to(mask, (size, head_dim_padded))
  return mask


def load_tile(ref, start, size: int, *, seq_len: int | None, head_dim: int,
              group_index=None, batch_index=None):
  """Loads rows [start, start + size) of a [seq, (group,) head_dim_p] ref.

  Args:
    ref: the kernel ref.
    start: first row (traced int32).
    size: number of rows (static).
    seq_len: rows at or past it read as 0; None when the caller knows the
      whole tile is in bounds (this drops the row mask from the load).
    head_dim: the true head dimension; padding columns read as 0.
    group_index: index into the middle (head-group) axis, if the ref has one.
    batch_index: index into a leading batch axis (whole-array refs).
  """
  head_dim_padded = ref.shape[-1]
  mask = _mask(start, size, seq_len, head_dim, head_dim_padded)
  idx = _index(start, size, group_index, batch_index)
  if mask is None:
    return plgpu.load(ref.at[idx])
  return plgpu.load(ref.at[idx], mask=mask, other=0.0)


def load_paged_tile(ref, start, size: int, *, head_dim: int, table_ref,
                    batch, seq_len):
  """Loads rows [start, start + size) of one sequence from a paged cache.

  Args:
    ref: one kv head's pages, [num_pages, page_size, head_dim_p].
    start: first row (traced int32), a position in the sequence.
    size: number of rows (static).
    head_dim: the true head dimension; padding columns read as 0.
    table_ref: int32 [batch, max_pages], the page ids of each sequence
      (not checked: an id out of range is undefined behaviour).
    batch: the sequence's row of `table_ref`.
    seq_len: the sequence's length (traced or static): rows at or past it
      are not read (their table entries may not name a page yet, and the
      rest of the last page may hold anything) and come in as zeros.

  When `size` divides the page size a tile lies in one page: one page id
  and a contiguous load. Otherwise (small pages) the tile gathers its rows
  from the pages they lie in.
  """
  page_size, head_dim_p = ref.shape[1], ref.shape[-1]
  columns = jnp.arange(head_dim_p, dtype=jnp.int32) < head_dim
  max_pages = table_ref.shape[1]
  rows = start + jnp.arange(size, dtype=jnp.int32)
  # (A length past the table's pages reads no further than its last page.)
  valid = rows < jnp.minimum(seq_len, max_pages * page_size)
  if page_size % size == 0:
    slot = jnp.minimum(lax.div(start, page_size), max_pages - 1)
    page = plgpu.load(table_ref.at[batch, slot])
    idx = (page, pl.ds(lax.rem(start, page_size), size), slice(None))
    return plgpu.load(ref.at[idx], other=0.0,
                      mask=valid[:, None] & columns[None, :])
  slots = jnp.minimum(lax.div(rows, page_size), max_pages - 1)
  pages = plgpu.load(table_ref.at[batch, slots], mask=valid, other=0)
  # Integer indices in every dimension (a gather; the interpreter takes no
  # mix of slices and index arrays).
  lanes = jnp.arange(head_dim_p, dtype=jnp.int32)[None, :]
  return plgpu.load(
      ref.at[pages[:, None], lax.rem(rows, page_size)[:, None], lanes],
      other=0.0, mask=valid[:, None] & columns[None, :])


def store_tile(ref, start, value, *, seq_len: int, head_dim: int,
               group_index=None):
  """Stores a [size, head_dim_p] tile at rows [start, start + size)."""
  size, head_dim_padded = value.shape
  # Rows past the array are always masked on stores: writing them would
  # corrupt the next head's or batch element's rows.
  mask = _mask(start, size, seq_len, head_dim, head_dim_padded)
  idx = _index(start, size, group_index)
  plgpu.store(ref.at[idx], value.astype(ref.dtype), mask=mask)


def load_row_stats(ref, start, size: int, *, seq_len: int, other: float,
                   group_index=None, batch_index=None):
  """Loads a [size] slice of a per-row fp32 statistic (lse or delta)."""
  rows = start + jnp.arange(size, dtype=jnp.int32)
  if group_index is None:
    idx = (pl.ds(start, size),)
  else:
    idx = (group_index, pl.ds(start, size))
  if batch_index is not None:
    idx = (batch_index, *idx)
  return plgpu.load(ref.at[idx], mask=rows < seq_len, other=other)


def store_row_stats(ref, start, value, *, seq_len: int):
  rows = start + jnp.arange(value.shape[0], dtype=jnp.int32)
  plgpu.store(ref.at[pl.ds(start, value.shape[0])], value, mask=rows < seq_len)


def matmul(a: jax.Array, b: jax.Array, *, trans_a: bool = False,
           trans_b: bool = False) -> jax.Array:
  """fp32-accumulated tile product.

  float32 operands use full IEEE fp32 (Triton's default for a float32 dot is
  TF32, about 3e-4 relative error, which would make a float32 call less exact
  than jax.nn); 16-bit operands use the tensor cores with fp32 accumulation.
  """
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def head_dim_padded(head_dim: int) -> int:
  """The head dimension of the kernels' tiles: a power of two, >= 16.

  Triton tiles must be powers of two; the padding columns are masked on
  every load and store (never read from or written to memory).
  """
  return max(16, pl.next_power_of_2(head_dim))
