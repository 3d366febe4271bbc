"""The `attention_fn` that plugs jflash into Flax's attention modules.

Flax's modules call `attention_fn(query, key, value, **keywords)`. nnx always
passes `mask, dropout_rng, dropout_rate, broadcast_dropout, deterministic,
dtype, precision, module, is_causal`; linen passes only the keywords that
appear in the function's signature, so every keyword is named explicitly
here (a `**kwargs` function would silently lose linen's `mask`).

This module talks to the public `jflash.flash_attention` only; it never
imports kernels.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
from jax import lax
import jax.numpy as jnp

from jflash._src import api
from jflash._src import fp8 as fp8_helpers
from jflash._src import validation
from jflash._src.api import BlockSizes


def key_value_inputs(inputs_q, inputs_k=None, inputs_v=None, *,
                     inputs_kv=None):
  """The key and value inputs of a module call, defaulted as Flax does.

  inputs_k defaults to inputs_q and inputs_v to inputs_k; linen's
  deprecated `inputs_kv` sets both.

  Returns:
    (inputs_k, inputs_v).

  Raises:
    ValueError: for inputs_v without inputs_k, or inputs_kv with either.
  """
  if inputs_kv is not None:
    if inputs_k is not None or inputs_v is not None:
      raise ValueError("If `inputs_kv` is given, `inputs_k` and `inputs_v` "
                       "must be None.")
    return inputs_kv, inputs_kv
  if inputs_k is None:
    if inputs_v is not None:
      raise ValueError("`inputs_k` cannot be None if `inputs_v` is not "
                       "None; pass the same array to both, or only "
                       "`inputs_k`.")
    inputs_k = inputs_q
  return inputs_k, inputs_k if inputs_v is None else inputs_v


def decode_step_masking(local_window_size, *, mask, key_value_seq_lengths,
                        q_segment_ids, kv_segment_ids) -> dict[str, Any]:
  """Mask options of a one-token decode step over a cache.

  The step's key lengths (index + 1) already hide the unwritten slots. With a
  local window, the window must be centred on the new token's own position
  (the cache's last valid slot), which bottom-right causal alignment does.
  The masks a module call may carry besides are refused: the cache sets the
  step's keys.

  Raises:
    ValueError: for key_value_seq_lengths or segment ids.
    NotImplementedError: for a dense mask.
  """
  if key_value_seq_lengths is not None:
    raise ValueError("key_value_seq_lengths cannot be given in decode "
                     "steps: the cache's cache_index sets them.")
  if q_segment_ids is not None or kv_segment_ids is not None:
    raise ValueError("Segment ids cannot be given in decode steps: a step "
                     "attends to its cache's valid slots.")
  if mask is not None:
    raise NotImplementedError(
        "A dense mask cannot be given in decode steps yet: a step attends "
        "to its cache's valid slots (and the window, if any).")
  if local_window_size is None:
    return dict(is_causal=False)
  return dict(is_causal=True, causal_alignment="bottom_right")


def append_to_cache(cached_key, cached_value, index, key, value):
  """One decode step: writes each batch element's new key/value at its index.

  Args:
    cached_key: [batch..., max_length, kv_heads, head_dim].
    cached_value: same shape as cached_key.
    index: int32 [batch...], each batch element's next free position.
    key: [batch..., 1, kv_heads, head_dim], this step's keys.
    value: same shape as key.

  Returns:
    (cached_key, cached_value, lengths): the updated caches and int32
    [batch...] lengths (index + 1) that each element's query attends to.

  Raises:
    ValueError: if the step is not one token of the cache's shape.
  """
  *batch_dims, _, num_kv_heads, head_dim = cached_key.shape
  expected = (*batch_dims, 1, num_kv_heads, head_dim)
  if key.shape != expected or value.shape != expected:
    raise ValueError(f"Autoregressive cache shape error: a decode step takes "
                     f"one token, expected key and value shape {expected}, "
                     f"got {key.shape} and {value.shape}.")
  flat = lambda x: x.reshape((-1, *x.shape[len(batch_dims):]))
  write = jax.vmap(
      lambda c, x, i: lax.dynamic_update_slice(c, x.astype(c.dtype),
                                               (i, 0, 0)))
  cached_key, cached_value = (
      write(flat(c), flat(x), index.reshape(-1)).reshape(c.shape)
      for c, x in ((cached_key, key), (cached_value, value)))
  return cached_key, cached_value, index + 1


def _flatten_batch(x, num_batch_dims: int):
  """[batch..., rest] -> [prod(batch), rest] (or unbatched when none)."""
  if num_batch_dims == 1:
    return x
  rest = x.shape[num_batch_dims:]
  if num_batch_dims == 0:
    return x[None]
  return x.reshape((math.prod(x.shape[:num_batch_dims]), *rest))


def _flatten_dense(x, name: str, num_batch_dims: int, batch_shape):
  """A Flax mask or bias [batch..., heads, q, kv] (broadcastable) as jflash
  takes it: [1 or batch, heads or 1, q, kv].

  All-broadcast batch dims stay one size-1 axis (never materialized); others
  are broadcast to the full batch shape and flattened like the inputs.
  """
  x = jnp.asarray(x)
  if name == "mask" and x.dtype != jnp.bool_:
    x = x != 0  # Flax's masks are often float (make_attention_mask).
  rank = num_batch_dims + 3
  if x.ndim > rank:
    raise ValueError(f"{name} must have at most {rank} dims ([batch..., "
                     f"num_heads, q_len, kv_len]); got {name}.shape="
                     f"{x.shape}.")
  x = x.reshape((1,) * (rank - x.ndim) + x.shape)
  rest = x.shape[num_batch_dims:]
  if all(d == 1 for d in x.shape[:num_batch_dims]):
    return x.reshape((1, *rest))
  return jnp.broadcast_to(x, (*batch_shape, *rest)).reshape((-1, *rest))


def flax_attention(
    query, key, value, *, mask=None, bias=None, is_causal=False,
    dropout_rate=0.0, deterministic=True, dropout_rng=None,
    broadcast_dropout=True, module=None, dtype=None,
    query_seq_lengths=None, key_value_seq_lengths=None,
    implementation=None, block_sizes=None, interpret=False,
    logits_soft_cap=None, local_window_size=None, causal_alignment="top_left",
    q_segment_ids=None, kv_segment_ids=None, sinks=None, fp8=False,
    hadamard=False, deterministic_grads=True,
):
  """jflash attention for Flax layouts: [batch..., seq, heads, head_dim].

  Any number of leading batch dimensions (including none); the lengths, if
  given, have shape [batch...], the segment ids [batch..., q_len] and
  [batch..., kv_len]. Raises NotImplementedError for what the kernels cannot
  do (yet), never silently ignores an option that changes the result.
  Dropout is active when dropout_rate > 0 and not deterministic, as in Flax;
  broadcast_dropout=True (Flax's default) shares one mask across the batch
  dimensions and heads, as Flax's does. A dense `mask` (True = attend) and
  `bias` broadcast to [batch..., num_heads, q_len, kv_len], as in Flax; they
  are read tile by tile but skip no work, so prefer is_causal, the lengths
  and the segment ids where they express the same mask. `fp8=True`
  (inference only) quantizes q, k and v with `jflash.quantize_qkv` (with
  `hadamard`) and runs FP8 attention, the output in q's dtype (bfloat16
  for FP8 or other dtypes FP8 attention does not output).
  `deterministic_grads` is `jflash.flash_attention`'s (Flax's
  `deterministic` only turns dropout off).
  """
  if hadamard and not fp8:
    raise ValueError("hadamard=True applies only with fp8=True.")
  if module is not None:
    raise NotImplementedError(
        "jflash attention cannot sow attention weights (sow_weights=True): "
        "flash attention never forms the [q_len, kv_len] weight matrix.")
  dropout = {}
  if dropout_rate > 0.0 and not deterministic:
    if dropout_rng is None:
      raise ValueError("dropout_rng is required when dropout_rate > 0 and "
                       "deterministic=False.")
    dropout = dict(dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                   broadcast_dropout=bool(broadcast_dropout))
  if dtype is not None:
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
  else:
    common = jnp.result_type(query, key, value)
    query, key, value = (jnp.asarray(x, common) for x in (query, key, value))

  num_batch_dims = query.ndim - 3
  if num_batch_dims < 0 or key.ndim != query.ndim or value.ndim != query.ndim:
    raise ValueError(
        "query, key and value must be [batch..., seq_len, num_heads, "
        f"head_dim] with the same batch dims; got query.shape={query.shape}, "
        f"key.shape={key.shape}, value.shape={value.shape}.")
  if query.shape[:num_batch_dims] != key.shape[:num_batch_dims]:
    raise ValueError(
        f"query and key must have the same batch dims; got "
        f"query.shape={query.shape}, key.shape={key.shape}.")
  batch_shape = query.shape[:num_batch_dims]
  per_batch = {}  # Lengths and segment ids, batch dims flattened like q.
  for name, value_, shape in (
      ("query_seq_lengths", query_seq_lengths, batch_shape),
      ("key_value_seq_lengths", key_value_seq_lengths, batch_shape),
      ("q_segment_ids", q_segment_ids, query.shape[:-2]),
      ("kv_segment_ids", kv_segment_ids, key.shape[:-2])):
    if value_ is None:
      continue
    value_ = jnp.asarray(value_)
    if value_.shape != shape:
      raise ValueError(f"{name} must have shape {shape}; got "
                       f"{name}.shape={value_.shape}.")
    per_batch[name] = (value_.reshape(-1) if name.endswith("lengths")
                       else _flatten_batch(value_, num_batch_dims))

  dense = {name: _flatten_dense(x, name, num_batch_dims, batch_shape)
           for name, x in (("mask", mask), ("bias", bias)) if x is not None}
  arrays = [_flatten_batch(x, num_batch_dims) for x in (query, key, value)]
  fp8_options = {}
  if fp8:
    out_dtype = jnp.dtype(query.dtype).name
    if out_dtype not in validation.FP8_OUT_DTYPES:
      out_dtype = "bfloat16"
    *arrays, q_descale, k_descale, v_descale = fp8_helpers.quantize_qkv(
        *arrays, hadamard=hadamard)
    fp8_options = dict(q_descale=q_descale, k_descale=k_descale,
                       v_descale=v_descale, out_dtype=out_dtype)
  out = api.flash_attention(
      *arrays,
      **dense, **fp8_options,
      is_causal=is_causal, implementation=implementation,
      block_sizes=block_sizes, interpret=interpret,
      logits_soft_cap=logits_soft_cap, local_window_size=local_window_size,
      causal_alignment=causal_alignment, sinks=sinks,
      deterministic_grads=deterministic_grads, **dropout, **per_batch)
  return out.reshape(query.shape)


def module_attention(module, query, key, value, *, mask, masking,
                     deterministic, dropout_rng, sinks, query_seq_lengths,
                     key_value_seq_lengths, q_segment_ids, kv_segment_ids):
  """`flax_attention` with the options a jflash module holds.

  Args:
    module: a jflash Flax module; its `dropout_rate`, `broadcast_dropout`,
      `dtype`, `implementation`, `block_sizes`, `interpret`,
      `logits_soft_cap`, `local_window_size`, `fp8`, `hadamard` and
      `deterministic_grads` are passed on.
    query, key, value: [batch..., seq, heads, head_dim], projected.
    mask: the call's dense mask, or None.
    masking: `is_causal` (and `causal_alignment` in decode steps).
    deterministic: resolved: True when the module has no dropout.
    dropout_rng: the dropout key, or None when deterministic.
    sinks: the module's sinks parameter, or None.
    query_seq_lengths, key_value_seq_lengths, q_segment_ids,
      kv_segment_ids: as `flax_attention` takes them.

  Returns:
    [batch..., q_len, heads, head_dim].
  """
  return flax_attention(
      query, key, value, mask=mask, **masking,
      dropout_rate=module.dropout_rate, deterministic=deterministic,
      dropout_rng=dropout_rng, broadcast_dropout=module.broadcast_dropout,
      sinks=sinks, dtype=module.dtype, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      implementation=module.implementation, block_sizes=module.block_sizes,
      interpret=module.interpret, logits_soft_cap=module.logits_soft_cap,
      local_window_size=module.local_window_size, fp8=module.fp8,
      hadamard=module.hadamard,
      deterministic_grads=module.deterministic_grads)


def make_attention_fn(
    *,
    implementation: str | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    logits_soft_cap: float | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    fp8: bool = False,
    hadamard: bool = False,
    deterministic_grads: bool = True,
) -> Callable[..., jax.Array]:
  """Returns an `attention_fn` for Flax's attention modules.

  Usage::

      layer = nnx.MultiHeadAttention(
          ..., attention_fn=jflash.nnx.attention_fn())
      layer = nn.MultiHeadDotProductAttention(
          ..., attention_fn=jflash.linen.attention_fn())

  Args:
    implementation: as in `jflash.flash_attention`.
    block_sizes: as in `jflash.flash_attention`.
    interpret: as in `jflash.flash_attention`.
    logits_soft_cap: as in `jflash.flash_attention`.
    local_window_size: as in `jflash.flash_attention`.
    fp8: inference only: quantize q, k and v to float8_e4m3fn
      (`jflash.quantize_qkv`, one scale per batch element and kv head) and
      run FP8 attention (`jflash.flash_attention`'s FP8 section); the
      output keeps the inputs' dtype. Differentiating raises
      NotImplementedError: leave it off for training.
    hadamard: with fp8, rotate q and k by a Hadamard transform before
      quantizing (`jflash.hadamard`; head dim a power of two).
    deterministic_grads: as in `jflash.flash_attention` (False allows
      faster kernels whose gradients vary in their last bits between runs;
      not Flax's `deterministic`, which turns dropout off).

  Returns:
    A function with Flax's `dot_product_attention` signature. `precision` is
    accepted and ignored (the kernels use fp32 IEEE dots for float32 inputs
    and fp32 accumulation otherwise); `force_fp32_for_softmax` is always true
    in jflash. Dropout follows Flax: active when dropout_rate > 0 and not
    deterministic, from `dropout_rng`, with `broadcast_dropout` (True by
    default in Flax's modules: one mask shared by all batch elements and
    heads) respected; the masks are jflash's own hash (same distribution as
    Flax's `bernoulli`, other bits). `mask` and `bias` (broadcastable to
    [batch..., num_heads, q_len, kv_len], as in Flax) are passed to the
    kernels, which read them tile by tile. Sowing weights (`module`) and
    custom einsums raise NotImplementedError.
  """

  def attention_fn(
      query: jax.Array,
      key: jax.Array,
      value: jax.Array,
      bias: jax.Array | None = None,
      mask: jax.Array | None = None,
      broadcast_dropout: bool = True,
      dropout_rng: jax.Array | None = None,
      dropout_rate: float = 0.0,
      deterministic: bool = False,
      dtype: Any = None,
      precision: Any = None,
      module: Any = None,
      is_causal: bool = False,
      force_fp32_for_softmax: bool = False,
      qk_attn_weights_einsum: Callable[..., jax.Array] | None = None,
      attn_weights_value_einsum: Callable[..., jax.Array] | None = None,
  ) -> jax.Array:
    del precision, force_fp32_for_softmax
    if (qk_attn_weights_einsum is not None
        or attn_weights_value_einsum is not None):
      raise NotImplementedError(
          "jflash attention cannot use custom attention-weight einsums.")
    return flax_attention(
        query, key, value, mask=mask, bias=bias, is_causal=is_causal,
        dropout_rate=dropout_rate, deterministic=deterministic,
        dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout,
        module=module, dtype=dtype, implementation=implementation,
        block_sizes=block_sizes,
        interpret=interpret, logits_soft_cap=logits_soft_cap,
        local_window_size=local_window_size, fp8=fp8, hadamard=hadamard,
        deterministic_grads=deterministic_grads)

  return attention_fn
