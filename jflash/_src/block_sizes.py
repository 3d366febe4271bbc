"""Tile sizes and launch parameters of the kernels, and the default heuristic.

Tiles are data: every kernel reads its tile sizes from a `BlockSizes`, never
from a constant of its own. `default_block_sizes` is the one place where
defaults are chosen; it is keyed on the device, the head dimension and the
sequence lengths.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# Triton's matrix instructions need every tile dimension to be at least 16.
MIN_BLOCK = 16
MAX_BLOCK = 256
_VALID_NUM_WARPS = (1, 2, 4, 8, 16)


def _is_power_of_two(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


def next_power_of_two(n: int) -> int:
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and launch parameters of the forward and backward kernels.

  Tile names follow the kernels: the forward kernel walks `block_k`-sized key
  tiles for each `block_q`-sized query tile; the dK/dV kernel walks
  `block_q_dkv` query tiles for each `block_k_dkv` key tile; the dQ kernel
  walks `block_k_dq` key tiles for each `block_q_dq` query tile.

  Attributes:
    block_q: query tile of the forward kernel.
    block_k: key tile of the forward kernel.
    block_q_dkv: query tile of the dK/dV kernel.
    block_k_dkv: key tile of the dK/dV kernel.
    block_q_dq: query tile of the dQ kernel (and of the delta preprocess).
    block_k_dq: key tile of the dQ kernel.
    num_warps: warps per program of the forward kernel.
    num_stages: software-pipelining depth of the forward kernel.
    num_warps_bwd: warps per program of the backward kernels.
    num_stages_bwd: software-pipelining depth of the backward kernels.

  Raises:
    ValueError: if a tile is not a power of two in [16, 256], or a launch
      parameter is out of range.
  """

  block_q: int = 64
  block_k: int = 64
  block_q_dkv: int = 64
  block_k_dkv: int = 64
  block_q_dq: int = 64
  block_k_dq: int = 64
  num_warps: int = 4
  num_stages: int = 2
  num_warps_bwd: int = 4
  num_stages_bwd: int = 2

  def __post_init__(self):
    for field in ("block_q", "block_k", "block_q_dkv", "block_k_dkv",
                  "block_q_dq", "block_k_dq"):
      value = getattr(self, field)
      if (not isinstance(value, int) or not _is_power_of_two(value)
          or not MIN_BLOCK <= value <= MAX_BLOCK):
        raise ValueError(
            f"BlockSizes.{field}={value!r} must be a power of two in "
            f"[{MIN_BLOCK}, {MAX_BLOCK}]."
        )
    for field in ("num_warps", "num_warps_bwd"):
      value = getattr(self, field)
      if value not in _VALID_NUM_WARPS:
        raise ValueError(
            f"BlockSizes.{field}={value!r} must be one of {_VALID_NUM_WARPS}."
        )
    for field in ("num_stages", "num_stages_bwd"):
      value = getattr(self, field)
      if not isinstance(value, int) or not 1 <= value <= 8:
        raise ValueError(f"BlockSizes.{field}={value!r} must be in [1, 8].")


def _clamp_to_length(block: int, length: int) -> int:
  """Shrinks a tile to the (power-of-two-rounded) length, not below 16."""
  return max(MIN_BLOCK, min(block, next_power_of_two(length)))


def default_block_sizes(
    *,
    q_len: int,
    kv_len: int,
    head_dim: int,
    dtype: Any,
    is_causal: bool,
    device_kind: str,
) -> BlockSizes:
  """Chooses tile sizes for one problem shape.

  Args:
    q_len: query sequence length.
    kv_len: key/value sequence length.
    head_dim: head dimension (before padding to a power of two).
    dtype: input dtype.
    is_causal: whether the causal mask is applied.
    device_kind: `jax.Device.device_kind`, e.g. "NVIDIA H100 80GB HBM3".

  Returns:
    A `BlockSizes` with every tile no larger than needed for the lengths.
  """
  del is_causal, device_kind  # Not yet distinguished; see NOTES.
  if jnp.dtype(dtype).itemsize >= 4:
    # float32 tiles take twice the shared memory and registers: the 16-bit
    # tiles below (128x128, 3 stages at D=128) do not fit.
    if head_dim <= 128:
      fwd = dict(block_q=64, block_k=64, num_warps=4, num_stages=2)
      bwd = dict(block_q_dkv=32, block_k_dkv=32, block_q_dq=32, block_k_dq=32,
                 num_warps_bwd=4, num_stages_bwd=2)
    else:
      fwd = dict(block_q=32, block_k=32, num_warps=4, num_stages=1)
      bwd = dict(block_q_dkv=16, block_k_dkv=16, block_q_dq=16, block_k_dq=16,
                 num_warps_bwd=4, num_stages_bwd=1)
  elif head_dim <= 64:
    fwd = dict(block_q=128, block_k=64, num_warps=4, num_stages=3)
    bwd = dict(block_q_dkv=64, block_k_dkv=64, block_q_dq=64, block_k_dq=64,
               num_warps_bwd=4, num_stages_bwd=2)
  elif head_dim <= 128:
    fwd = dict(block_q=128, block_k=128, num_warps=8, num_stages=3)
    bwd = dict(block_q_dkv=64, block_k_dkv=64, block_q_dq=64, block_k_dq=64,
               num_warps_bwd=4, num_stages_bwd=2)
  else:
    fwd = dict(block_q=64, block_k=32, num_warps=4, num_stages=2)
    bwd = dict(block_q_dkv=32, block_k_dkv=32, block_q_dq=32, block_k_dq=32,
               num_warps_bwd=4, num_stages_bwd=1)
  for name in ("block_q", "block_q_dkv", "block_q_dq"):
    table = fwd if name in fwd else bwd
    table[name] = _clamp_to_length(table[name], q_len)
  for name in ("block_k", "block_k_dkv", "block_k_dq"):
    table = fwd if name in fwd else bwd
    table[name] = _clamp_to_length(table[name], kv_len)
  return BlockSizes(**fwd, **bwd)
