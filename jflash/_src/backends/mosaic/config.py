"""The Mosaic GPU backend's configuration: tiles and pipeline depth."""

from __future__ import annotations

import dataclasses

# Hopper's shared memory per block (227 KiB) less room for barriers.
SMEM_BUDGET_BYTES = 227 * 1024 - 2048


@dataclasses.dataclass(frozen=True)
class MosaicBlockSizes:
  """Tiles of the Mosaic GPU forward kernel.

  Attributes:
    block_q: query rows per compute warpgroup (a block computes
      2 * block_q rows: two compute warpgroups). A multiple of 64 (one
      wgmma M tile per warpgroup).
    block_kv: key/value rows per pipeline stage, a multiple of 64.
    num_stages: K/V tiles in flight (the ring's slots), at least 2.
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2

  def __post_init__(self):
    if self.block_q % 64 or self.block_q <= 0:
      raise ValueError(f"block_q={self.block_q} must be a positive multiple "
                       "of 64.")
    if self.block_kv % 64 or self.block_kv <= 0:
      raise ValueError(f"block_kv={self.block_kv} must be a positive "
                       "multiple of 64.")
    if self.num_stages < 2:
      raise ValueError(f"num_stages={self.num_stages} must be at least 2.")

  def smem_bytes(self, head_dim: int, itemsize: int) -> int:
    """Shared memory of the forward kernel: Q/O of both compute warpgroups,
    the K and V rings, and the lse staging."""
    q = 2 * self.block_q * head_dim * itemsize
    kv = 2 * self.num_stages * self.block_kv * head_dim * itemsize
    return q + kv + 2 * self.block_q * 4


def default_block_sizes(head_dim: int, itemsize: int = 2
                        ) -> MosaicBlockSizes:
  """Tiles by head dim: 64x128 with 2 stages, smaller K/V tiles where
  shared memory (227 KiB) or registers run out (head dim 256)."""
  if head_dim > 128:
    sizes = MosaicBlockSizes(block_q=64, block_kv=64, num_stages=2)
  else:
    sizes = MosaicBlockSizes(block_q=64, block_kv=128, num_stages=2)
  assert sizes.smem_bytes(head_dim, itemsize) <= SMEM_BUDGET_BYTES
  return sizes


# The backward kernels' compute warpgroups. Their fp32 accumulators (dQ, or
# dK and dV) hold at most BWD_MAX_ACC_COLUMNS head-dim columns per
# warpgroup: past that (head dim 256), the two warpgroups share one row tile
# and each accumulates half of the columns (recomputing the row tile's
# probabilities); below it, each owns its own row tile.
BWD_COMPUTE_WARPGROUPS = 2
BWD_MAX_ACC_COLUMNS = 128


def backward_warpgroup_split(head_dim: int) -> tuple[int, int]:
  """(row_groups, column_chunks) of the backward kernels' compute
  warpgroups: row_groups * column_chunks == BWD_COMPUTE_WARPGROUPS."""
  chunks = max(1, -(-head_dim // BWD_MAX_ACC_COLUMNS))
  if BWD_COMPUTE_WARPGROUPS % chunks or head_dim % chunks:
    raise ValueError(f"head_dim={head_dim} is not supported by the Mosaic "
                     "GPU backward kernels.")
  return BWD_COMPUTE_WARPGROUPS // chunks, chunks


@dataclasses.dataclass(frozen=True)
class MosaicBackwardBlockSizes:
  """Tiles of the Mosaic GPU backward kernels (backward.py).

  Attributes:
    block_q_dq: query rows per row group of the dQ kernel (a block holds
      `row_groups` of them, see `backward_warpgroup_split`), a multiple
      of 64.
    block_kv_dq: key/value rows per pipeline stage of the dQ kernel, a
      multiple of 64.
    block_q_dkv: query rows per pipeline stage of the dK/dV kernel, a
      multiple of 64.
    block_kv_dkv: key/value rows per row group of the dK/dV kernel, a
      multiple of 64.
    num_stages: tiles in flight in both kernels' rings, at least 2.
  """

  block_q_dq: int = 64
  block_kv_dq: int = 64
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_q_dq", "block_kv_dq", "block_q_dkv",
                 "block_kv_dkv"):
      value = getattr(self, name)
      if value % 64 or value <= 0:
        raise ValueError(f"{name}={value} must be a positive multiple of "
                         "64.")
    if self.num_stages < 2:
      raise ValueError(f"num_stages={self.num_stages} must be at least 2.")

  def smem_bytes(self, head_dim: int, itemsize: int) -> int:
    """Shared memory of the larger of the two backward kernels."""
    row_groups, _ = backward_warpgroup_split(head_dim)
    tile = lambda rows: rows * head_dim * itemsize
    # dQ: Q and dO per row group, lse and delta, the K/V ring.
    dq = (row_groups * (2 * tile(self.block_q_dq) + 2 * 4 * self.block_q_dq)
          + self.num_stages * 2 * tile(self.block_kv_dq))
    # dK/dV: K and V per row group, the Q/dO/lse/delta ring.
    dkv = (row_groups * 2 * tile(self.block_kv_dkv)
           + self.num_stages * (2 * tile(self.block_q_dkv)
                                + 2 * 4 * self.block_q_dkv))
    return max(dq, dkv)


def default_backward_block_sizes(head_dim: int, itemsize: int = 2
                                 ) -> MosaicBackwardBlockSizes:
  """64-row tiles everywhere (tokamax's most frequent backward winner on
  H100), 3 stages, 2 where shared memory (227 KiB) runs out (head dim
  256)."""
  sizes = MosaicBackwardBlockSizes(num_stages=3)
  if sizes.smem_bytes(head_dim, itemsize) > SMEM_BUDGET_BYTES:
    sizes = MosaicBackwardBlockSizes(num_stages=2)
  assert sizes.smem_bytes(head_dim, itemsize) <= SMEM_BUDGET_BYTES
  return sizes


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """How the Mosaic GPU kernels run one call (hashable).

  Attributes:
    block_sizes: the forward kernel's tiles.
    backward_block_sizes: the backward kernels' tiles.
  """

  block_sizes: MosaicBlockSizes
  backward_block_sizes: MosaicBackwardBlockSizes
