"""FP8 attention for inference: quantizing q/k/v, the Hadamard rotation, and
the dequantizing path.

The contract (`jflash.flash_attention`): q, k and v of one FP8 dtype
(float8_e4m3fn, or float8_e5m2), each with a float32 descale per (batch
element, kv head): the real value of an element is its FP8 value times its
descale, and the query's descale is shared by the query heads of a kv
head's group (FlashAttention-3's convention). This module holds

- the helpers that produce such inputs (`quantize_fp8`, `quantize_qkv`),
  read them back (`dequantize_fp8`) and rotate q and k before quantizing
  (`hadamard`, FlashAttention-3's incoherent processing);
- `dequantize_operands`: what a backend without FP8 kernels runs, on the
  plan's word (`registry.plan`, `Plan.dequantize`): q, k and v dequantized
  to `spec.DEQUANTIZED_DTYPE`, then its usual kernels.

Scales are per (batch, kv head) only: per-block (per tile of rows) scales,
which FlashAttention-3 also describes, are not part of the contract.

Pure JAX: no Pallas, no kernels. The public helpers are jitted (one
program per shape and static option, also when called outside `jit`: the
Hadamard butterfly alone is dozens of small ops).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jflash._src import paged
from jflash._src.spec import FP8_DTYPES
from jflash._src.spec import Operands


def _fp8_dtype(dtype) -> jnp.dtype:
  dtype = jnp.dtype(dtype)
  if dtype.name not in FP8_DTYPES:
    raise ValueError(f"dtype must be one of {FP8_DTYPES}; got {dtype}.")
  return dtype


def _grouped(x, num_groups: int, name: str):
  """[B, S, H, D] -> [B, S, G, H // G, D] (heads split into G contiguous
  groups: group g holds heads g * H/G .. (g + 1) * H/G - 1)."""
  batch, seq, heads, dim = x.shape
  if num_groups < 1 or heads % num_groups:
    raise ValueError(f"num_groups={num_groups} must divide the heads axis "
                     f"(axis 2) of {name}.shape={x.shape}.")
  return x.reshape(batch, seq, num_groups, heads // num_groups, dim)


def _batched(x, name: str):
  """(x as [B, S, H, D], whether it was unbatched [S, H, D])."""
  if x.ndim not in (3, 4):
    raise ValueError(f"{name} must be [batch, seq_len, num_heads, head_dim] "
                     f"or [seq_len, num_heads, head_dim]; got {name}.shape="
                     f"{x.shape}.")
  return (x[None], True) if x.ndim == 3 else (x, False)


def _quantize(x, num_groups: int, dtype, name: str):
  """(x8, descale [B, G]) of a batched float32 x."""
  finfo_max = float(jnp.finfo(dtype).max)
  grouped = _grouped(x, num_groups, name)
  amax = jnp.max(jnp.abs(grouped), axis=(1, 3, 4))  # [B, G].
  descale = amax / finfo_max
  # amax = 0 (an all-zero group, or one that underflows): any scale gives
  # zeros; 1 avoids 0 / 0.
  descale = jnp.where(descale > 0.0, descale, 1.0).astype(jnp.float32)
  scaled = grouped / descale[:, None, :, None, None]
  # Division rounding may step past the largest value, which e4m3fn casts
  # to NaN (it has no infinity): clip first.
  x8 = jnp.clip(scaled, -finfo_max, finfo_max).astype(dtype)
  return x8.reshape(x.shape), descale


@functools.partial(jax.jit, static_argnames=("num_groups", "dtype"))
def quantize_fp8(x: jax.typing.ArrayLike, *, num_groups: int | None = None,
                 dtype: jax.typing.DTypeLike = jnp.float8_e4m3fn
                 ) -> tuple[jax.Array, jax.Array]:
  """Quantizes q, k or v to FP8 with one scale per (batch, group of heads).

  Each group's descale is amax / max(dtype) (448 for e4m3), so its largest
  magnitude maps to the largest FP8 value; elements are divided by it and
  rounded to nearest (relative error <= 2^-4 for e4m3 normals). An all-zero
  group gets descale 1. Inputs must be finite. Per-block scales (one per
  tile of rows) are not provided: the attention takes one descale per
  (batch, kv head).

  For `jflash.flash_attention`, k and v take one scale per kv head (the
  default, `num_groups` = their heads) and q one per kv head's group of
  query heads: `quantize_fp8(q, num_groups=num_kv_heads)`, as
  `quantize_qkv` does.

  Args:
    x: [B, S, H, D] (or unbatched [S, H, D]), any float dtype.
    num_groups: G, the number of scales per batch element: heads are split
      into G contiguous groups (head h is in group h // (H // G)); must
      divide H. Default: H (one scale per head).
    dtype: jnp.float8_e4m3fn (default) or jnp.float8_e5m2.

  Returns:
    (x8, descale): x8 of x's shape in `dtype`, and float32 descale [B, G]
    ([G] unbatched) with x ~= dequantize_fp8(x8, descale).

  Raises:
    ValueError: for a bad rank, num_groups or dtype.
  """
  dtype = _fp8_dtype(dtype)
  x, unbatched = _batched(jnp.asarray(x), "x")
  num_groups = x.shape[2] if num_groups is None else num_groups
  x8, descale = _quantize(x.astype(jnp.float32), num_groups, dtype, "x")
  return (x8[0], descale[0]) if unbatched else (x8, descale)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_fp8(x8: jax.typing.ArrayLike, descale: jax.typing.ArrayLike,
                   *, dtype: jax.typing.DTypeLike = jnp.float32) -> jax.Array:
  """x8 times its descale, as `flash_attention` reads FP8 inputs.

  Args:
    x8: [B, S, H, D] (or [S, H, D]), FP8 (or any dtype).
    descale: broadcastable to [B, G] ([G] unbatched), G dividing H: head h
      is scaled by descale[b, h // (H // G)] (G = H: per head; G = the kv
      heads for a query: per GQA group). A scalar scales everything.
    dtype: the result's dtype (the product is formed in float32).

  Returns:
    x8.astype(float32) * descale, per head group, in `dtype`.

  Raises:
    ValueError: if the descale's shape does not fit x8's.
  """
  x8, unbatched = _batched(jnp.asarray(x8), "x8")
  descale = jnp.asarray(descale, jnp.float32)
  if unbatched:
    descale = descale[None] if descale.ndim == 1 else descale
  batch = x8.shape[0]
  num_groups = descale.shape[-1] if descale.ndim else 1
  expected = "[G]" if unbatched else "[B, G]"
  if descale.ndim > 2 or (descale.ndim == 2 and descale.shape[0] not in (
      1, batch)):
    raise ValueError(f"descale must be broadcastable to {expected} (G "
                     f"dividing the heads); got descale.shape="
                     f"{jnp.shape(descale)} for x8.shape={x8.shape}.")
  descale = jnp.broadcast_to(descale, (batch, num_groups))
  grouped = _grouped(x8.astype(jnp.float32), num_groups, "x8")
  out = (grouped * descale[:, None, :, None, None]).reshape(x8.shape)
  out = out.astype(dtype)
  return out[0] if unbatched else out


def _check_head_dim(x, name: str) -> int:
  head_dim = x.shape[-1]
  if head_dim < 1 or head_dim & (head_dim - 1):
    raise ValueError(
        f"the Hadamard rotation needs a power-of-two head_dim (the last "
        f"axis: 64, 128, 256, ...); got {name}.shape={x.shape}.")
  return head_dim


def _rotate(x, seed: int | None):
  """The orthonormal rotation of `hadamard` on the last axis, in float32.

  A fast Walsh-Hadamard transform: log2(D) butterfly stages, each a reshape
  and one add and one subtract per pair, then 1/sqrt(D). Exact additions in
  float32 (D log2 D of them, no matmul): a D x D matmul would run at the
  platform's default float32 precision, TF32 on NVIDIA GPUs (~1e-3
  relative), unless asked for more.
  """
  head_dim = x.shape[-1]
  x = x.astype(jnp.float32)
  if seed is not None:
    # A fixed +-1 diagonal (drawn on the host: a constant of the program).
    signs = np.random.default_rng(seed).choice(
        np.array([-1.0, 1.0], np.float32), size=head_dim)
    x = x * jnp.asarray(signs).reshape((1,) * (x.ndim - 1) + (head_dim,))
  lead = x.shape[:-1]
  half = 1
  while half < head_dim:
    pairs = x.reshape(*lead, head_dim // (2 * half), 2, half)
    a, b = pairs[..., 0, :], pairs[..., 1, :]
    x = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, head_dim)
    half *= 2
  return x * (1.0 / math.sqrt(head_dim))


@functools.partial(jax.jit, static_argnames=("seed",))
def hadamard(x: jax.typing.ArrayLike, *, seed: int | None = None
             ) -> jax.Array:
  """Rotates the last axis by an orthonormal (randomized) Hadamard matrix.

  x -> x M with M = diag(s) H / sqrt(D), H the D x D Sylvester Hadamard
  matrix and s a fixed +-1 vector drawn from `seed` (all ones without one).
  M is orthonormal, so rotating both q and k leaves every q.k, hence the
  attention, unchanged (up to rounding), while an outlier coordinate is
  spread over all D: FlashAttention-3's "incoherent processing", which
  lowers the FP8 quantization error of q K^T on data with outliers.
  `quantize_qkv(..., hadamard=True)` applies it to q and k (not v, whose
  rotation would have to be undone on the output).

  Computed in float32 as a fast Walsh-Hadamard transform (log2 D butterfly
  stages of adds and subtracts; no matmul, so no reduced-precision matmul
  either); the result is cast back to x's dtype.

  Args:
    x: [..., D] with D a power of two (64, 128, 256, ...).
    seed: a Python int for the random signs, or None (no signs). Use the
      same seed for q and k.

  Returns:
    The rotated array, x's shape and dtype.

  Raises:
    ValueError: if D is not a power of two.
  """
  x = jnp.asarray(x)
  _check_head_dim(x, "x")
  return _rotate(x, seed).astype(x.dtype)


@functools.partial(jax.jit,
                   static_argnames=("hadamard", "hadamard_seed", "dtype"))
def quantize_qkv(query: jax.typing.ArrayLike, key: jax.typing.ArrayLike,
                 value: jax.typing.ArrayLike, *, hadamard: bool = False,
                 hadamard_seed: int | None = None,
                 dtype: jax.typing.DTypeLike = jnp.float8_e4m3fn):
  """q, k and v quantized for `jflash.flash_attention`'s FP8 contract.

  Each array gets one float32 scale per (batch element, kv head): k and v
  per head, q per kv head's group of query heads (the amax of the group's
  query heads). Pass the result on as is::

      q8, k8, v8, q_descale, k_descale, v_descale = jflash.quantize_qkv(
          q, k, v)
      out = jflash.flash_attention(q8, k8, v8, q_descale=q_descale,
                                   k_descale=k_descale, v_descale=v_descale)

  Args:
    query: [B, T, N, H] (or unbatched [T, N, H]), any float dtype.
    key: [B, S, K, H] (or [S, K, H]); K divides N.
    value: shaped as key.
    hadamard: rotate q and k along H by the same orthonormal Hadamard
      transform first (`jflash.hadamard`; H a power of two): q K^T is
      unchanged and outliers are spread before quantizing.
    hadamard_seed: the random signs of the rotation (`jflash.hadamard`'s
      seed); only with hadamard=True.
    dtype: jnp.float8_e4m3fn (default) or jnp.float8_e5m2.

  Returns:
    (q8, k8, v8, q_descale, k_descale, v_descale): FP8 arrays of the
    inputs' shapes and float32 descales [B, K] ([K] unbatched).

  Raises:
    ValueError: for shapes that do not fit together, a head dim that is
      not a power of two with hadamard=True, or hadamard_seed without it.
  """
  dtype = _fp8_dtype(dtype)
  arrays = [jnp.asarray(x) for x in (query, key, value)]
  shapes = (f"query.shape={arrays[0].shape}, key.shape={arrays[1].shape}, "
            f"value.shape={arrays[2].shape}")
  if (len({x.ndim for x in arrays}) != 1 or arrays[0].ndim not in (3, 4)
      or arrays[1].shape != arrays[2].shape
      or arrays[0].shape[-1] != arrays[1].shape[-1]
      or arrays[0].shape[:-3] != arrays[1].shape[:-3]
      or arrays[1].shape[-2] == 0
      or arrays[0].shape[-2] % arrays[1].shape[-2]):
    raise ValueError(
        "quantize_qkv takes query [B, T, N, H], key and value [B, S, K, H] "
        f"(or all unbatched), K dividing N; got {shapes}.")
  if hadamard_seed is not None and not hadamard:
    raise ValueError("hadamard_seed applies only with hadamard=True; got "
                     f"hadamard_seed={hadamard_seed!r}.")
  unbatched = arrays[0].ndim == 3
  query, key, value = (
      (x[None] if unbatched else x).astype(jnp.float32) for x in arrays)
  if hadamard:
    _check_head_dim(query, "query")
    query, key = _rotate(query, hadamard_seed), _rotate(key, hadamard_seed)
  num_kv_heads = key.shape[2]
  results = [_quantize(x, num_kv_heads, dtype, name)
             for x, name in ((query, "query"), (key, "key"),
                             (value, "value"))]
  if unbatched:
    results = [(x8[0], descale[0]) for x8, descale in results]
  (q8, q_descale), (k8, k_descale), (v8, v_descale) = results
  return q8, k8, v8, q_descale, k_descale, v_descale


def dequantize_operands(operands: Operands, dtype) -> Operands:
  """An FP8 call's operands as a backend without FP8 kernels takes them.

  q, k and v become `dequantize_fp8(x, descale)` in `dtype` (the plan's
  `spec.DEQUANTIZED_DTYPE`); a paged cache is gathered into a dense one
  first (a page belongs to no batch element whose descale it could take);
  the descales are dropped. The call's spec is `CallSpec.dequantized()`.
  """
  operands = paged.dense_operands(operands)
  return operands.replace(
      query=dequantize_fp8(operands.query, operands.q_descale, dtype=dtype),
      key=dequantize_fp8(operands.key, operands.k_descale, dtype=dtype),
      value=dequantize_fp8(operands.value, operands.v_descale, dtype=dtype),
      q_descale=None, k_descale=None, v_descale=None)
