"""Attention dropout's keep mask: a stateless hash of (seed, row, column).

The kernels cannot store a [q_len, kv_len] mask, and the backward must see
exactly the forward's: every element's keep bit is recomputed wherever it is
needed from a counter-based hash,

    keep(t, s) = mix(row_hash(seed, t) ^ (s * C)) < threshold,
    row_hash(seed, t) = mix(mix(seed[0] ^ (t * G)) + seed[1]),

with `mix` the MurmurHash3 32-bit finalizer (a bijection of uint32 with
full avalanche; Appleby, public domain), G and C odd constants, and
threshold = round((1 - rate) * 2^32). Each (batch, query head) has its own
two uint32 seeds, drawn in XLA from the user's key; the hash itself never
sees the batch or head index, so the mask of a batch element does not depend
on its position in the batch (vmap gives the same masks as a loop, and
broadcast dropout is just equal seeds).

Only uint32 multiply, xor, add, logical right shift and unsigned compare:
all lower in Pallas-Triton and in the interpreter. The same functions build
the dense mask of the XLA path (`keep_mask`), so both implementations drop
exactly the same entries.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

# Odd multipliers: the golden ratio's (rows) and a MurmurHash3 one (columns).
_ROW_MULTIPLIER = np.uint32(0x9E3779B9)
_COL_MULTIPLIER = np.uint32(0xCC9E2D51)


def _mix(x: jax.Array) -> jax.Array:
  """MurmurHash3's fmix32: a uint32 -> uint32 bijection with avalanche."""
  x = x ^ lax.shift_right_logical(x, np.uint32(16))
  x = x * np.uint32(0x85EBCA6B)
  x = x ^ lax.shift_right_logical(x, np.uint32(13))
  x = x * np.uint32(0xC2B2AE35)
  return x ^ lax.shift_right_logical(x, np.uint32(16))


def keep_threshold(rate: float) -> np.uint32:
  """uint32 t with P(hash < t) = 1 - rate (to 2^-32)."""
  return np.uint32(min(round((1.0 - rate) * 2.0**32), 2**32 - 1))


def keep(seed0, seed1, rows, cols, rate: float) -> jax.Array:
  """Keep bits of the elements (rows, cols), broadcasting like jnp.

  Args:
    seed0, seed1: uint32 seeds of the (batch, head).
    rows: int32 query positions (e.g. [block_q, 1]).
    cols: int32 key positions (e.g. [1, block_k]).
    rate: the dropout rate (static).

  Returns:
    bool, True where the element is kept.
  """
  rows = rows.astype(jnp.uint32)
  cols = cols.astype(jnp.uint32)
  row_hash = _mix(_mix(seed0 ^ (rows * _ROW_MULTIPLIER)) + seed1)
  return _mix(row_hash ^ (cols * _COL_MULTIPLIER)) < keep_threshold(rate)


def seeds(rng, batch: int, num_heads: int, broadcast: bool) -> jax.Array:
  """uint32 [batch, num_heads, 2]: each (batch, head)'s seeds.

  With `broadcast` (Flax's broadcast_dropout), every batch element and head
  gets the same seeds, hence the same mask.
  """
  if broadcast:
    return jnp.broadcast_to(jax.random.bits(rng, (2,), jnp.uint32),
                            (batch, num_heads, 2))
  return jax.random.bits(rng, (batch, num_heads, 2), jnp.uint32)


def keep_mask(seeds_, q_len: int, kv_len: int, rate: float) -> jax.Array:
  """The dense mask, bool [batch, num_heads, q_len, kv_len] (XLA path)."""
  seed0, seed1 = (seeds_[..., i, None, None] for i in (0, 1))
  # [1, 1, q_len, 1] and [1, 1, 1, kv_len]: the seeds' rank, explicitly.
  rows = jnp.arange(q_len, dtype=jnp.int32)[None, None, :, None]
  cols = jnp.arange(kv_len, dtype=jnp.int32)[None, None, None, :]
  return keep(seed0, seed1, rows, cols, rate)
