"""Paged KV caches read as dense ones: for the backends whose kernels do not
read pages themselves (the XLA path, the Mosaic GPU forward).

A paged cache holds every sequence's keys in pages [num_pages, page_size, K,
H]; `block_table` [B, max_pages] names the page of each sequence's
positions [p * page_size, (p + 1) * page_size). Gathering them gives each
sequence a dense [S, K, H] cache, S = max_pages * page_size: one extra read
and write of the cache's valid part, which the Triton kernels avoid by
reading through the table.
"""

from __future__ import annotations

import jax.numpy as jnp

from jflash._src.spec import Operands


def gather_pages(pages, block_table):
  """[P, page_size, K, H] pages -> each sequence's dense [B, max_pages *
  page_size, K, H] cache (a copy)."""
  gathered = pages[block_table]  # [B, max_pages, page_size, K, H].
  return gathered.reshape(block_table.shape[0], -1, *pages.shape[2:])


def dense_keys_values(operands: Operands):
  """(key, value) as dense [B, S, K, H] arrays: pages gathered; with kv
  lengths, entries at or past a sequence's length are zeros whatever the
  cache holds there (a zero probability times a NaN value is still NaN)."""
  key, value = operands.key, operands.value
  if operands.block_table is not None:
    key, value = (gather_pages(x, operands.block_table)
                  for x in (key, value))
  if operands.kv_lengths is not None:
    written = (jnp.arange(key.shape[1])[None, :]
               < operands.kv_lengths[:, None])[:, :, None, None]
    key, value = (jnp.where(written, x, jnp.zeros((), x.dtype))
                  for x in (key, value))
  return key, value


def dense_operands(operands: Operands) -> Operands:
  """`operands` with a paged cache replaced by the gathered dense one (as
  is without a block table)."""
  if operands.block_table is None:
    return operands
  key, value = dense_keys_values(operands)
  return operands.replace(key=key, value=value, block_table=None)
