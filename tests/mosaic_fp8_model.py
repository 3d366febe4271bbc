"""An exact model, in XLA, of the Mosaic FP8 forward kernel's arithmetic.

The kernel (jflash/_src/backends/mosaic/forward.py, FP8) cannot run off a
Hopper GPU. This model does what it does, tile by tile along the keys: the
scores of the e4m3 inputs in float32, the logits in base 2 with the q and k
descales folded into the scale, the online softmax with its running max, P
shifted by FP8_P_SHIFT and rounded to e4m3 before P V, the row sum from the
unrounded P, and the v descale applied with the final 1 / row sum.

What it is for: on the CPU, the model is checked against float32 attention
on the dequantized inputs (tests/mosaic_fp8_test.py), which bounds the
error that rounding P costs; on the GPU, the kernel is checked against the
model with a tolerance far tighter than against the reference
(benchmarks/check_fp8_gpu.py), so a kernel bug cannot hide in the rounding
error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jflash._src import numerics
from jflash._src.backends import xla
from jflash._src.backends.mosaic import forward


def fp8_forward_model(q8, k8, v8, descales, *, scale: float, block_kv: int,
                      is_causal: bool = False, bottom_right: bool = False,
                      window=None, q_lengths=None, kv_lengths=None,
                      segment_ids=None, soft_cap=None, sinks=None,
                      out_dtype=jnp.bfloat16):
  """(out [B, T, N, H] in out_dtype, lse2 float32 [B, N, T]) as the kernel
  computes them from e4m3 q8 [B, T, N, H], k8 and v8 [B, S, K, H] and
  `descales` (q, k, v), each float32 [B, K]."""
  batch, q_seq, num_heads, head_dim = q8.shape
  kv_seq, num_kv_heads = k8.shape[1:3]
  group = num_heads // num_kv_heads
  q_descale, k_descale, v_descale = (
      jnp.broadcast_to(jnp.asarray(d, jnp.float32), (batch, num_kv_heads))
      for d in descales)
  full = lambda n: jnp.full((batch,), n, jnp.int32)
  q_lengths = full(q_seq) if q_lengths is None else q_lengths
  kv_lengths = full(kv_seq) if kv_lengths is None else kv_lengths
  # Raw scores of the fp8 values (exact products, float32 sums) and where
  # they are visible, [B, K, G, T, S].
  scores, visible = xla._masked_logits(  # pylint: disable=protected-access
      q8.astype(jnp.float32), k8.astype(jnp.float32), q_lengths, kv_lengths,
      scale=1.0, is_causal=is_causal, bottom_right=bottom_right,
      logits_soft_cap=None, window=window, segment_ids=segment_ids,
      bias=None, mask=None, alibi_slopes=None)
  # [B, K] -> [B, K, 1, 1, 1], beside the logits [B, K, G, T, S].
  logit_scale = (q_descale * k_descale * scale)[:, :, None, None, None]
  logits, _ = numerics.logits_base2(scores, scale=logit_scale,
                                    soft_cap=soft_cap)
  logits = jnp.where(visible, logits, numerics.MASK_VALUE)
  shift = forward.FP8_P_SHIFT
  values = v8.astype(jnp.float32)

  start_max, start_sum = numerics.MASK_VALUE, 0.0
  row_max = jnp.full((batch, num_kv_heads, group, q_seq), start_max)
  row_sum = jnp.full_like(row_max, start_sum)
  if sinks is not None:
    row_max = sinks.reshape(batch, num_kv_heads, group, 1) * numerics.LOG2_E
    row_max = jnp.broadcast_to(row_max, (batch, num_kv_heads, group, q_seq))
    row_sum = jnp.full_like(row_max, 2.0**shift)
  acc = jnp.zeros((batch, num_kv_heads, group, q_seq, head_dim))
  for start in range(0, kv_seq, block_kv):
    tile = slice(start, min(start + block_kv, kv_seq))
    tile_logits = logits[..., tile]
    new_max = jnp.maximum(row_max, tile_logits.max(axis=-1))
    probs = jnp.exp2(tile_logits - (new_max - shift)[..., None])
    probs = jnp.where(visible[..., tile], probs, 0.0)
    correction = jnp.exp2(row_max - new_max)
    row_sum = row_sum * correction + probs.sum(axis=-1)
    rounded = probs.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    acc = acc * correction[..., None] + jnp.einsum(
        "bkgts,bskd->bkgtd", rounded, values[:, tile],
        precision=jax.lax.Precision.HIGHEST)
    row_max = new_max
  rows = jnp.arange(q_seq)[None, None, None, :]
  has_keys = jnp.logical_and(row_sum > 0.0,
                             rows < q_lengths[:, None, None, None])
  safe_sum = jnp.where(has_keys, row_sum, 1.0)
  inverse = jnp.where(has_keys, v_descale[:, :, None, None] / safe_sum, 0.0)
  out = acc * inverse[..., None]
  lse2 = jnp.where(has_keys, row_max + jnp.log2(safe_sum) - shift, jnp.inf)
  out = jnp.moveaxis(out, 3, 1).reshape(batch, q_seq, num_heads, head_dim)
  return out.astype(out_dtype), lse2.reshape(batch, num_heads, q_seq)

