"""The Mosaic GPU backend's configuration: tiles and pipeline depths, and
how they are chosen (the user's, else the autotuned ones, else by head
dim)."""

from __future__ import annotations

import dataclasses

from jflash._src.spec import CallSpec
from jflash._src.tuning import cache

# Hopper's shared memory per block (227 KiB) less room for barriers.
SMEM_BYTES = 227 * 1024
SMEM_BUDGET_BYTES = SMEM_BYTES - 2048
# The forward's allocations are counted with their 1 KiB alignment
# (`MosaicBlockSizes.aligned_forward_bytes`); past them a launch took 2136
# bytes more (D=256, 128-key FP8 tiles, H100, RECORD 2026-11-25 "FP8
# forward, first run"): 2048 of Mosaic's default scratch for cross-warp
# reductions, which the kernels no longer reserve (`pipeline.launch`), and
# 88 of barriers: 1 KiB is left for those.
FORWARD_SMEM_RESERVED_BYTES = 1024
# Bytes per q/k/v element of the 16-bit kernels (bfloat16, float16); the
# FP8 forward takes FP8_DTYPE.
ITEMSIZE = 2
FP8_DTYPE = "float8_e4m3fn"


@dataclasses.dataclass(frozen=True)
class MosaicBlockSizes:
  """Tiles of the Mosaic GPU kernels (Hopper), forward and backward.

  Pass as `flash_attention(..., block_sizes=jflash.MosaicBlockSizes(...))`
  (the Triton kernels take a `jflash.BlockSizes` there instead). Every tile
  is a multiple of 64 rows (one wgmma M tile per warpgroup).

  Attributes:
    block_q: forward: query rows per compute warpgroup (a block computes
      2 * block_q rows: two compute warpgroups).
    block_kv: forward: key/value rows per pipeline stage.
    num_stages: forward: K/V tiles in flight (the ring's slots), >= 2.
    block_q_dq: dQ kernel: query rows per row group (a block holds
      `row_groups` of them, see `backward_warpgroup_split`).
    block_kv_dq: dQ kernel: key/value rows per pipeline stage.
    block_q_dkv: dK/dV kernel: query rows per pipeline stage.
    block_kv_dkv: dK/dV kernel: key/value rows per row group.
    backward_stages: tiles in flight in both backward rings, >= 2.
    atomic_dq: opt-in, head dims <= 128: one backward kernel instead of two.
      The dK/dV kernel also computes dQ (dS Q-tile by K) and adds it into a
      buffer with TMA reduce-adds, so the dQ kernel's recomputation of S
      and dP is saved (5 matrix products instead of 7). With deterministic
      gradients (the default) the adds are int32 fixed point, exact in
      any order: dQ is bitwise the same run after run (scaled per query
      row by a power of two from a bound, 30 bits of it per row:
      `backward.dq_fixed_point_exponents`). With
      `flash_attention(..., deterministic_grads=False)` they are float32
      (3-12% faster, dQ's last bits vary). Without tiles from the user,
      calls take atomic_dq by themselves where it was faster than the two
      kernels (`atomic_dq_where_faster`: head dim 64 from 8192 queries and
      keys, causal from 16384, without a window or segment ids; with
      deterministic_grads=False head dim 64 from 4096 and 128 from
      16384).
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  block_q_dq: int = 64
  block_kv_dq: int = 64
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  backward_stages: int = 3
  atomic_dq: bool = False

  def __post_init__(self):
    for name in ("block_q", "block_kv", "block_q_dq", "block_kv_dq",
                 "block_q_dkv", "block_kv_dkv"):
      value = getattr(self, name)
      if not isinstance(value, int) or value % 64 or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive multiple of "
                         "64.")
    for name in ("num_stages", "backward_stages"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 2:
        raise ValueError(f"{name}={value!r} must be an int >= 2.")
    if not isinstance(self.atomic_dq, bool):
      raise ValueError(f"atomic_dq={self.atomic_dq!r} must be a bool.")

  def smem_bytes(self, head_dim: int, itemsize: int) -> int:
    """Shared memory of the forward kernel: Q/O of both compute warpgroups,
    the K and V rings, and the lse staging."""
    q = 2 * self.block_q * head_dim * itemsize
    kv = 2 * self.num_stages * self.block_kv * head_dim * itemsize
    return q + kv + 2 * self.block_q * 4

  def aligned_forward_bytes(self, head_dim: int, itemsize: int,
                            out_itemsize: int | None = None, *,
                            has_segments: bool = False) -> int:
    """Shared memory of the forward kernel as Mosaic allocates it, each
    allocation rounded up to the 1 KiB alignment of swizzled tiles: Q (and
    O without output tiles) of both compute warpgroups, the K and V rings,
    the lse staging, with `out_itemsize` an output tile per compute
    warpgroup (FP8's, and the 16-bit Q prefetch's), with `has_segments`
    the int32 segment ids of Q's rows and of the K ring. Measured: the FP8
    forward at D=256 with 128-key tiles asked 88 bytes (its barriers) past
    these allocations without segments, 2136 with Mosaic's reduction
    scratch (see FORWARD_SMEM_RESERVED_BYTES)."""
    aligned = lambda n: -(-n // 1024) * 1024
    tiles = lambda rows, size: aligned(rows * head_dim * size)
    needed = (tiles(2 * self.block_q, itemsize)
              + 2 * tiles(self.num_stages * self.block_kv, itemsize)
              + aligned(2 * self.block_q * 4))
    if out_itemsize is not None:
      needed += tiles(2 * self.block_q, out_itemsize)
    if has_segments:
      needed += (aligned(2 * self.block_q * 4)
                 + aligned(self.num_stages * self.block_kv * 4))
    return needed

  def fits_output_tiles(self, head_dim: int, itemsize: int, *,
                        has_segments: bool = False) -> bool:
    """Whether the 16-bit forward's shared memory has room for output tiles
    of its own (the persistent forward's Q prefetch; default tiles: head
    dims <= 128), counted as the FP8 forward's: tiles that fit only without
    them run without them, never over the limit."""
    return (self.aligned_forward_bytes(head_dim, itemsize, itemsize,
                                       has_segments=has_segments)
            <= SMEM_BYTES - FORWARD_SMEM_RESERVED_BYTES)

  def fp8_smem_bytes(self, head_dim: int, *, has_segments: bool = False
                     ) -> int:
    """Shared memory of the FP8 forward kernel: 8-bit Q, K and V, bfloat16
    output tiles (`aligned_forward_bytes`)."""
    return self.aligned_forward_bytes(head_dim, 1, 2,
                                      has_segments=has_segments)

  def fits_fp8(self, head_dim: int, *, has_segments: bool = False) -> bool:
    """Whether the FP8 forward's shared memory fits Hopper's (with
    FORWARD_SMEM_RESERVED_BYTES left for barriers)."""
    return (self.fp8_smem_bytes(head_dim, has_segments=has_segments)
            <= SMEM_BYTES - FORWARD_SMEM_RESERVED_BYTES)

  def check_fits_fp8(self, head_dim: int, *, has_segments: bool = False
                     ) -> None:
    """Raises ValueError where `fits_fp8` says no."""
    if not self.fits_fp8(head_dim, has_segments=has_segments):
      needed = self.fp8_smem_bytes(head_dim, has_segments=has_segments)
      raise ValueError(
          f"block_sizes={self} need {needed} bytes of shared memory in the "
          f"FP8 forward at head_dim={head_dim}"
          f"{' with segment ids' if has_segments else ''}; a Hopper block "
          f"has {SMEM_BYTES - FORWARD_SMEM_RESERVED_BYTES} for its tiles.")

  def backward_smem_bytes(self, head_dim: int, itemsize: int) -> int:
    """Shared memory of the larger of the two backward kernels."""
    row_groups, _ = backward_warpgroup_split(head_dim)
    tile = lambda rows: rows * head_dim * itemsize
    stages = self.backward_stages
    # dQ: Q and dO per row group, lse and delta, the K/V ring.
    dq = (row_groups * (2 * tile(self.block_q_dq) + 2 * 4 * self.block_q_dq)
          + stages * 2 * tile(self.block_kv_dq))
    # dK/dV: K and V per row group, the Q/dO/lse/delta ring.
    dkv = (row_groups * 2 * tile(self.block_kv_dkv)
           + stages * (2 * tile(self.block_q_dkv) + 2 * 4 * self.block_q_dkv))
    if backward_splits_products(head_dim):
      # The float32 probabilities handed between the two warpgroups.
      dq += self.block_q_dq * self.block_kv_dq * 4
      dkv += self.block_kv_dkv * self.block_q_dkv * 4
    if self.atomic_dq:
      # Two buffers of each row group's dS^T (16-bit); per warpgroup the
      # 32-bit staging of its dQ pieces; in fixed point (deterministic
      # calls) the ring of the query rows' float32 factors.
      pieces = max(map(len, atomic_dq_pieces(self.block_q_dkv, head_dim)))
      dkv += (2 * row_groups * self.block_kv_dkv * self.block_q_dkv
              * itemsize
              + BWD_COMPUTE_WARPGROUPS * pieces * DQ_PIECE * DQ_PIECE * 4
              + stages * self.block_q_dkv * 4)
    return max(dq, dkv)

  def check_fits(self, head_dim: int, itemsize: int, *,
                 has_segments: bool = False) -> None:
    """Raises ValueError if a kernel's shared memory exceeds Hopper's (the
    forward's with segment ids where `has_segments`), or
    NotImplementedError for atomic_dq at a head dim over 128."""
    if self.atomic_dq and head_dim > BWD_MAX_ACC_COLUMNS:
      raise NotImplementedError(
          f"block_sizes.atomic_dq=True supports head dims <= "
          f"{BWD_MAX_ACC_COLUMNS}; got head_dim={head_dim}.")
    # The forward's allocations with their 1 KiB alignment, as the FP8
    # forward's: counted unaligned against SMEM_BUDGET_BYTES, 128-key tiles
    # with 3 stages at head dim 128 passed (229,888 bytes) and then asked
    # Mosaic for 232,568 of 232,448 (lowered for CUDA, 2026-11-26, with
    # the 2 KiB of reduction scratch then reserved; 230,520 without).
    for pass_, needed, budget in (
        ("forward", self.aligned_forward_bytes(
            head_dim, itemsize, has_segments=has_segments),
         SMEM_BYTES - FORWARD_SMEM_RESERVED_BYTES),
        ("backward", self.backward_smem_bytes(head_dim, itemsize),
         SMEM_BUDGET_BYTES)):
      if needed > budget:
        raise ValueError(
            f"block_sizes={self} need {needed} bytes of shared memory in the "
            f"{pass_} pass at head_dim={head_dim}; a Hopper block has "
            f"{budget}.")


def default_block_sizes(head_dim: int, itemsize: int = 2
                        ) -> MosaicBlockSizes:
  """The tiles by head dim (H100, 2026-11-23/24, benchmarks/results/RECORD.md).

  Forward: 64x128 with 2 stages (the best of the sweep at D=64 and 128),
  64x64 at D=256 (only it fits). Backward: 64-row tiles at D=128 (wider
  ones were 3-30% slower in the backward sweep there) and D=256, 2 stages
  (at D=128 1-2% faster than 3 or 4; at D=256 shared memory allows no
  more). At D=64 128-key dQ tiles and 128-query dK/dV tiles with 2 stages:
  6-8% faster forward+backward than all-64 tiles with 3 stages
  (2x4096 and 1x16384, causal and not, H100, 2026-11-24), and 256-key
  forward tiles: 6-9% faster than 128-key ones without a causal mask from
  1k tokens, 3-8% causal from 4k (with the ping-pong and Q prefetch, H100,
  2026-11-26, "256-key forward tiles at D=64"; `default_tiles` keeps 128
  for causal calls over fewer keys, where they were 9% faster at 1k).
  """
  if head_dim > 128:
    sizes = MosaicBlockSizes(block_kv=64, backward_stages=2)
  elif head_dim > 64:
    sizes = MosaicBlockSizes(backward_stages=2)
  else:
    sizes = MosaicBlockSizes(block_kv=256, block_kv_dq=128, block_q_dkv=128,
                             backward_stages=2)
  sizes.check_fits(head_dim, itemsize)
  return sizes


# The backward kernels' compute warpgroups. Their fp32 accumulators (dQ, or
# dK and dV) hold at most BWD_MAX_ACC_COLUMNS head-dim columns per
# warpgroup: past that (head dim 256), the two warpgroups share one row tile
# (`backward_splits_products` says how they divide its work); below it,
# each owns its own row tile.
BWD_COMPUTE_WARPGROUPS = 2
BWD_MAX_ACC_COLUMNS = 128
# How two warpgroups sharing a row tile divide it. "products": one computes
# the probabilities (S, P) and dV, hands P to the other through shared
# memory, which computes dP, dS and dK (or dQ), each accumulator whole
# ([64, 256] fp32, 128 registers a thread; dK/dV: 4 products of 64 x 64 x
# 256 per tile pair instead of 6, dQ 3 instead of 5). "columns": both
# compute S and dP, and each accumulates half of the head-dim columns. Read
# when a call is traced.
BWD_SHARED_ROW_SPLIT = "products"
# atomic_dq: the dQ tile [block_q_dkv, H] of a dK/dV step is multiplied and
# reduce-added in square pieces of this side, dealt out to the compute
# warpgroups (a [64, 128] float32 accumulator beside dK's and dV's spills
# registers at head dim 128).
DQ_PIECE = 64


def atomic_dq_pieces(block_q: int, head_dim: int
                     ) -> tuple[tuple[tuple[int, int], ...], ...]:
  """atomic_dq: per compute warpgroup, the (first row, first column) of
  the DQ_PIECE x DQ_PIECE pieces of the [block_q, head_dim] dQ tile it
  computes: row-major pieces dealt out in turn (head dim 128 with 64-row
  tiles: a column half each; head dim 64 with 128-row tiles: a row half
  each; 64 x 64: warpgroup 0 alone)."""
  pieces = [(row, column) for row in range(0, block_q, DQ_PIECE)
            for column in range(0, head_dim, DQ_PIECE)]
  return tuple(tuple(pieces[wg::BWD_COMPUTE_WARPGROUPS])
               for wg in range(BWD_COMPUTE_WARPGROUPS))


def backward_warpgroup_split(head_dim: int) -> tuple[int, int]:
  """(row_groups, column_chunks) of the backward kernels' compute
  warpgroups: row_groups * column_chunks == BWD_COMPUTE_WARPGROUPS."""
  chunks = max(1, -(-head_dim // BWD_MAX_ACC_COLUMNS))
  if BWD_COMPUTE_WARPGROUPS % chunks or head_dim % chunks:
    raise ValueError(f"head_dim={head_dim} is not supported by the Mosaic "
                     "GPU backward kernels.")
  return BWD_COMPUTE_WARPGROUPS // chunks, chunks


def backward_splits_products(head_dim: int) -> bool:
  """Whether the backward's warpgroups that share a row tile (column chunks
  > 1 in `backward_warpgroup_split`) split its products rather than its
  columns (BWD_SHARED_ROW_SPLIT): then `column_chunks` is the number of
  warpgroups per row tile, and chunk 0 computes the probabilities, chunk 1
  the gradients (backward.py)."""
  _, chunks = backward_warpgroup_split(head_dim)
  if BWD_SHARED_ROW_SPLIT not in ("products", "columns"):
    raise ValueError(f"{BWD_SHARED_ROW_SPLIT=} is not 'products' or "
                     "'columns'.")
  return chunks == 2 and BWD_SHARED_ROW_SPLIT == "products"


def default_fp8_block_sizes(head_dim: int, *, has_segments: bool = False
                            ) -> MosaicBlockSizes:
  """The FP8 forward's tiles by head dim (H100, B=1, 16 heads, 16k
  tokens): 256-key tiles with 2 stages at D=64 and D=128 (10-14% faster
  than 128-key tiles, RECORD 2026-11-25 "FP8 forward, first run"; causal
  at D=128 9-13% faster since the ping-pong and Q prefetch, 2026-11-26
  "D=128 causal FP8 tiles by length": `default_tiles` keeps 128 for short
  causal calls); 128-key tiles at D=256 (16-21% faster than 64-key ones,
  RECORD 2026-11-26 "no reduction scratch, and 128-key FP8 tiles at head
  dim 256"), 64-key ones where segment ids leave no room for them."""
  if head_dim > 128:
    sizes = MosaicBlockSizes(block_kv=128)
    if not sizes.fits_fp8(head_dim, has_segments=has_segments):
      sizes = MosaicBlockSizes(block_kv=64)
  else:
    sizes = MosaicBlockSizes(block_kv=256)
  sizes.check_fits_fp8(head_dim, has_segments=has_segments)
  return sizes


def is_fp8(spec: CallSpec) -> bool:
  """Whether the call's q, k, v are float8_e4m3fn (the FP8 forward)."""
  return spec.dtype == FP8_DTYPE


# Causal calls over fewer keys than this keep 128-key forward tiles: a
# 256-key tile on a block of 128 query rows crosses the diagonal, whose
# masked half is wasted work. 16-bit, head dim 64 (H100, causal 8x1024: 9%
# slower than 128-key tiles; 2x4096 2.6% faster, 1x16384 8% faster;
# RECORD.md, 2026-11-26, "256-key forward tiles at D=64"); FP8, head dim
# 128 (B x N = 16k: 9% slower at 1k, +2% at 2k, +3% at 4k, +8% at 8k, +13%
# at 16k; RECORD.md, 2026-11-26, "D=128 causal FP8 tiles by length").
CAUSAL_WIDE_KEY_TILES_MIN_KV = 4096


def default_tiles(spec: CallSpec) -> MosaicBlockSizes:
  """The tiles by head dim for the call (`default_block_sizes`, or
  `default_fp8_block_sizes` with its segment ids), with 128-key forward
  tiles for causal calls over fewer than CAUSAL_WIDE_KEY_TILES_MIN_KV keys
  (where the defaults are wider: D=64, and FP8 at D <= 128)."""
  if is_fp8(spec):
    sizes = default_fp8_block_sizes(spec.head_dim,
                                    has_segments=spec.mask.has_segments)
  else:
    sizes = default_block_sizes(spec.head_dim, ITEMSIZE)
  if (sizes.block_kv > 128 and spec.mask.is_causal
      and spec.kv_len < CAUSAL_WIDE_KEY_TILES_MIN_KV):
    sizes = dataclasses.replace(sizes, block_kv=128)
  return sizes


# The calls whose 16-bit tiles take atomic_dq by themselves (the 5-product
# backward) because it was faster than the default's two backward kernels
# (H100, fwd+bwd, one query head per kv head), by head dim: the shortest
# query and key length from which it takes it.
# - `deterministic_grads=False` (float32 adds): D=64 from 4096, non-causal
#   / causal: 1.07-1.10x / 1.01x at 2x4096, 1.08x at 4x4096, 1.03x / 1.03x
#   at 1x16384, but 0.98x / 0.79x at 8x1024 and 0.98x / 0.98x at 2x8192
#   with 4 query heads per kv head (RECORD 2026-11-26, "the atomic dQ at
#   240 registers on all rows" and the `deterministic_grads=False`
#   entries). D=128 from 16384: 1.03x at 1x16384, 1.05x at 2x16384,
#   1.04-1.06x at 1x32768 and 1x65536, causal 1.06x / 1.06x at 32k / 64k;
#   1.015x at 2x8192, 0.95-0.99x at 2k-8k, 0.81x at 4x2048 causal (RECORD
#   2026-11-27, "the float32 atomic dQ at head dim 128 over long
#   sequences").
# - deterministic calls (int32 fixed point, bitwise the same run after run),
#   D=64, without a window or segment ids (they shorten what a row sees,
#   and the fixed point loses on short rows): from 8192, 1.01x at
#   1x8192x16, 1.08-1.09x at 4x8192x16 and 2x8192x32, 1.06-1.09x at 16k-32k
#   tokens, 0.95-0.985x at 4096; causal from 16384: 1.04x / 1.07x at 16k /
#   32k, 0.96-0.97x at 1x8192, 1.01x at 2x8192, 1.02x at 4x8192 (RECORD
#   2026-11-27, "where fixed point wins at head dim 64" and "the
#   fixed-point rule's causal edge"). D=128 0.86-1.03x at every length
#   measured (1.00-1.03x from 32k): never.
NONDETERMINISTIC_ATOMIC_DQ_MIN_LEN = {64: 4096, 128: 16384}
DETERMINISTIC_ATOMIC_DQ_MIN_LEN = {64: 8192}
DETERMINISTIC_CAUSAL_ATOMIC_DQ_MIN_LEN = {64: 16384}


def atomic_dq_where_faster(tiles: MosaicBlockSizes, spec: CallSpec
                           ) -> MosaicBlockSizes:
  """The call's tiles with atomic_dq where it was faster than the two
  backward kernels: 16-bit, one query head per kv head, query and key
  lengths from the head dim's entry in NONDETERMINISTIC_ATOMIC_DQ_MIN_LEN
  (`deterministic_grads=False`: float32 adds) or, deterministic (int32
  fixed point) and without a window or segment ids, in
  DETERMINISTIC_ATOMIC_DQ_MIN_LEN (causal:
  DETERMINISTIC_CAUSAL_ATOMIC_DQ_MIN_LEN); shared memory permitting; else
  `tiles` as they are."""
  mask = spec.mask
  if not spec.deterministic_grads:
    min_len = NONDETERMINISTIC_ATOMIC_DQ_MIN_LEN.get(spec.head_dim)
  elif mask.window is not None or mask.has_segments:
    min_len = None
  else:
    min_len = (DETERMINISTIC_CAUSAL_ATOMIC_DQ_MIN_LEN if mask.is_causal
               else DETERMINISTIC_ATOMIC_DQ_MIN_LEN).get(spec.head_dim)
  if (is_fp8(spec) or spec.group != 1 or min_len is None
      or min(spec.q_len, spec.kv_len) < min_len):
    return tiles
  atomic = dataclasses.replace(tiles, atomic_dq=True)
  if atomic.backward_smem_bytes(spec.head_dim, ITEMSIZE) > SMEM_BUDGET_BYTES:
    return tiles
  return atomic


def check_fits(tiles: MosaicBlockSizes, spec: CallSpec) -> None:
  """`tiles.check_fits` (FP8: `check_fits_fp8`) at the call's head dim,
  with its segment ids."""
  segments = spec.mask.has_segments
  if is_fp8(spec):
    tiles.check_fits_fp8(spec.head_dim, has_segments=segments)
  else:
    tiles.check_fits(spec.head_dim, ITEMSIZE, has_segments=segments)


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """How the Mosaic GPU kernels run one call (hashable).

  Attributes:
    block_sizes: the kernels' tiles.
  """

  block_sizes: MosaicBlockSizes

  @classmethod
  def for_call(cls, spec: CallSpec, *,
               block_sizes: MosaicBlockSizes | None = None) -> MosaicConfig:
    """The call's configuration (the backend's `configure`): the user's
    `block_sizes`, else the tiles `jflash.autotune` cached for this device
    and shape, else `default_tiles`; without a user's tiles, with
    atomic_dq where it is faster (`atomic_dq_where_faster`).

    Raises:
      ValueError: if the tiles exceed Hopper's shared memory.
      NotImplementedError: for atomic_dq at a head dim over 128.
    """
    if block_sizes is None:
      block_sizes = atomic_dq_where_faster(
          cache.tuned(spec, "mosaic", MosaicBlockSizes)
          or default_tiles(spec), spec)
    check_fits(block_sizes, spec)
    return cls(block_sizes=block_sizes)
