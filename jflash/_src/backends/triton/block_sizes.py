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

from jflash._src.backends.triton import tiles

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


# Shared memory one thread block may use, by device family (bytes).
_HOPPER_SHARED_MEMORY = 227 * 1024  # H100, H200 (sm90); also B200.
_AMPERE_SHARED_MEMORY = 163 * 1024  # A100, A800, A30 (sm80).
_SMALL_SHARED_MEMORY = 99 * 1024  # sm86 / sm89 (RTX, L4, L40, A10) and other.


def shared_memory_limit(device_kind: str) -> int:
  """Per-block shared memory of a device family, from its `device_kind`."""
  kind = device_kind.upper()
  if any(name in kind for name in ("H100", "H200", "H800", "GH200", "B200",
                                   "B100", "GB200")):
    return _HOPPER_SHARED_MEMORY
  if any(name in kind for name in ("A100", "A800", "A30")):
    return _AMPERE_SHARED_MEMORY
  if kind in ("CPU", "") or "CPU" in kind:
    return _HOPPER_SHARED_MEMORY  # Interpreter: no limit; use GPU tiles.
  return _SMALL_SHARED_MEMORY


def forward_shared_memory(block_q: int, block_k: int, num_stages: int, *,
                          head_dim: int, itemsize: int,
                          dense_itemsize: int = 0) -> int:
  """Estimate: one q tile plus `num_stages` buffered k and v tiles (and
  [block_q, block_k] bias / mask tiles of `dense_itemsize` bytes per
  element, summed over the dense operands)."""
  return (itemsize * tiles.head_dim_padded(head_dim)
          * (block_q + 2 * num_stages * block_k)
          + dense_itemsize * num_stages * block_q * block_k)


def backward_shared_memory(block_q_dkv: int, block_k_dkv: int,
                           block_q_dq: int, block_k_dq: int, num_stages: int,
                           *, head_dim: int, itemsize: int,
                           dense_itemsize: int = 0) -> int:
  """Estimate for the larger backward kernel (resident + buffered tiles).

  dK/dV keeps k and v tiles and streams q and dO tiles; dQ keeps q and dO
  tiles and streams k and v tiles; both stream bias / mask tiles
  (`dense_itemsize` bytes per element, as in `forward_shared_memory`).
  """
  row_bytes = itemsize * tiles.head_dim_padded(head_dim)
  dkv = (row_bytes * (2 * block_k_dkv + 2 * num_stages * block_q_dkv)
         + dense_itemsize * num_stages * block_q_dkv * block_k_dkv)
  dq = (row_bytes * (2 * block_q_dq + 2 * num_stages * block_k_dq)
        + dense_itemsize * num_stages * block_q_dq * block_k_dq)
  return max(dkv, dq)


# Preference lists, best first. The first entry of each 16-bit list is the
# best point measured on an H200 (RECORD.md, Triton rounds); later entries are
# smaller fallbacks for devices with less shared memory (not yet measured).
# Forward: (block_q, block_k, num_warps, num_stages).
_FORWARD_PREFERENCES = {
    (2, 64): ((128, 128, 4, 3), (128, 64, 4, 3), (64, 64, 4, 2),
              (32, 32, 4, 1)),
    (2, 128): ((128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 2),
               (64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1)),
    # D=256: 64x64 w4 s3 won a tile sweep at 2 x 4096 (causal +6%) but lost
    # 3-24% across the issue-4 sweep (H200, 2026-11-23): not used.
    (2, 256): ((128, 64, 8, 2), (64, 32, 4, 2), (32, 32, 4, 1)),
    (4, 128): ((64, 64, 4, 2), (32, 32, 4, 1)),
    (4, 256): ((32, 32, 4, 1), (16, 16, 4, 1)),
}
# Backward: (block_q_dkv, block_k_dkv, block_q_dq, block_k_dq, warps, stages).
_BACKWARD_PREFERENCES = {
    (2, 64): ((64, 64, 64, 64, 4, 3), (64, 64, 64, 64, 4, 2),
              (32, 64, 64, 32, 4, 2)),
    (2, 128): ((64, 64, 64, 64, 4, 2), (32, 64, 64, 32, 4, 2),
               (32, 32, 32, 32, 4, 1)),
    # D=256: 64-row dQ tiles: +3-6% in a tile sweep at 2 x 4096, then
    # +0-21% fwd+bwd across the sweep (H200, 2026-11-23).
    (2, 256): ((64, 32, 64, 32, 4, 2), (64, 32, 32, 64, 4, 2),
               (32, 32, 32, 32, 4, 1), (16, 16, 16, 16, 4, 1)),
    (4, 128): ((32, 32, 32, 32, 4, 2), (16, 16, 16, 16, 4, 1)),
    (4, 256): ((16, 16, 16, 16, 4, 1),),
}


# Short sequences (both lengths <= this) in 16-bit with D <= 128: few
# programs per head, so smaller forward tiles fill the GPU better. H200, bf16,
# 32 x 512 x 16 heads: 64x64 w4 s3 gives 287 / 156 TFLOP/s (non-causal /
# causal) at D=128 against 240 / 136 for 128x128 w8 s3, and 250 / 138 against
# 194 / 95 at D=64; at N=1024 128x128 is as good or better
# (benchmarks/results/RECORD.md, 2026-11-22).
_SHORT_SEQUENCE = 512
_SHORT_FORWARD = (64, 64, 4, 3)
# Causal, 16-bit, 64 < D <= 128, longest length in (512, 2048]: narrow key
# tiles cut the work wasted on the diagonal. H200, bf16, D=128, causal:
# 64x32 w4 s3 gives 233 TFLOP/s at 16 x 1024 and 308 at 8 x 2048, against
# 192 and 281 for 128x128 w8 s3 (non-causal: no gain, not used).
_SHORT_CAUSAL_SEQUENCE = 2048
_SHORT_CAUSAL_FORWARD = (64, 32, 4, 3)


def _preferences(table, itemsize: int, head_dim: int):
  size = 2 if itemsize <= 2 else 4
  bucket = next(d for d in (64, 128, 256) if head_dim <= d)
  if size == 4 and bucket == 64:
    bucket = 128
  return table[(size, bucket)]


def default_block_sizes(
    *,
    q_len: int,
    kv_len: int,
    head_dim: int,
    dtype: Any,
    is_causal: bool,
    device_kind: str,
    dense_itemsize: int = 0,
) -> BlockSizes:
  """Chooses tile sizes for one problem shape (the one heuristic).

  Picks, per kernel, the first entry of a preference list keyed on dtype
  size and head dimension (and, for the forward, short sequences) whose
  shared-memory estimate fits the device family's limit, then shrinks tiles
  to the sequence lengths.

  Args:
    q_len: query sequence length.
    kv_len: key/value sequence length.
    head_dim: head dimension (before padding to a power of two).
    dtype: input dtype.
    is_causal: whether the causal mask is applied (short causal sequences
      take narrower key tiles).
    device_kind: `jax.Device.device_kind`, e.g. "NVIDIA H100 80GB HBM3".
    dense_itemsize: bytes per score element of the dense operands the
      kernels stream tile by tile (a bias's itemsize plus 1 for a mask; 0
      without either): their tiles take shared memory too.

  Returns:
    A `BlockSizes` with every tile no larger than needed for the lengths.
  """
  itemsize = jnp.dtype(dtype).itemsize
  limit = shared_memory_limit(device_kind)
  forward = _preferences(_FORWARD_PREFERENCES, itemsize, head_dim)
  longest = max(q_len, kv_len)
  if itemsize == 2 and head_dim <= 128 and longest <= _SHORT_SEQUENCE:
    forward = (_SHORT_FORWARD, *forward)
  elif (itemsize == 2 and 64 < head_dim <= 128 and is_causal
        and longest <= _SHORT_CAUSAL_SEQUENCE):
    forward = (_SHORT_CAUSAL_FORWARD, *forward)
  block_q, block_k, num_warps, num_stages = next(
      (c for c in forward if forward_shared_memory(
          c[0], c[1], c[3], head_dim=head_dim, itemsize=itemsize,
          dense_itemsize=dense_itemsize) <= limit),
      forward[-1])
  backward = _preferences(_BACKWARD_PREFERENCES, itemsize, head_dim)
  q_dkv, k_dkv, q_dq, k_dq, warps_bwd, stages_bwd = next(
      (c for c in backward if backward_shared_memory(
          *c[:4], c[5], head_dim=head_dim, itemsize=itemsize,
          dense_itemsize=dense_itemsize) <= limit),
      backward[-1])
  return BlockSizes(
      block_q=_clamp_to_length(block_q, q_len),
      block_k=_clamp_to_length(block_k, kv_len),
      block_q_dkv=_clamp_to_length(q_dkv, q_len),
      block_k_dkv=_clamp_to_length(k_dkv, kv_len),
      block_q_dq=_clamp_to_length(q_dq, q_len),
      block_k_dq=_clamp_to_length(k_dq, kv_len),
      num_warps=num_warps, num_stages=num_stages,
      num_warps_bwd=warps_bwd, num_stages_bwd=stages_bwd)
