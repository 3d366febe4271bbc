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
  head per kv head) there is nothing to pack: since the decode kernel keeps
  its rows unpadded in memory (2026-11-26) it is level with the training
  kernels or up to 4% faster there, but Mosaic stays ahead on the shortest
  calls (4 sequences of 512 keys, ~40 us) and Triton at 4 x 8k with 4
  tokens. `RECORDS` holds every measured call; a call takes
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

# `PYTHONPATH=. python3 benchmarks/decode_route.py --grid issue`, `--grid
# route` and `--grid route_more` (`--rounds 11 --iters 30`) on an NVIDIA
# H100 80GB HBM3, jax 0.11.2, 2026-11-26, after the decode kernel's changes
# for short caches (RECORD.md, "The decode route's records re-measured for
# the new decode kernel"; raw JSON in
# benchmarks/results/decode_route/records_2026-11-26/). bf16, one to 16 new
# tokens, bottom-right causal, kv lengths in [S/2, S]; median µs per call of
# interleaved rounds. decode_us: the faster of the decode kernel's samples
# ("decode", and the default route where it ran the decode kernel); a call
# measured in two grids keeps each backend's faster sample: calls under
# ~150 µs moved up to 25% between samples.
MEASURED_ON = "NVIDIA H100 80GB HBM3"
COMPUTE_CAPABILITY = "9.0"
# (batch, kv_seq, num_heads, num_kv_heads, head_dim, tokens, decode_us,
#  triton_us, mosaic_us).
RECORDS = (
    (128, 1024, 32, 8, 128, 1, 155.2, 271.4, 371.6),
    (256, 512, 32, 8, 128, 1, 157.7, 270.8, 479.4),
    (64, 1024, 32, 8, 128, 1, 88.8, 148.3, 196.2),
    (128, 2048, 32, 8, 128, 1, 284.7, 483.0, 579.7),
    (32, 1024, 32, 32, 128, 1, 151.7, 159.3, 166.9),
    (16, 4096, 16, 8, 256, 1, 159.8, 192.4, 173.4),
    (8, 8192, 8, 1, 256, 1, 55.2, 255.2, 155.0),
    (1, 32768, 32, 8, 128, 1, 43.8, 213.3, 192.8),
    (64, 2048, 32, 32, 128, 1, 526.0, 542.0, 562.9),
    (1, 32768, 32, 8, 128, 4, 58.2, 308.7, 277.2),
    (4, 512, 32, 32, 128, 1, 50.7, 42.5, 35.8),
    (4, 512, 32, 32, 128, 4, 41.2, 48.6, 40.4),
    (4, 2048, 32, 32, 128, 1, 56.7, 58.1, 57.2),
    (4, 2048, 32, 32, 128, 4, 56.7, 57.3, 56.4),
    (4, 8192, 32, 32, 128, 1, 155.2, 155.7, 155.5),
    (4, 8192, 32, 32, 128, 4, 167.9, 154.6, 155.0),
    (32, 512, 32, 32, 128, 1, 88.4, 86.9, 101.4),
    (32, 512, 32, 32, 128, 4, 92.1, 89.7, 102.7),
    (32, 2048, 32, 32, 128, 1, 286.1, 295.5, 302.1),
    (32, 2048, 32, 32, 128, 4, 298.1, 311.2, 310.1),
    (32, 8192, 32, 32, 128, 1, 1112.8, 1119.2, 1120.3),
    (32, 8192, 32, 32, 128, 4, 1074.5, 1081.6, 1089.6),
    (128, 512, 32, 32, 128, 1, 297.5, 306.4, 348.8),
    (128, 512, 32, 32, 128, 4, 315.3, 314.3, 360.0),
    (128, 2048, 32, 32, 128, 1, 1062.3, 1098.6, 1133.5),
    (128, 2048, 32, 32, 128, 4, 1063.1, 1090.9, 1118.5),
    (128, 8192, 32, 32, 128, 1, 4229.4, 4265.2, 4297.3),
    (128, 8192, 32, 32, 128, 4, 4139.9, 4170.7, 4200.6),
    (4, 512, 32, 8, 128, 1, 52.3, 47.7, 42.5),
    (4, 512, 32, 8, 128, 4, 39.4, 42.2, 37.3),
    (4, 2048, 32, 8, 128, 1, 46.7, 50.8, 43.4),
    (4, 2048, 32, 8, 128, 4, 58.4, 66.8, 54.8),
    (4, 8192, 32, 8, 128, 1, 60.3, 95.4, 96.4),
    (4, 8192, 32, 8, 128, 4, 65.0, 92.0, 90.2),
    (32, 512, 32, 8, 128, 1, 76.6, 74.3, 75.2),
    (32, 512, 32, 8, 128, 4, 45.7, 49.6, 75.2),
    (32, 2048, 32, 8, 128, 1, 88.4, 159.7, 170.4),
    (32, 2048, 32, 8, 128, 4, 89.4, 154.5, 164.5),
    (32, 8192, 32, 8, 128, 1, 303.7, 570.5, 505.9),
    (32, 8192, 32, 8, 128, 4, 304.7, 580.9, 515.1),
    (128, 512, 32, 8, 128, 1, 89.3, 146.4, 251.2),
    (128, 512, 32, 8, 128, 4, 103.8, 148.0, 256.9),
    (128, 2048, 32, 8, 128, 4, 302.2, 493.8, 587.8),
    (128, 8192, 32, 8, 128, 1, 1119.1, 2229.5, 1973.1),
    (128, 8192, 32, 8, 128, 4, 1107.1, 2183.3, 1938.8),
    (8, 4096, 16, 16, 64, 1, 53.8, 51.4, 55.4),
    (32, 2048, 16, 16, 64, 1, 82.9, 86.6, 87.3),
    (8, 4096, 16, 16, 256, 1, 167.9, 180.5, 166.3),
    (32, 2048, 16, 16, 256, 1, 270.6, 283.7, 281.2),
    (32, 2048, 8, 1, 128, 1, 38.6, 58.0, 57.4),
    (8, 8192, 8, 1, 128, 4, 73.7, 97.6, 91.3),
    (4, 512, 16, 8, 128, 1, 46.2, 44.0, 35.6),
    (4, 2048, 16, 8, 128, 1, 38.4, 46.9, 39.4),
    (32, 512, 16, 8, 128, 1, 74.5, 74.2, 69.6),
    (32, 2048, 16, 8, 128, 1, 84.4, 91.6, 102.6),
    (4, 2048, 16, 16, 64, 1, 38.3, 46.1, 37.4),
    (4, 2048, 16, 16, 256, 1, 50.5, 86.6, 57.4),
    (32, 2048, 32, 32, 128, 16, 293.1, 296.9, 291.4),
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
