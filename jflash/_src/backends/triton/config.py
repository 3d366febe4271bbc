"""The Triton backend's configuration: what a call does not describe, and
how it is chosen (the user's tiles, else the autotuned ones, else the
heuristic of block_sizes.py)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jflash._src import platform
from jflash._src.backends.triton import block_sizes as block_sizes_lib
from jflash._src.backends.triton.block_sizes import BlockSizes
from jflash._src.spec import CallSpec
from jflash._src.tuning import cache


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """How the Triton kernels run one call (hashable: a `custom_vjp` static).

  Attributes:
    block_sizes: tiles and launch parameters of every kernel.
    interpret: run the kernels through the Pallas interpreter (any device).
  """

  block_sizes: BlockSizes
  interpret: bool = False

  @classmethod
  def for_call(cls, spec: CallSpec, *, block_sizes: BlockSizes | None = None,
               interpret: bool = False) -> TritonConfig:
    """The call's configuration (the backend's `configure`).

    Tiles: the user's `block_sizes`, else the ones `jflash.autotune` cached
    for this device and shape, else `default_tiles`. Calls with a dense
    bias or mask never take autotuned tiles (the tuning runs without them,
    and their tiles need shared memory of their own): the heuristic counts
    their tiles (a bias as float32, the worst case).

    Raises:
      ValueError: if the user's tiles need more shared memory than this
        device's blocks have.
    """
    if block_sizes is not None:
      check_fits(block_sizes, spec)
    elif not _dense_itemsize(spec):
      block_sizes = cache.tuned(spec, "triton", BlockSizes)
    return cls(block_sizes=block_sizes or default_tiles(spec),
               interpret=interpret)


def _dense_itemsize(spec: CallSpec) -> int:
  """Bytes per score element of the dense operands the kernels stream
  tile by tile: a bias counted as float32, a mask as one byte."""
  return 4 * spec.has_bias + 1 * spec.mask.has_dense_mask


def default_tiles(spec: CallSpec) -> BlockSizes:
  """The heuristic's tiles for the call on this device
  (`block_sizes.default_block_sizes`)."""
  return block_sizes_lib.default_block_sizes(
      q_len=spec.q_len, kv_len=spec.kv_len, head_dim=spec.head_dim,
      dtype=spec.dtype, is_causal=spec.mask.is_causal,
      device_kind=platform.device_kind(),
      dense_itemsize=_dense_itemsize(spec))


def check_fits(tiles: BlockSizes, spec: CallSpec) -> None:
  """ValueError when `tiles` need more shared memory than this device's
  blocks have (the launch would fail on the GPU at run time)."""
  device = platform.device_kind()
  limit = block_sizes_lib.shared_memory_limit(device)
  itemsize = jnp.dtype(spec.dtype).itemsize
  dense = _dense_itemsize(spec)
  needs = {
      "forward": block_sizes_lib.forward_shared_memory(
          tiles.block_q, tiles.block_k, tiles.num_stages,
          head_dim=spec.head_dim, itemsize=itemsize, dense_itemsize=dense),
      "backward": block_sizes_lib.backward_shared_memory(
          tiles.block_q_dkv, tiles.block_k_dkv, tiles.block_q_dq,
          tiles.block_k_dq, tiles.num_stages_bwd, head_dim=spec.head_dim,
          itemsize=itemsize, dense_itemsize=dense)}
  for pass_, need in needs.items():
    if need > limit:
      raise ValueError(
          f"block_sizes={tiles} need about {need} bytes of shared memory in "
          f"the {pass_} kernels at head_dim={spec.head_dim} and dtype="
          f"{spec.dtype}; a block of this GPU ({device!r}) has {limit}. Use "
          "smaller tiles or fewer stages.")
