"""`jflash.autotune`: search tile sizes for one shape, check them, cache
the winner.

The search runs on any registered backend that declares a tuning space
(`registry.Backend.tuning`: Triton's `BlockSizes` in
backends/triton/tuning.py, Mosaic's `MosaicBlockSizes` in
backends/mosaic/tuning.py) for one problem shape on the current device, in
two phases (forward tiles timed forward-only, then backward tiles timed as
forward+backward with the chosen forward tiles). It rejects every candidate
that fails to compile or whose result disagrees with the reference, and
stores the winner in a JSON file keyed by device kind, shape and backend
(tuning/cache.py), which the backends read whenever a call comes without
`block_sizes`, so a shape tuned once stays tuned. This module sits above
the public function, which it calls; nothing in jflash imports it but
`jflash.autotune` itself.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jflash._src import api
from jflash._src import registry
from jflash._src.backends.mosaic.config import MosaicBlockSizes
from jflash._src.backends.triton.block_sizes import BlockSizes
from jflash._src.tuning import cache
from jflash._src.tuning.space import TuningSpace

# Largest relative error (max |x - ref| / max |ref|) a candidate may show
# against the float32 reference, per input dtype. Loose enough for 16-bit
# rounding, far below what a wrong tile loop produces (order 1).
_MAX_RELATIVE_ERROR = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}


def _spaces() -> dict[str, TuningSpace]:
  """The registered backends' tuning spaces, in priority order."""
  backends = (registry.get(name) for name in registry.names())
  return {b.name: b.tuning for b in backends if b.tuning is not None}


def _relative_error(values, references) -> float:
  worst = 0.0
  for x, ref in zip(values, references):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    scale = max(float(np.max(np.abs(ref), initial=0.0)), 1e-6)
    worst = max(worst, float(np.max(np.abs(x - ref), initial=0.0)) / scale)
  return worst


def _median_seconds(fn, args, repeats: int, iters: int) -> float:
  jax.block_until_ready(fn(*args))  # Compile and warm up.
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / iters)
  return statistics.median(times)


def autotune(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    is_causal: bool = False,
    implementation: str = "triton",
    forward_candidates: Sequence[tuple[int, ...]] | None = None,
    backward_candidates: Sequence[tuple[int, ...]] | None = None,
    interpret: bool = False,
    repeats: int = 5,
    iters: int = 3,
    path: str | None = None,
    verbose: bool = False,
) -> BlockSizes | MosaicBlockSizes:
  """Finds the fastest correct tiles for this shape and caches them.

  Args:
    query: [batch, q_len, num_heads, head_dim], the shape (and dtype) to
      tune; its values are used for the timings and the checks, so pass
      realistic random data, never zeros.
    key: [batch, kv_len, num_kv_heads, head_dim].
    value: same shape as key.
    is_causal: tune the causal kernels.
    implementation: whose tiles to tune: "triton" (`BlockSizes`) or
      "mosaic" (`MosaicBlockSizes`, on a Hopper GPU); any registered
      backend with a tuning space.
    forward_candidates: triton: (block_q, block_k, num_warps, num_stages)
      tuples; mosaic: (block_q, block_kv, num_stages); default the
      backend's `tuning.FORWARD_CANDIDATES` (its `TuningSpace`).
    backward_candidates: triton: (block_q_dkv, block_k_dkv, block_q_dq,
      block_k_dq, num_warps_bwd, num_stages_bwd) tuples; mosaic:
      (block_q_dq, block_kv_dq, block_q_dkv, block_kv_dkv,
      backward_stages); default the backend's `tuning.BACKWARD_CANDIDATES`.
    interpret: run the Triton kernels through the Pallas interpreter (for
      tests on machines without a GPU; the timings then mean nothing).
    repeats: timed repeats per candidate (the median counts).
    iters: calls per timed repeat.
    path: cache file; default `cache.cache_path()`. None and caching
      disabled: nothing is written.
    verbose: print each candidate's time or the reason it was rejected.

  Returns:
    The winning tiles (also written to the cache).

  Raises:
    ValueError: if the inputs are not 4-D, the implementation is not one
      with tiles, or every candidate of a phase is rejected.
    NotImplementedError: if the implementation cannot run here (e.g.
      "mosaic" off Hopper), with the registry's reason.
  """
  spaces = _spaces()
  if implementation not in spaces:
    raise ValueError(f"implementation must be one of {tuple(spaces)}; got "
                     f"{implementation!r}.")
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  if query.ndim != 4 or key.ndim != 4 or key.shape != value.shape:
    raise ValueError(
        "autotune takes 4-D query [batch, q_len, heads, head_dim] and key/"
        f"value of one shape; got query.shape={query.shape}, "
        f"key.shape={key.shape}, value.shape={value.shape}.")
  # `interpret` goes to the backends that can be interpreted only.
  taken = registry.get(implementation).option_names
  options = {"interpret": interpret} if "interpret" in taken else {}
  reason = api.unsupported_reason(query, key, value, is_causal=is_causal,
                                  implementation=implementation, **options)
  if reason is not None:
    raise NotImplementedError(f"jflash.autotune: {reason}")
  space = spaces[implementation]
  spec = api.describe(query, key, value, is_causal=is_causal).spec
  key_of_shape = cache.call_key(spec, implementation)
  cotangent = jax.random.normal(jax.random.key(0), query.shape, query.dtype)
  upcast = [x.astype(jnp.float32) for x in (query, key, value)]
  with jax.default_matmul_precision("highest"):
    ref_out, ref_vjp = jax.vjp(
        lambda q, k, v: api.flash_attention(q, k, v, is_causal=is_causal,
                                            implementation="xla"), *upcast)
    references = (ref_out, *ref_vjp(cotangent.astype(jnp.float32)))
  max_error = _MAX_RELATIVE_ERROR[jnp.dtype(query.dtype).name]

  def attention(sizes):
    return lambda q, k, v: api.flash_attention(
        q, k, v, is_causal=is_causal, implementation=implementation,
        block_sizes=sizes, **options)

  def forward_step(sizes):
    return jax.jit(lambda q, k, v: (attention(sizes)(q, k, v),))

  def backward_step(sizes):
    def value_and_grads(q, k, v):
      out, vjp = jax.vjp(attention(sizes), q, k, v)
      return (out, *vjp(cotangent))
    return jax.jit(value_and_grads)

  def best_of(candidates, make_step, num_checked):
    results = []
    for sizes in candidates:
      try:
        step = make_step(sizes)
        error = _relative_error(step(query, key, value)[:num_checked],
                                references[:num_checked])
        if not error <= max_error:  # Also rejects NaN.
          raise ValueError(f"relative error {error:.3g} > {max_error}")
        seconds = _median_seconds(step, (query, key, value), repeats, iters)
      except Exception as e:  # pylint: disable=broad-exception-caught
        if verbose:
          print(f"jflash.autotune: rejected {sizes}: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}")
        continue
      if verbose:
        print(f"jflash.autotune: {seconds * 1e3:.3f} ms {sizes}")
      results.append((seconds, sizes))
    if not results:
      raise ValueError("jflash.autotune: every candidate was rejected for "
                       f"{key_of_shape}; rerun with verbose=True.")
    return min(results, key=lambda r: r[0])

  def fits(sizes):
    # Tiles beyond the device's shared memory are not candidates.
    try:
      space.check_fits(sizes, spec)
    except ValueError as e:
      if verbose:
        print(f"jflash.autotune: skipped {sizes}: {e}")
      return False
    return True

  forward = space.forward_tiles(space.base(spec), forward_candidates)
  forward_seconds, best = best_of([s for s in forward if fits(s)],
                                  forward_step, 1)
  backward = space.backward_tiles(best, backward_candidates)
  total_seconds, best = best_of([s for s in backward if fits(s)],
                                backward_step, 4)

  path = cache.cache_path() if path is None else path
  if path is not None:
    cache.store(path, key_of_shape, {
        "block_sizes": dataclasses.asdict(best),
        "forward_ms": forward_seconds * 1e3,
        "forward_backward_ms": total_seconds * 1e3,
        "interpret": bool(interpret),
        "jax_version": jax.__version__,
    })
  return best
