"""GPU check of the Mosaic GPU backward kernels against float32 references.

Run on an H100/H200:
  PYTHONPATH=. python3 benchmarks/check_mosaic_backward.py [filter]
For each case: lse2/out from the Mosaic forward, delta = rowsum(dO * O),
(dq, dk, dv) from backward.backward_call, compared with jax.vjp of a float32
reference (jax.nn.dot_product_attention where it applies, else a hand-built
one), relative error ||x - ref|| / ||ref|| per gradient, PASS/FAIL per case.
Also checks determinism (two runs bitwise equal) and NaNs.
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jflash._src.backends.mosaic import backward
from jflash._src.backends.mosaic import forward
from jflash._src.backends.mosaic.config import default_block_sizes
from jflash._src.spec import CallSpec, MaskSpec


def visible_ref(T, S, q_len, kv_len, causal, br, window):
  """[B, 1, T, S] visibility, written independently of masks.py."""
  r = jnp.arange(T)[None, :, None]
  c = jnp.arange(S)[None, None, :]
  ql = q_len[:, None, None]
  kl = kv_len[:, None, None]
  off = (kl - ql) if (causal and br) else 0
  ok = (c < kl) & (r < ql)
  if causal:
    ok &= c <= r + off
  if window is not None:
    left, right = window
    ok &= (c >= r + off - left) & (c <= r + off + right)
  return ok[:, None]


def hand_reference(q, k, v, q_len, kv_len, *, scale, causal, br, window, cap):
  """float32 attention; rows without a visible key give 0."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  g = N // K
  k = jnp.repeat(k, g, axis=2)
  v = jnp.repeat(v, g, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
  if cap is not None:
    s = cap * jnp.tanh(s / cap)
  vis = visible_ref(T, S, q_len, kv_len, causal, br, window)
  s = jnp.where(vis, s, -1e30)
  m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  e = jnp.where(vis, jnp.exp(s - m), 0.0)
  den = jnp.sum(e, axis=-1, keepdims=True)
  p = e / jnp.where(den > 0, den, 1.0)
  return jnp.einsum("bnts,bsnh->btnh", p, v)


def nn_reference(q, k, v, q_len, kv_len, *, scale, causal, window, lengths):
  kw = dict(scale=scale, is_causal=causal, implementation="xla")
  if lengths:
    kw.update(query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
  if window is not None:
    kw.update(local_window_size=window)
  return jax.nn.dot_product_attention(q, k, v, **kw)


CASES = [
    # name, kwargs
    ("bf16_h64_plain", dict(H=64)),
    ("f16_h128_plain", dict(H=128, dtype=jnp.float16)),
    ("bf16_h256_plain", dict(H=256)),
    ("f16_h256_causal", dict(H=256, dtype=jnp.float16, causal=True)),
    ("bf16_h128_causal_512", dict(H=128, T=512, S=512, causal=True)),
    ("f16_h64_causal_T256_S512", dict(H=64, dtype=jnp.float16, T=256, S=512,
                                      causal=True)),
    ("bf16_h128_causal_br_T256_S512", dict(H=128, T=256, S=512, causal=True,
                                           br=True)),
    ("f16_h64_causal_br_T512_S256", dict(H=64, dtype=jnp.float16, T=512,
                                         S=256, causal=True, br=True)),
    ("bf16_h128_lengths", dict(H=128, lengths=([200, 256], [256, 136]))),
    ("f16_h128_lengths_causal", dict(H=128, dtype=jnp.float16,
                                     lengths=([256, 130], [180, 256]),
                                     causal=True)),
    ("bf16_h128_lengths_causal_br", dict(H=128, T=384, S=512, causal=True,
                                         br=True,
                                         lengths=([384, 100], [512, 300]))),
    ("f16_h128_window32_causal", dict(H=128, dtype=jnp.float16, T=512,
                                      S=512, causal=True, window=(32, 0))),
    ("bf16_h64_window64_16", dict(H=64, T=512, S=512, window=(64, 16))),
    ("bf16_h128_window_br_lengths", dict(H=128, T=256, S=512, causal=True,
                                         br=True, window=(48, 0),
                                         lengths=([256, 200], [512, 260]))),
    ("f16_h128_softcap", dict(H=128, dtype=jnp.float16, cap=3.0)),
    ("bf16_h256_softcap_causal", dict(H=256, cap=3.0, causal=True)),
    ("bf16_h64_odd_T200_S136", dict(H=64, T=200, S=136, N=2, K=1)),
    ("f16_h64_odd_causal_br_T136_S200", dict(H=64, dtype=jnp.float16, T=136,
                                             S=200, N=2, K=1, causal=True,
                                             br=True)),
    ("bf16_h128_gqa4_causal_lengths", dict(H=128, N=8, K=2, causal=True,
                                           lengths=([256, 77], [256, 201]))),
    ("f16_h256_window_lengths", dict(H=256, dtype=jnp.float16, T=512, S=512,
                                     window=(100, 20),
                                     lengths=([512, 300], [400, 512]))),
    ("bf16_h64_ragged_T100_S300_br", dict(H=64, T=100, S=300, N=2, K=1,
                                          causal=True, br=True)),
    ("f16_h256_ragged_T100_S36_lengths", dict(H=256, dtype=jnp.float16,
                                              T=100, S=36,
                                              lengths=([100, 37], [36, 20]))),
    ("f16_h128_mha", dict(H=128, N=4, K=4, dtype=jnp.float16, T=1024,
                          S=1024)),
]


def run_case(name, *, H, dtype=jnp.bfloat16, B=2, T=256, S=256, N=4, K=2,
             causal=False, br=False, window=None, cap=None, lengths=None):
  scale = H ** -0.5
  has_lengths = lengths is not None
  mask = MaskSpec(is_causal=causal, has_lengths=has_lengths,
                  bottom_right=bool(causal and br), window=window)
  spec = CallSpec(batch=B, q_len=T, kv_len=S, num_heads=N, num_kv_heads=K,
                  head_dim=H, dtype=jnp.dtype(dtype).name, scale=scale,
                  mask=mask, logits_soft_cap=cap)
  keys = jax.random.split(jax.random.key(hash(name) % 2**31), 4)
  q = jax.random.normal(keys[0], (B, T, N, H), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (B, S, K, H), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (B, S, K, H), jnp.float32).astype(dtype)
  do = jax.random.normal(keys[3], (B, T, N, H), jnp.float32).astype(dtype)
  if has_lengths:
    ql = jnp.asarray(lengths[0], jnp.int32)
    kl = jnp.asarray(lengths[1], jnp.int32)
  else:
    ql = kl = None
  fwd_bs = default_block_sizes(H)
  bwd_bs = default_block_sizes(H)

  @jax.jit
  def kernel_grads(q, k, v, do, ql, kl):
    out, lse2 = forward.forward_call(q, k, v, ql, kl, spec=spec,
                                     block_sizes=fwd_bs)
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), -1)
    delta = jnp.swapaxes(delta, 1, 2)  # [B, T, N] -> [B, N, T]
    return backward.backward_call(q, k, v, out, do, lse2, delta, ql, kl,
                                  spec=spec, block_sizes=bwd_bs)

  t0 = time.time()
  grads = jax.block_until_ready(kernel_grads(q, k, v, do, ql, kl))
  compile_s = time.time() - t0
  t0 = time.time()
  grads2 = jax.block_until_ready(kernel_grads(q, k, v, do, ql, kl))
  run_ms = (time.time() - t0) * 1e3
  deterministic = all(bool(jnp.array_equal(a, b))
                      for a, b in zip(grads, grads2))

  f32 = lambda x: x.astype(jnp.float32)
  ql_ref = ql if has_lengths else jnp.full((B,), T, jnp.int32)
  kl_ref = kl if has_lengths else jnp.full((B,), S, jnp.int32)
  # jax.nn gives a row without visible keys uniform weights (its mask value
  # is finite), the kernels 0: the hand reference then.
  vis = visible_ref(T, S, ql_ref, kl_ref, causal, br, window)[:, 0]
  rows_ok = jnp.arange(T)[None, :] < ql_ref[:, None]
  empty_rows = bool(jnp.any(rows_ok & ~jnp.any(vis, axis=-1)))
  use_nn = not br and cap is None and not empty_rows
  with jax.default_matmul_precision("highest"):
    if use_nn:
      ref_fn = lambda q, k, v: nn_reference(
          q, k, v, ql_ref, kl_ref, scale=scale, causal=causal, window=window,
          lengths=has_lengths)
    else:
      ref_fn = lambda q, k, v: hand_reference(
          q, k, v, ql_ref, kl_ref, scale=scale, causal=causal, br=br,
          window=window, cap=cap)
    _, vjp = jax.vjp(ref_fn, f32(q), f32(k), f32(v))
    ref = vjp(f32(do))
  tol = 2e-2 if jnp.dtype(dtype) == jnp.bfloat16 else 5e-3
  errs = []
  for g, r in zip(grads, ref):
    g = np.asarray(f32(g), np.float64)
    r = np.asarray(r, np.float64)
    errs.append(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)
                if np.isfinite(g).all() else float("nan"))
  ok = all(e <= tol for e in errs) and deterministic  # NaN fails.
  print(f"{'PASS' if ok else 'FAIL'} {name:34s} dq={errs[0]:.2e} "
        f"dk={errs[1]:.2e} dv={errs[2]:.2e} tol={tol:.0e} "
        f"ref={'nn' if use_nn else 'hand'} det={deterministic} "
        f"compile+run={compile_s:.1f}s run={run_ms:.1f}ms", flush=True)
  return ok


def check_hand_reference():
  """The hand reference agrees with jax.nn where both apply."""
  B, T, S, N, K, H = 2, 128, 192, 4, 2, 64
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (B, T, N, H))
  k = jax.random.normal(ks[1], (B, S, K, H))
  v = jax.random.normal(ks[2], (B, S, K, H))
  do = jax.random.normal(ks[3], (B, T, N, H))
  ql = jnp.array([128, 70], jnp.int32)
  kl = jnp.array([150, 192], jnp.int32)
  with jax.default_matmul_precision("highest"):
    a = jax.vjp(lambda *x: hand_reference(
        *x, ql, kl, scale=0.1, causal=True, br=False, window=(20, 0),
        cap=None), q, k, v)[1](do)
    b = jax.vjp(lambda *x: nn_reference(
        *x, ql, kl, scale=0.1, causal=True, window=(20, 0), lengths=True),
                q, k, v)[1](do)
  err = max(float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))
            for x, y in zip(a, b))
  print(f"hand reference vs jax.nn: max rel err {err:.1e}",
        "(ok)" if err < 1e-4 else "(MISMATCH: hand reference is suspect)")


if __name__ == "__main__":
  print(jax.devices())
  check_hand_reference()
  pattern = sys.argv[1] if len(sys.argv) > 1 else ""
  results = []
  for name, kwargs in CASES:
    if pattern in name:
      try:
        results.append(run_case(name, **kwargs))
      except Exception as e:  # pylint: disable=broad-except
        print(f"FAIL {name}: {type(e).__name__}: {str(e)[:2000]}",
              flush=True)
        results.append(False)
  print(f"{sum(results)}/{len(results)} passed")
