"""Split-K decode kernel (flash-decoding) on Pallas-Triton.

Generation attends T = 1..16 new query tokens per sequence to a long KV
cache. The training forward would give each query head its own program
(few programs at small batch, each re-reading its kv head's cache), so this
kernel instead:

- packs the query rows of one kv head, T tokens x g query heads of its GQA
  group, into the rows of one tile (row r = token r // g, head r % g), so
  each K/V tile is read once per kv head;
- cuts the key tiles a sequence's rows can see into `num_splits` chunks,
  one program each: grid (split, batch, kv head). Each program writes its
  chunk's normalized float32 output and base-2 lse; `combine` (XLA) merges
  the chunks through their lse. A chunk with nothing to see (past the
  sequence's length, outside the window) writes lse = -inf and O = 0.

Positions: the cache holds L = key_value_seq_lengths[b] entries, the T new
tokens last; query token t sits at position L - T + t, which is
`masks.visible` with a bottom-right causal offset L - T. Only the key tiles
of `masks.key_blocks` are read (a window reads its band).

FP8 (an e4m3 query and cache, with descales per (batch, kv head)): the
query and each K/V tile are read as they are, one byte per element, and
converted in registers to `FP8_COMPUTE_DTYPE`; q_descale x k_descale folds
into the program's logit scale and v_descale into its output (one scalar
each: a program is one (batch, kv head)). The partials stay float32.
"""

from __future__ import annotations

import dataclasses
import functools

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from jflash._src import masks
from jflash._src import numerics
from jflash._src import sharding
from jflash._src.backends.triton import block_sizes
from jflash._src.backends.triton import tiles
from jflash._src.spec import MaskSpec


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
  """The decode kernel's launch configuration.

  Attributes:
    block_k: key rows per tile (with pages smaller than a tile, a tile
      gathers its rows from several pages).
    num_warps, num_stages: Triton's warps per program and pipeline depth.
  """

  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 4


# Fallbacks, in order, for launches the preferred one does not fit (many
# query rows per kv head at a large head dim, float32, or a GPU with less
# shared memory). At 128 rows x head dim 256, bf16, H100: 32-key tiles with
# 4 stages 88-91 us against 101-106 for 64-key tiles with 2 stages or
# 32-key tiles with 2 stages (RECORD.md, 2026-11-25, "launch limits").
FALLBACK_LAUNCHES = (
    DecodeLaunch(64, 4, 3), DecodeLaunch(32, 4, 4), DecodeLaunch(64, 4, 2),
    DecodeLaunch(32, 4, 3), DecodeLaunch(32, 4, 2), DecodeLaunch(16, 4, 2),
    DecodeLaunch(16, 4, 1))
# The float32 accumulator [rows, head dim] is spread over the program's
# threads; past this many values per thread it spills to local memory
# (128 rows x 256 columns on 4 warps: 256 per thread, 2.4x slower than on
# 8 warps at B=16, H100), so such launches take more warps.
MAX_ACCUMULATOR_PER_THREAD = 128
MAX_WARPS = 8
# The most query rows one launch takes (a power of two); more are split
# into launches of this many rows (each reads the cache again).
MAX_ROWS_PER_LAUNCH = 128
MIN_ROWS = 16  # Triton's matrix instructions need tiles of >= 16 rows.
# What FP8 (e4m3) tiles are converted to in registers before the matmuls:
# float16 holds every e4m3 value exactly (3 mantissa bits, exponents
# 2^-9..2^8), Hopper converts a pair in one instruction
# (cvt.rn.f16x2.e4m3x2; bfloat16 takes that and two more), and the
# probabilities P in float16 keep 11 significant bits (bfloat16: 8).
FP8_COMPUTE_DTYPE = jnp.float16


# The launch grid's axes, fastest first: CUDA starts programs in order of
# the grid's first axis, then its second, then its third. Kv head first:
# the programs running together read the K heads of the same cache rows
# (with a [B, S, K, H] cache, whole rows of K x H) rather than one head's
# rows of many sequences (H of every K x H). On an H100, bf16, one split:
# 1-2% faster than (split, batch, head) at 128-256 sequences of 512-2048
# keys, within 1% at 64 x 1024 and on split calls (RECORD.md, 2026-11-25,
# issue 23 item 2). Then the split before the batch: a sequence's splits
# run together (one call's programs start at the same offsets of every
# sequence otherwise). The same launch order for one-split calls; on split
# calls on an H100 0-5% faster than (head, batch, split) in one run and
# -1% to +1% in a second, with the dense 8 x 8192 cache of
# benchmarks/decode.py at 99 us instead of 103-110 (RECORD.md, 2026-11-26,
# "grid order on split decode calls" and "head, split, batch as the grid
# order, checked").
GRID_AXES = ("head", "split", "batch")


def _grid_index(axes, *index):
  """(split, batch, kv head) from a grid index laid out as `axes`."""
  named = dict(zip(axes, index))
  return named["split"], named["batch"], named["head"]


# Triton lowers 16-bit tiles of >= 64 rows to Hopper's wgmma, whose
# pipeline holds `num_stages` K/V tiles; other tiles to mma.sync, whose
# pipeline holds `num_stages - 1` and stages the float32 probabilities.
WGMMA_MIN_ROWS = 64


def shared_memory(launch: DecodeLaunch, *, rows: int, head_dim: int,
                  itemsize: int) -> int:
  """Shared memory one program asks for, in bytes: its query tile, the
  pipeline's buffered key and value tiles, and (mma.sync) a float32
  [rows, block_k + 1] probability tile.

  Calibrated on an H100 against the bytes Triton requests at launch (the
  RESOURCE_EXHAUSTED message; benchmarks/launch_limits.py calibrate_grid,
  RECORD.md 2026-11-25 "launch limits"): exact for every over-limit launch
  measured (16-bit at >= 64 rows; float32 at 16-128 rows, 32- and 64-key
  tiles, head dims 128 and 256); for 16-bit below 64 rows every launch
  ran, the largest (32 rows, D=256, 64-key tiles, 4 stages) at the
  model's 221312 bytes, so the model is an upper bound there.

  itemsize 1 (an FP8 query and cache, converted to FP8_COMPUTE_DTYPE in
  registers) is an upper bound, not yet calibrated on a GPU: the query
  tile in 16 bits, `num_stages` buffered FP8 key and value tiles (the
  16-bit pipelines hold num_stages or num_stages - 1), one converted
  16-bit key and value tile each (wgmma reads its B operand from shared
  memory), and the float32 probability tile, whatever the instruction.
  """
  head_dim_p = tiles.head_dim_padded(head_dim)
  if itemsize == 1:
    wide = jnp.dtype(FP8_COMPUTE_DTYPE).itemsize
    return (head_dim_p * (wide * rows
                          + 2 * launch.num_stages * launch.block_k
                          + 2 * wide * launch.block_k)
            + 4 * rows * (launch.block_k + 1))
  if itemsize == 2 and rows >= WGMMA_MIN_ROWS:
    return itemsize * head_dim_p * (
        rows + 2 * launch.num_stages * launch.block_k)
  buffered = max(1, launch.num_stages - 1)
  return (itemsize * head_dim_p * (rows + 2 * buffered * launch.block_k)
          + 4 * rows * (launch.block_k + 1))


@dataclasses.dataclass(frozen=True)
class DecodePlan:
  """How one decode call is launched: `rows` query rows per launch
  (launches cover the packed rows in turn) under `launch`."""

  rows: int
  launch: DecodeLaunch


def _with_warps_for_accumulator(launch: DecodeLaunch, rows: int,
                                head_dim: int) -> DecodeLaunch:
  """`launch` with enough warps (up to MAX_WARPS) that the accumulator
  holds at most MAX_ACCUMULATOR_PER_THREAD values per thread."""
  values = rows * tiles.head_dim_padded(head_dim)
  warps = launch.num_warps
  while warps < MAX_WARPS and values > 32 * warps * MAX_ACCUMULATOR_PER_THREAD:
    warps *= 2
  return dataclasses.replace(launch, num_warps=warps)


def plan_launch(rows_padded: int, *, head_dim: int, itemsize: int,
                device_kind: str,
                preferred: DecodeLaunch | tuple[DecodeLaunch, ...]
                ) -> DecodePlan:
  """The launch of a decode call that fits the device's shared memory.

  The most rows per launch (at most MAX_ROWS_PER_LAUNCH), then the first of
  `preferred` (one launch or several, in order), FALLBACK_LAUNCHES that
  fits, with warps enough for the accumulator; with none fitting, half the
  rows. At 16 rows the smallest fallback fits every supported head dim and
  dtype on every GPU family block_sizes.shared_memory_limit knows.
  """
  if isinstance(preferred, DecodeLaunch):
    preferred = (preferred,)
  limit = block_sizes.shared_memory_limit(device_kind)
  rows = min(rows_padded, MAX_ROWS_PER_LAUNCH)
  while True:
    for launch in (*preferred, *FALLBACK_LAUNCHES):
      if shared_memory(launch, rows=rows, head_dim=head_dim,
                       itemsize=itemsize) <= limit:
        return DecodePlan(rows=rows, launch=_with_warps_for_accumulator(
            launch, rows, head_dim))
    if rows <= MIN_ROWS:
      raise NotImplementedError(
          f"decode attention at head_dim={head_dim} with {itemsize}-byte "
          f"elements does not fit this GPU's shared memory ({limit} bytes, "
          f"{device_kind!r}).")
    rows //= 2


def _dense_tile(ref, k_start, *, block_k: int, head_dim: int, batch,
                table_ref=None, kv_len=None):
  """Key/value rows [k_start, k_start + block_k) of a dense [S, H_p] ref;
  rows at or past the sequence's length are not read (0), so whatever the
  cache holds there (even NaN) cannot reach the output."""
  del batch, table_ref
  return tiles.load_tile(ref, k_start, block_k,
                         seq_len=jnp.minimum(kv_len, ref.shape[0]),
                         head_dim=head_dim)


def _paged_tile(ref, k_start, *, block_k: int, head_dim: int, batch,
                table_ref, kv_len):
  """The same rows of a paged cache (`tiles.load_paged_tile`)."""
  return tiles.load_paged_tile(ref, k_start, block_k, head_dim=head_dim,
                               table_ref=table_ref, batch=batch,
                               seq_len=kv_len)


def decode_kernel(q_ref, k_ref, v_ref, lengths_ref, q_lengths_ref, table_ref,
                  slopes_ref, qk_descale_ref, v_descale_ref, o_ref, lse_ref, *,
                  mask: MaskSpec, scale: float, soft_cap: float | None,
                  block_k: int, head_dim: int, num_tokens: int, group: int,
                  num_splits: int, num_rows: int, grid_axes,
                  row_offset: int = 0):
  split, batch, head = _grid_index(
      grid_axes, *(pl.program_id(axis) for axis in range(3)))
  fp8 = qk_descale_ref is not None
  if fp8:
    # The program's (batch, kv head) descales: q's x k's scales the logits
    # (a traced scalar in place of the static scale), v's the output.
    scale = scale * plgpu.load(qk_descale_ref.at[batch, head])
    v_descale = plgpu.load(v_descale_ref.at[batch, head])
  rows_padded = q_ref.shape[0]
  kv_len = plgpu.load(lengths_ref.at[batch])
  load_tile = functools.partial(
      _dense_tile if table_ref is None else _paged_tile, block_k=block_k,
      head_dim=head_dim, batch=batch, table_ref=table_ref, kv_len=kv_len)
  # Where token t sits: masks.causal_offset with the sequence's own query
  # length (bottom-right: position L - q_len + t).
  q_len = plgpu.load(q_lengths_ref.at[batch])
  offset = masks.causal_offset(mask, q_len, kv_len)
  rows = jnp.arange(rows_padded, dtype=jnp.int32)
  if row_offset:  # One of several launches over the packed rows.
    rows = rows + row_offset
  tokens = (rows // group)[:, None]

  # The key tiles any token sees, cut into num_splits chunks.
  runs = masks.key_blocks(mask, 0, num_tokens, block_k, num_tokens, kv_len,
                          offset).runs()
  first = jnp.asarray(runs[0][0], jnp.int32)
  last = jnp.maximum(jnp.asarray(runs[-1][1], jnp.int32), first)
  chunk = lax.div(last - first + (num_splits - 1), num_splits)
  lo = jnp.minimum(first + split * chunk, last)
  hi = jnp.minimum(lo + chunk, last)

  # The q, out and lse arrays hold num_rows rows (no padding in memory):
  # the tile's rows past them read as 0 and are not stored.
  valid_rows = None if num_rows == rows_padded else num_rows
  q = tiles.load_tile(q_ref, 0, rows_padded, seq_len=valid_rows,
                      head_dim=head_dim)
  if fp8:  # Exact: FP8_COMPUTE_DTYPE holds every e4m3 value.
    q = q.astype(FP8_COMPUTE_DTYPE)
  slope2 = None
  if slopes_ref is not None:
    if valid_rows is None:
      slopes = plgpu.load(slopes_ref.at[:])
    else:
      slopes = plgpu.load(slopes_ref.at[:], other=0.0,
                          mask=jnp.arange(rows_padded) < num_rows)
    slope2 = (slopes * numerics.LOG2_E)[:, None]

  def step(k_tile_index, carry):
    acc, row_max, row_sum = carry
    k_start = k_tile_index * block_k
    k, v = load_tile(k_ref, k_start), load_tile(v_ref, k_start)
    if fp8:  # One byte per element read; converted in registers.
      k, v = k.astype(FP8_COMPUTE_DTYPE), v.astype(FP8_COMPUTE_DTYPE)
    logits, _ = numerics.logits_base2(tiles.matmul(q, k, trans_b=True),
                                      scale=scale, soft_cap=soft_cap)
    cols = numerics.tile_columns(k_start, block_k)
    if slope2 is not None:
      # ALiBi: minus slope x distance from the token's position.
      distance = jnp.abs((tokens + offset - cols).astype(jnp.float32))
      logits = logits - slope2 * distance
    # Every tile is masked: decode is bound by reading the cache, and the
    # mask costs a few operations per element of a small tile.
    seen = masks.visible(mask, tokens, cols, kv_len, offset)
    logits = jnp.where(seen, logits, numerics.MASK_VALUE)
    new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
    probs = jnp.where(seen, jnp.exp2(logits - new_max[:, None]), 0.0)
    correction = jnp.exp2(row_max - new_max)
    row_sum = row_sum * correction + jnp.sum(probs, axis=1)
    acc = acc * correction[:, None] + tiles.matmul(probs.astype(v.dtype), v)
    return acc, new_max, row_sum

  acc, row_max, row_sum = lax.fori_loop(lo, hi, step, (
      jnp.zeros((rows_padded, q_ref.shape[-1]), jnp.float32),
      jnp.full((rows_padded,), numerics.MASK_VALUE, jnp.float32),
      jnp.zeros((rows_padded,), jnp.float32)))
  has_keys = row_sum > 0.0
  safe_sum = jnp.where(has_keys, row_sum, 1.0)
  normalizer = v_descale / safe_sum if fp8 else 1.0 / safe_sum
  out = acc * jnp.where(has_keys, normalizer, 0.0)[:, None]
  lse = jnp.where(has_keys, row_max + jnp.log2(safe_sum), -jnp.inf)
  tiles.store_tile(o_ref, 0, out, seq_len=num_rows, head_dim=head_dim)
  tiles.store_row_stats(lse_ref, 0, lse, seq_len=num_rows)


def decode_call(q_packed, key, value, lengths, slopes, block_table=None,
                q_lengths=None, qk_descale=None, v_descale=None, *,
                mask: MaskSpec,
                scale: float, soft_cap: float | None, num_tokens: int,
                group: int, num_splits: int, block_k: int, num_warps: int,
                num_stages: int, interpret: bool, out_dtype=jnp.float32,
                row_offset: int = 0, grid_axes=None):
  """The split partials of decode attention.

  Args:
    q_packed: [B, K, M, H], M packed rows (row r: token (row_offset + r)
      // g, query head kv * g + (row_offset + r) % g), not padded: the
      kernel's tile of M rounded up to a power of two >= MIN_ROWS rows
      reads the rows past M as 0 and stores none of them.
    key, value: dense caches [B, S, K, H], or with `block_table` paged
      caches [P, page_size, K, H].
    lengths: int32 [B], valid cache entries including the T new tokens.
    slopes: float32 [B, K, M] ALiBi slopes per row (natural units), or None.
    block_table: int32 [B, max_pages] page ids of each sequence, or None.
    q_lengths: int32 [B] query rows per sequence for the positions (the
      offsets below); None: T.
    qk_descale, v_descale: with an FP8 (float8_e4m3fn) q_packed, key and
      value, float32 [B, K]: q_descale x k_descale, which scales the
      logits, and v_descale, which scales the output; None otherwise.
    mask: MaskSpec(bottom_right causal or not, window, has_lengths=True).
    scale, soft_cap: as flash_attention's.
    num_tokens, group: T and g.
    num_splits, block_k, num_warps, num_stages: launch configuration
      (with pages smaller than block_k, or not a multiple of it, a tile
      gathers its rows from several pages).
    interpret: run through the Pallas interpreter.
    out_dtype: the partial outputs' dtype (float32 to be combined; the
      call's output dtype when one split's output is final).
    row_offset: the packed row index of q_packed's first row (a launch
      over a slice of the rows; see `plan_launch`).
    grid_axes: the order of the launch grid's axes, fastest first
      (default: GRID_AXES, read when the call is traced).

  Returns:
    (out [P, B, K, M, H] in out_dtype, lse2 float32 [P, B, K, M]) per
    split P;
    rows that see nothing in a split have lse2 = -inf and out = 0.
  """
  grid_axes = GRID_AXES if grid_axes is None else tuple(grid_axes)
  if sorted(grid_axes) != ["batch", "head", "split"]:
    raise ValueError(f"{grid_axes=} must order split, batch and head.")
  batch, num_kv_heads, num_rows, head_dim = q_packed.shape
  rows_padded = max(MIN_ROWS, pl.next_power_of_2(num_rows))
  head_dim_p = tiles.head_dim_padded(head_dim)
  # Index maps written over (split, batch, kv head), whatever the order.
  spec = lambda shape, index: pl.BlockSpec(
      shape, lambda *g: index(*_grid_index(grid_axes, *g)))
  q_spec = spec((None, None, rows_padded, head_dim_p),
                lambda s, b, h: (b, h, 0, 0))
  if block_table is None:  # Each program: its (batch, kv head)'s [S, H_p].
    kv_spec = spec((None, key.shape[1], None, head_dim_p),
                   lambda s, b, h: (b, 0, h, 0))
  else:  # Each program: every page of its kv head, [P, page_size, H_p].
    kv_spec = spec((*key.shape[:2], None, head_dim_p),
                   lambda s, b, h: (0, 0, h, 0))
  kernel = functools.partial(
      decode_kernel, mask=mask, scale=scale, soft_cap=soft_cap,
      block_k=block_k, head_dim=head_dim, num_tokens=num_tokens,
      group=group, num_splits=num_splits, num_rows=num_rows,
      row_offset=row_offset, grid_axes=grid_axes)
  whole = lambda x: spec(x.shape, lambda s, b, h: (0,) * x.ndim)
  optional = {
      "table_ref": (block_table, None if block_table is None
                    else whole(block_table)),
      "slopes_ref": (slopes, spec((None, None, rows_padded),
                                  lambda s, b, h: (b, h, 0))),
      # Whole [B, K] arrays; each program loads its (batch, kv head)'s.
      "qk_descale_ref": (qk_descale, None if qk_descale is None
                         else whole(qk_descale)),
      "v_descale_ref": (v_descale, None if v_descale is None
                        else whole(v_descale)),
  }
  present = [name for name, (array, _) in optional.items()
             if array is not None]
  if q_lengths is None:
    q_lengths = jnp.full((batch,), num_tokens, jnp.int32)
  in_specs = [q_spec, kv_spec, kv_spec, whole(lengths), whole(q_lengths),
              *(optional[name][1] for name in present)]
  args = [q_packed, key, value, lengths, q_lengths,
          *(optional[name][0] for name in present)]

  def body(q_ref, k_ref, v_ref, lengths_ref, q_lengths_ref, *refs):
    named = {name: None for name in optional}
    named.update(zip(present, refs[:len(present)]))
    o_ref, lse_ref = refs[len(present):]
    kernel(q_ref, k_ref, v_ref, lengths_ref, q_lengths_ref, o_ref=o_ref,
           lse_ref=lse_ref, **named)

  sizes = dict(split=num_splits, batch=batch, head=num_kv_heads)
  parts = (num_splits, batch, num_kv_heads, num_rows)
  return pl.pallas_call(
      body,
      grid=tuple(sizes[axis] for axis in grid_axes),
      in_specs=in_specs,
      out_specs=[
          spec((None, None, None, rows_padded, head_dim_p),
               lambda s, b, h: (s, b, h, 0, 0)),
          spec((None, None, None, rows_padded),
               lambda s, b, h: (s, b, h, 0)),
      ],
      out_shape=[
          sharding.output_struct((*parts, head_dim), out_dtype, q_packed,
                                 key),
          sharding.output_struct(parts, jnp.float32, q_packed, key),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                           num_stages=num_stages),
      interpret=interpret,
      name="jflash_decode",
  )(*args)
