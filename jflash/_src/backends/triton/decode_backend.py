"""The "decode" backend: the split-K kernel (decode.py) for calls with few
query rows per sequence (generation: 1-16 new tokens), dense or paged
caches; forward only (the backward of such a call is chosen separately).

Host side: the query packing (the GQA group x tokens as the rows of one
tile), the launch plan and split count, and the combine of the split
partials through their lse (attention sinks as one more partial).

FP8: it takes float8_e4m3fn calls natively (forward only, as every call
here): the kernel reads the e4m3 query and cache (dense or paged), one
byte per element, converts tiles in registers (`triton_decode.
FP8_COMPUTE_DTYPE`) and applies the descales per (batch, kv head): q's x
k's in the logit scale, v's on the output, which is written in the call's
`out_dtype`. float8_e5m2 calls run dequantized (registry.plan).

`implementation=None` chooses it, ahead of the training kernels, for every
call it supports (`check`): on an H100 it was 1.0-2.6x faster than the
default route of the training kernels on decode batches of 512-32768 keys
(RECORD.md, "Issue 12 (decoding)", and issue 23's table).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jflash._src import numerics
from jflash._src import platform
from jflash._src import registry
from jflash._src.backends.triton import decode as triton_decode
from jflash._src.backends.triton import tiles
from jflash._src.spec import CallSpec
from jflash._src.spec import Operands

# The most new tokens per sequence the kernel takes (a query tile of at
# most MAX_NEW_TOKENS x the GQA group rows per kv head).
MAX_NEW_TOKENS = 16
# The fewest key tiles a split is given.
MIN_TILES_PER_SPLIT = 4
# Programs per multiprocessor that fill a GPU (two resident per SM).
PROGRAMS_PER_SM = 2

DecodeLaunch = triton_decode.DecodeLaunch
# The preferred launch, read when a call is traced (benchmarks/decode.py
# --sweep patches it); calls it does not fit take a fallback
# (`triton_decode.plan_launch`).
DEFAULT_LAUNCH = DecodeLaunch()
# The preferred launch of a 16-row tile of 16-bit elements at head dim 128,
# on a dense cache or pages a multiple of its key tile, where each program
# streams a long run of keys: one split (many sequences: B x K programs
# fill the GPU), or splits of at least WIDE_TILE_MIN_KEYS_PER_SPLIT cache
# entries. 128-key tiles, 3 stages (143 KB of shared memory: one program
# per multiprocessor). On an H100 (bf16, lengths S/2..S): one split 1-4%
# faster than DEFAULT_LAUNCH at 64-128 sequences of 1024-2048 keys, within
# 1% at 128 x 1024 and 256 x 512 (RECORD.md, 2026-11-25, issue 23 item 2);
# split calls +8% at 16 x 16384 (64/8 heads, 3 splits of 5461 keys, two
# runs), +2% with 2 splits of 4096 keys, within the spread of ~100 us calls
# (+-4% in two runs) with splits of 1000-2000 keys, 7% slower with splits
# of 256 keys (RECORD.md, 2026-11-26, "decode split counts against the
# GPU's waves" and "the wide key tiles on long splits, checked"): taken
# from 4096 keys per split. Not measured on other GPUs. None:
# DEFAULT_LAUNCH everywhere (benchmarks/decode.py --parts sweep sets it
# so).
WIDE_TILE_LAUNCH = DecodeLaunch(block_k=128, num_warps=4, num_stages=3)
WIDE_TILE_MIN_KEYS_PER_SPLIT = 4096
# The preferred launch of FP8 caches: DEFAULT_LAUNCH's 64-key tiles with one
# stage fewer. H100, T=1, 32/8 heads, lengths in [S/2, S], three runs (two
# draws) of 9-11 interleaved rounds, issue 24's five B x S >= 128k rows
# (D=128 128x1024 ... 16x8192, D=256 16x8192): 0.5-5.5% faster than
# (64, 4, 4) in every run of every row, bitwise the same output; 128-key
# tiles -3..+3%, 8 warps 5-20% slower, 2 stages or 32-key tiles up to 25%
# slower (RECORD.md, 2026-11-26, "FP8 decode under other launches"). None:
# DEFAULT_LAUNCH.
FP8_LAUNCH = DecodeLaunch(block_k=64, num_warps=4, num_stages=3)


def default_num_splits(batch: int, num_kv_heads: int, kv_seq: int,
                       block_k: int | None = None, *, fp8: bool = False
                       ) -> int:
  """Splits per (sequence, kv head): none when B x K programs already fill
  the GPU, else as many as fit one wave of PROGRAMS_PER_SM programs per
  multiprocessor (rounded down: a call whose programs overshoot the wave,
  288-320 of 264 on an H100, ran 4-7% slower than one within it; RECORD.md,
  2026-11-26, "split counts that overshoot one wave"), with at least
  MIN_TILES_PER_SPLIT key tiles each (splits past a sequence's length do no
  work). An FP8 cache (`fp8`) whose one-split programs make fewer than
  FP8_SPLIT_MAX_WAVES waves takes at least FP8_SPLITS splits."""
  slots = PROGRAMS_PER_SM * platform.multiprocessor_count()
  programs = batch * num_kv_heads
  key_tiles = -(-kv_seq // (block_k or DEFAULT_LAUNCH.block_k))
  most = max(1, key_tiles // MIN_TILES_PER_SPLIT)
  wave = 1 if programs >= 0.8 * slots else slots // programs
  fp8_slots = FP8_PROGRAMS_PER_SM * platform.multiprocessor_count()
  if fp8 and programs < FP8_SPLIT_MAX_WAVES * fp8_slots:
    return max(1, min(most, max(FP8_SPLITS, wave)))
  return max(1, min(most, wave))


# FP8 caches: the kernel's one-split programs hold 135 registers a thread
# (ncu, H100: 3 programs of 4 warps per multiprocessor) and run ~1.6x
# faster than bf16's, and a call of few waves ends on a tail: the programs
# of its longest sequences. Served batches have ragged lengths, which a
# call cannot see (they are traced), so FP8 calls of fewer than
# FP8_SPLIT_MAX_WAVES waves of one-split programs cut each sequence into
# at least FP8_SPLITS. H100, T=1, 32/8 heads, lengths uniform in [S/2, S]
# (three draws): 4 splits against the former rule's count 14-20% faster at
# 24 x 4096 (0.48 waves), 6-18% at 32 x 4096 and 40 x 4096, 3-6% at 48 x
# 4096, 10-13% at 96 x 2048 (1.94), 4-8% at 16 x 8192 (D=128; 0-6% at
# D=256), 2-3% (against 1) at 128 x 2048 (2.59 waves), nothing at 128 x
# 1024 (2.59, 16-tile sequences: 3% slower with every sequence full, hence
# the 2.5). With every sequence full, up to 5% slower (32 x 4096, 16 x
# 8192) or 6-14% faster (24 x 4096, 40 x 4096). bf16 caches gain nothing
# from more splits on ragged lengths: their rule stays (RECORD.md,
# 2026-11-26, "FP8 decode split counts with ragged lengths, 1-2.6 waves"
# and "the FP8 ragged-tail split rule, checked").
FP8_PROGRAMS_PER_SM = 3
FP8_SPLITS = 4
FP8_SPLIT_MAX_WAVES = 2.5


def preferred_launches(*, num_splits: int, kv_seq: int, rows_padded: int,
                       head_dim: int, itemsize: int,
                       page_size: int | None = None
                       ) -> tuple[DecodeLaunch, ...]:
  """The launches `kernel_attention` asks `plan_launch` for, in order:
  FP8_LAUNCH first for FP8 caches (`itemsize` 1), WIDE_TILE_LAUNCH first
  where it was measured faster (see there: one split, or splits of at least
  WIDE_TILE_MIN_KEYS_PER_SPLIT of the kv_seq cache entries; a paged cache
  only with pages a multiple of its key tile, which are read without a
  gather), then DEFAULT_LAUNCH."""
  if itemsize == 1 and FP8_LAUNCH is not None:
    return (FP8_LAUNCH, DEFAULT_LAUNCH)
  wide = WIDE_TILE_LAUNCH
  long_splits = (num_splits == 1
                 or kv_seq >= num_splits * WIDE_TILE_MIN_KEYS_PER_SPLIT)
  if (wide is not None and long_splits
      and rows_padded <= triton_decode.MIN_ROWS and itemsize == 2
      and tiles.head_dim_padded(head_dim) == 128
      and (page_size is None or page_size % wide.block_k == 0)):
    return (wide, DEFAULT_LAUNCH)
  return (DEFAULT_LAUNCH,)


def _pack(x, num_kv_heads: int):
  """[B, T, N, ...] -> [B, K, T * g, ...]: row r = t * g + j holds token t
  of query head kv * g + j (at T = 1 a reshape, no copy)."""
  batch, num_tokens, num_heads = x.shape[:3]
  group = num_heads // num_kv_heads
  x = x.reshape(batch, num_tokens, num_kv_heads, group, *x.shape[3:])
  return jnp.moveaxis(x, 2, 1).reshape(batch, num_kv_heads,
                                       num_tokens * group, *x.shape[4:])


def _unpack(x, num_tokens: int, num_heads: int):
  """The inverse of `_pack`: [B, K, T * g, ...] -> [B, T, N, ...]."""
  batch, num_kv_heads = x.shape[:2]
  group = num_heads // num_kv_heads
  x = x.reshape(batch, num_kv_heads, num_tokens, group, *x.shape[3:])
  return jnp.moveaxis(x, 1, 2).reshape(batch, num_tokens, num_heads,
                                       *x.shape[4:])


def combine(out_parts, lse2_parts, sink2=None):
  """Merges split partials through their base-2 lse.

  Args:
    out_parts: float32 [P, ..., H], each split's normalized output.
    lse2_parts: float32 [P, ...], each split's lse (-inf: saw nothing).
    sink2: float32 [...] base-2 sink logits, a partial with no value, or
      None.

  Returns:
    (out [..., H], lse2 [...]); rows that saw nothing: 0 and -inf (with a
    sink: 0 and the sink).
  """
  lse2_all = lse2_parts if sink2 is None else jnp.concatenate(
      [lse2_parts, sink2[None]], axis=0)
  top = jnp.max(lse2_all, axis=0)
  # All -inf (nothing seen, no sink): weights of 0, never exp2(nan).
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  weights = jnp.exp2(lse2_all - top[None])
  total = jnp.sum(weights, axis=0)
  safe_total = jnp.where(total > 0.0, total, 1.0)
  out = jnp.sum(weights[:lse2_parts.shape[0], ..., None] * out_parts,
                axis=0) / safe_total[..., None]
  lse2 = jnp.where(total > 0.0, top + jnp.log2(safe_total), -jnp.inf)
  return out, lse2


def kernel_attention(query, key, value, lengths, block_table, sinks, slopes,
                     *, mask, scale, soft_cap, num_splits, interpret,
                     q_lengths=None, descales=None, out_dtype=None):
  """The split-K kernel and the combine: (out [B, T, N, H], lse2 [B, T, N],
  -inf for rows that see nothing and have no sink).

  Positions are `masks.causal_offset`'s with the sequence's query length
  (`q_lengths`, default T): with a bottom-right `mask`, token t sits at
  position L - T + t, for the causal mask, windows and ALiBi.

  `descales`: for an FP8 query and cache, float32 [B, K] (q_descale x
  k_descale, v_descale); None otherwise. `out_dtype`: the output's dtype
  (default: the query's).
  """
  out_dtype = query.dtype if out_dtype is None else out_dtype
  qk_descale, v_descale = (None, None) if descales is None else descales
  batch, num_tokens, num_heads, _ = query.shape
  num_kv_heads = key.shape[2]
  group = num_heads // num_kv_heads
  # The packed rows, T x g per kv head, stay unpadded in memory; the
  # kernel's tiles are a power of two >= MIN_ROWS rows.
  num_rows = num_tokens * group
  rows_padded = max(triton_decode.MIN_ROWS,
                    1 << (num_rows - 1).bit_length())
  plan = triton_decode.plan_launch(
      rows_padded, head_dim=query.shape[-1],
      itemsize=jnp.dtype(query.dtype).itemsize,
      device_kind=platform.device_kind(), preferred=preferred_launches(
          num_splits=num_splits, rows_padded=rows_padded,
          kv_seq=(key.shape[1] if block_table is None
                  else block_table.shape[1] * key.shape[1]),
          head_dim=query.shape[-1], itemsize=jnp.dtype(query.dtype).itemsize,
          page_size=None if block_table is None else key.shape[1]))
  per_row = lambda x: None if x is None else _pack(
      jnp.broadcast_to(x[:, None, :], (batch, num_tokens, num_heads)),
      num_kv_heads)
  # One split and no sink: the kernel's output is final (written in the
  # output dtype) and the combine is skipped.
  final = num_splits == 1 and sinks is None
  q_packed, slopes_packed = _pack(query, num_kv_heads), per_row(slopes)
  # The packed rows in launches of plan.rows rows (one launch if it fits).
  rows_of = lambda x, start: None if x is None else (
      x if plan.rows >= num_rows else x[:, :, start:start + plan.rows])
  parts = [
      triton_decode.decode_call(
          rows_of(q_packed, start), key, value, lengths,
          rows_of(slopes_packed, start), block_table, q_lengths,
          qk_descale=qk_descale, v_descale=v_descale, mask=mask,
          scale=scale, soft_cap=soft_cap, num_tokens=num_tokens, group=group,
          num_splits=num_splits, block_k=plan.launch.block_k,
          num_warps=plan.launch.num_warps,
          num_stages=plan.launch.num_stages,
          out_dtype=out_dtype if final else jnp.float32,
          interpret=interpret, row_offset=start)
      for start in range(0, num_rows, plan.rows)]
  if len(parts) == 1:
    out_parts, lse2_parts = parts[0]
  else:  # Rows are axis 3 of [P, B, K, M, ...].
    out_parts, lse2_parts = (jnp.concatenate(x, axis=3)
                             for x in zip(*parts))
  if final:
    out, lse2 = out_parts[0], lse2_parts[0]
  else:
    sink2 = per_row(None if sinks is None else sinks * numerics.LOG2_E)
    out, lse2 = combine(out_parts, lse2_parts, sink2)
  return (_unpack(out, num_tokens, num_heads).astype(out_dtype),
          _unpack(lse2, num_tokens, num_heads))


CAPABILITIES = registry.Capabilities(
    passes=frozenset({registry.FORWARD}),
    # float8_e4m3fn: read as is and converted in the kernel (forward only,
    # as every call here); float8_e5m2 runs dequantized.
    dtypes=("float32", "bfloat16", "float16", "float8_e4m3fn"),
    max_head_dim=256,
    mask_features=frozenset({"causal", "bottom_right", "window", "lengths",
                             "paged"}),
    options=frozenset({"soft_cap", "sinks", "alibi", "return_lse"}),
    platforms=frozenset({"cuda"}),
    interpretable=True,
)


def check(spec: CallSpec, pass_: str) -> str | None:
  """The kernel takes at most MAX_NEW_TOKENS query rows per sequence."""
  del pass_
  if spec.q_len > MAX_NEW_TOKENS:
    return (f"decode takes at most {MAX_NEW_TOKENS} query rows per "
            f"sequence; got q_len={spec.q_len}.")
  return None


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Splits per (sequence, kv head) and the interpreter flag."""

  num_splits: int
  interpret: bool = False


def configure(spec: CallSpec, *, interpret: bool = False,
              num_splits: int | None = None) -> DecodeConfig:
  """The user's `num_splits` (decode_attention), else enough to fill the
  GPU (`default_num_splits`)."""
  if num_splits is None:
    num_splits = default_num_splits(spec.batch, spec.num_kv_heads,
                                    spec.kv_len, fp8=spec.is_fp8)
  return DecodeConfig(num_splits=num_splits, interpret=interpret)


def forward(spec: CallSpec, config: DecodeConfig, operands: Operands):
  """(out, lse2 [B, N, T], +inf for rows without keys), as every forward.

  An FP8 call's out is in `spec.out_dtype`; its lse2 is the dequantized
  logits'."""
  q_lengths, kv_lengths = operands.lengths()
  descales = None
  if spec.is_fp8:
    # Per (batch, kv head): q's and k's descales scale the logits, v's the
    # output (spec.py's contract).
    descales = (operands.q_descale * operands.k_descale,
                operands.v_descale)
  out, lse2 = kernel_attention(
      operands.query, operands.key, operands.value, kv_lengths,
      operands.block_table, operands.sinks, operands.alibi_slopes,
      mask=spec.mask, scale=spec.scale, soft_cap=spec.logits_soft_cap,
      num_splits=config.num_splits, interpret=config.interpret,
      q_lengths=q_lengths, descales=descales,
      out_dtype=jnp.dtype(spec.output_dtype))
  if operands.q_lengths is not None:
    # Rows past q_len see nothing (flash_attention's lengths).
    valid = jnp.arange(out.shape[1])[None, :] < q_lengths[:, None]
    out = jnp.where(valid[:, :, None, None], out, 0).astype(out.dtype)
    lse2 = jnp.where(valid[:, :, None], lse2, -jnp.inf)
  # The residual format: +inf, not -inf, for rows without keys (p = 0).
  lse2 = jnp.where(jnp.isneginf(lse2), jnp.inf, lse2)
  return out, jnp.swapaxes(lse2, 1, 2)


BACKEND = registry.Backend(
    name="decode",
    capabilities=CAPABILITIES,
    keywords=frozenset({"num_splits"}),
    configure=configure,
    forward=forward,
    backward=None,
    check=check,
    limits=(f"at most {MAX_NEW_TOKENS} query rows per sequence; forward "
            "only; float8_e4m3fn natively (the cache read as e4m3, any "
            "out_dtype), float8_e5m2 dequantized"),
)
