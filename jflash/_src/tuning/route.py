"""Which backend runs a call by default where the priority order is not
the fastest: measured on Hopper, read when a call is planned (issue 23).

The registry tries its default backends in priority order (decode, mosaic,
triton, ...) and runs the first that supports the call. For two kinds of
call that order was measured to be wrong in places, and `preferred` names
the backend to run instead:

- Decode-shaped calls (at most `decode_backend.MAX_NEW_TOKENS` query rows
  per sequence, a dense cache, 16-bit): the split-K decode kernel packs a
  GQA group into one tile and reads each K/V tile once per kv head, 1.5-4x
  faster than the training kernels on GQA caches; on MHA caches (one query
  head per kv head) there is nothing to pack, and the training kernels'
  streams were 3-10% faster at B x S >= 4 x 8k (Mosaic at small batches,
  Triton at large ones). `RECORDS` holds every measured call; a call takes
  the verdict of the nearest record (`_distance`): the decode kernel unless
  another backend was faster there by more than `MARGIN` and `NOISE_US`.
- Paged prefill (more query rows than decode takes, a paged cache): the
  Mosaic forward gathers the pages into a dense copy first, which costs a
  read and a write of the cache; Triton reads the pages in its kernel but
  runs ~1.7x slower than Mosaic. Below `PAGED_GATHER_MIN_ROWS` query rows
  per kv head (tokens x GQA group) the gather costs more than it saves.

Elsewhere (other GPUs, float32, calls no record resembles in kind) the
priority order stands. The records are H100 measurements and are used on
every GPU of compute capability 9.0 (H100, H200).
"""

from __future__ import annotations

import math
from typing import Sequence

from jflash._src import platform
from jflash._src.spec import CallSpec

# `PYTHONPATH=. python3 benchmarks/decode_route.py --grid issue` (then
# `--grid route`, `--grid route_more`) on an NVIDIA H100 80GB HBM3, jax
# 0.11.2, 2026-11-25 (RECORD.md, "Issue 23: paged prefill and the decode
# route"; raw JSON in benchmarks/results/decode_route/). bf16, one to 16 new
# tokens, bottom-right causal, kv lengths in [S/2, S]; median µs per call of
# interleaved rounds. decode_us: the faster of the two samples of the
# decode kernel in each run ("decode" and the default route, then the same
# program): calls under ~150 µs moved up to 25% between samples.
MEASURED_ON = "NVIDIA H100 80GB HBM3"
COMPUTE_CAPABILITY = "9.0"
# (batch, kv_seq, num_heads, num_kv_heads, head_dim, tokens, decode_us,
#  triton_us, mosaic_us).
RECORDS = (
    (128, 1024, 32, 8, 128, 1, 162.6, 261.0, 377.5),
    (256, 512, 32, 8, 128, 1, 180.7, 281.1, 526.7),
    (64, 1024, 32, 8, 128, 1, 96.6, 148.3, 205.7),
    (128, 2048, 32, 8, 128, 1, 320.1, 510.4, 637.4),
    (32, 1024, 32, 32, 128, 1, 170.2, 159.0, 171.2),
    (16, 4096, 16, 8, 256, 1, 167.7, 197.4, 170.2),
    (8, 8192, 8, 1, 256, 1, 99.1, 251.6, 161.7),
    (1, 32768, 32, 8, 128, 1, 78.6, 300.2, 281.7),
    (64, 2048, 32, 32, 128, 1, 604.5, 576.8, 591.4),
    (1, 32768, 32, 8, 128, 4, 94.8, 364.0, 331.9),
    (4, 512, 32, 32, 128, 1, 66.0, 69.5, 60.8),
    (4, 512, 32, 32, 128, 4, 64.4, 66.6, 63.1),
    (4, 2048, 32, 32, 128, 1, 67.0, 69.4, 64.2),
    (4, 2048, 32, 32, 128, 4, 70.5, 77.3, 60.2),
    (4, 8192, 32, 32, 128, 1, 201.5, 195.8, 193.8),
    (4, 8192, 32, 32, 128, 4, 177.9, 165.2, 164.0),
    (32, 512, 32, 32, 128, 1, 103.2, 97.8, 112.1),
    (32, 512, 32, 32, 128, 4, 118.0, 105.4, 119.9),
    (32, 2048, 32, 32, 128, 1, 315.8, 298.2, 304.3),
    (32, 2048, 32, 32, 128, 4, 308.1, 300.5, 305.7),
    (32, 8192, 32, 32, 128, 1, 1170.3, 1119.6, 1125.9),
    (32, 8192, 32, 32, 128, 4, 1201.5, 1146.8, 1159.6),
    (128, 512, 32, 32, 128, 1, 337.7, 308.8, 359.1),
    (128, 512, 32, 32, 128, 4, 336.3, 312.4, 353.8),
    (128, 2048, 32, 32, 128, 1, 1136.7, 1083.0, 1126.5),
    (128, 2048, 32, 32, 128, 4, 1171.8, 1127.3, 1157.8),
    (128, 8192, 32, 32, 128, 1, 4231.8, 4108.8, 4143.9),
    (4, 512, 32, 8, 128, 1, 85.3, 88.3, 83.4),
    (4, 512, 32, 8, 128, 4, 69.9, 77.0, 70.1),
    (4, 2048, 32, 8, 128, 1, 65.0, 74.1, 64.5),
    (4, 2048, 32, 8, 128, 4, 67.6, 75.8, 65.5),
    (4, 8192, 32, 8, 128, 1, 77.1, 102.0, 97.8),
    (4, 8192, 32, 8, 128, 4, 73.3, 98.3, 94.0),
    (32, 512, 32, 8, 128, 1, 110.3, 117.2, 120.1),
    (32, 512, 32, 8, 128, 4, 66.1, 72.3, 85.4),
    (32, 2048, 32, 8, 128, 1, 101.8, 159.7, 177.2),
    (32, 2048, 32, 8, 128, 4, 95.7, 183.2, 182.3),
    (32, 8192, 32, 8, 128, 1, 309.8, 611.9, 561.2),
    (32, 8192, 32, 8, 128, 4, 307.7, 577.5, 523.9),
    (4, 512, 16, 8, 128, 1, 78.9, 89.1, 79.5),
    (4, 2048, 16, 8, 128, 1, 72.0, 74.9, 66.0),
    (32, 512, 16, 8, 128, 1, 62.9, 72.3, 67.8),
    (32, 2048, 16, 8, 128, 1, 93.5, 95.2, 109.4),
    (4, 2048, 16, 16, 64, 1, 65.0, 72.5, 63.1),
    (32, 2048, 16, 16, 64, 1, 101.2, 109.7, 105.8),
    (4, 2048, 16, 16, 256, 1, 83.3, 118.0, 85.8),
    (32, 2048, 16, 16, 256, 1, 324.0, 310.9, 312.6),
    (32, 2048, 8, 1, 128, 1, 77.7, 84.2, 76.1),
    (32, 2048, 32, 32, 128, 16, 308.4, 303.8, 297.8),
)
BACKENDS = ("decode", "triton", "mosaic")
# Another backend must beat the decode kernel by more than this factor and
# by more than NOISE_US at the nearest record to take a call from it: the
# decode kernel's two samples per record (the same program) differed by a
# median 1.3 µs, up to 4 µs in three of four records under 150 µs (and
# 1-3% above), with rare outliers of 14-25 µs.
MARGIN = 1.03
NOISE_US = 5.0
# Query rows per kv head (tokens x GQA group) from which the Mosaic forward
# on gathered pages beats Triton reading the pages (H100, 2026-11-25,
# `benchmarks/paged_prefill.py`: 256 rows (8 x 256 tokens, MHA, 4k cache):
# Triton 0.532 ms, Mosaic 0.686 ms; 2048 rows (4 x 512 tokens, group 4, 8k
# cache): Triton 0.816, Mosaic 0.582). The gather costs 2 x the cache's
# bytes at copy bandwidth; attention flops per cache byte grow with the rows.
PAGED_GATHER_MIN_ROWS = 512
# The decode kernel's limit (decode_backend.MAX_NEW_TOKENS; this module
# sits below the backends and does not import them).
DECODE_MAX_TOKENS = 16


def _features(batch, kv_seq, num_heads, num_kv_heads, head_dim, tokens):
  """Log-scale coordinates of a call; the GQA group weighs most (it decides
  whether the decode kernel has rows to pack)."""
  log2 = lambda x: math.log2(max(x, 1))
  return (2.0 * log2(num_heads // num_kv_heads), 0.5 * log2(tokens),
          log2(batch * num_kv_heads), log2(kv_seq), log2(head_dim))


def _distance(a, b) -> float:
  return sum((x - y) ** 2 for x, y in zip(a, b))


def nearest_record(spec: CallSpec):
  """The measured record nearest to the call."""
  here = _features(spec.batch, spec.kv_len, spec.num_heads,
                   spec.num_kv_heads, spec.head_dim, spec.q_len)
  return min(RECORDS, key=lambda r: _distance(here, _features(*r[:6])))


def fastest_at(record, candidates: Sequence[str]) -> str | None:
  """The backend among `candidates` to run calls like `record`: decode
  unless another was faster by more than MARGIN and NOISE_US; None without
  a measured candidate."""
  times = {name: us for name, us in zip(BACKENDS, record[6:])
           if name in candidates}
  if not times:
    return None
  best = min(times, key=times.get)
  decode = times.get("decode")
  if decode is not None and (decode <= MARGIN * times[best]
                             or decode - times[best] <= NOISE_US):
    return "decode"
  return best


def preferred(spec: CallSpec, candidates: Sequence[str]) -> str | None:
  """The backend among `candidates` (default backends that can run the
  call's forward pass, in priority order) that should run it, or None to
  keep the priority order."""
  if platform.cuda_compute_capability() != COMPUTE_CAPABILITY:
    return None
  if spec.dtype not in ("bfloat16", "float16"):
    return None
  if spec.mask.paged:
    rows = spec.q_len * spec.group
    if (spec.q_len > DECODE_MAX_TOKENS and rows < PAGED_GATHER_MIN_ROWS
        and "triton" in candidates):
      return "triton"
    return None
  if spec.q_len > DECODE_MAX_TOKENS or "decode" not in candidates:
    return None
  return fastest_at(nearest_record(spec), candidates)
