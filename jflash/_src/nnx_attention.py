"""`FlashMultiHeadAttention`: flax.nnx.MultiHeadAttention on jflash kernels."""

from __future__ import annotations

from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from jflash._src import flax_adapter
from jflash._src.api import BlockSizes


class FlashMultiHeadAttention(nnx.MultiHeadAttention):
  """`nnx.MultiHeadAttention` whose attention runs on jflash's kernels.

  The constructor takes every argument of `flax.nnx.MultiHeadAttention`
  (num_heads, in_features, qkv_features, out_features, num_kv_heads, dtype,
  param_dtype, initializers, use_bias, normalize_qk, decode, rngs, ...) and
  creates exactly the same parameters, so a state moves between the two
  unchanged; plus jflash's `implementation`, `block_sizes`, `interpret`,
  `logits_soft_cap` and `local_window_size` (see `jflash.flash_attention`).
  In decode steps the window applies to the cached positions: the new token
  at position p sees [p - left, p]. `use_sinks=True` adds a learnable
  `sinks` parameter, one attention-sink logit per head (zeros at init; see
  `jflash.flash_attention`'s `sinks`). `fp8=True` (inference only: leave
  it off for training, differentiating raises NotImplementedError)
  quantizes q, k and v to float8_e4m3fn per batch element and kv head and
  runs FP8 attention (`jflash.flash_attention`'s FP8 section), with
  `hadamard=True` rotating q and k first (`jflash.quantize_qkv`); the
  parameters and the decode cache keep their dtypes (a decode step
  quantizes the cache it reads). `deterministic_grads=False` is
  `jflash.flash_attention`'s (faster kernels whose gradients vary in their
  last bits; not `deterministic`, which turns dropout off).

  Attention dropout works as in the stock module (`dropout_rate`,
  `broadcast_dropout`, `deterministic`, the `dropout` rng stream), with
  jflash's in-kernel masks (same distribution, other bits than Flax's).

  Differences from the stock module:
  - `__call__` also takes `query_seq_lengths` / `key_value_seq_lengths`
    (integer [batch...]) for padding, the kernels' native form of a padding
    mask, and `q_segment_ids` / `kv_segment_ids` for packed sequences. A
    dense `mask` works as in the stock module (not in decode steps);
    `sow_weights=True` and `input_positions` raise NotImplementedError.
  - The decode cache keeps one position per batch element: `cache_index` has
    shape [batch...] (the stock module keeps one scalar). Each decode step
    writes the new key/value of element b at `cache_index[b]` and attends to
    its first `cache_index[b] + 1` cached positions. Steps past the cache's
    max_length overwrite its last slot (as the stock module does).
  - Rows with no visible key output 0 (see `jflash.flash_attention`).
  """

  def __init__(
      self,
      num_heads: int,
      in_features: int,
      qkv_features: int | None = None,
      out_features: int | None = None,
      num_kv_heads: int | None = None,
      in_kv_features: int | None = None,
      *,
      implementation: str | None = None,
      block_sizes: BlockSizes | None = None,
      interpret: bool = False,
      logits_soft_cap: float | None = None,
      local_window_size: int | tuple[int, int] | None = None,
      use_sinks: bool = False,
      fp8: bool = False,
      hadamard: bool = False,
      deterministic_grads: bool = True,
      **kwargs: Any,
  ):
    if "attention_fn" in kwargs:
      raise ValueError(
          "FlashMultiHeadAttention always uses jflash attention; to plug "
          "jflash into a stock module use "
          "nnx.MultiHeadAttention(..., attention_fn=jflash.nnx.attention_fn())"
          ".")
    super().__init__(
        num_heads, in_features, qkv_features, out_features, num_kv_heads,
        in_kv_features,
        attention_fn=flax_adapter.make_attention_fn(
            implementation=implementation, block_sizes=block_sizes,
            interpret=interpret, logits_soft_cap=logits_soft_cap,
            local_window_size=local_window_size, fp8=fp8,
            hadamard=hadamard, deterministic_grads=deterministic_grads),
        **kwargs)
    self.implementation = implementation
    self.block_sizes = block_sizes
    self.interpret = interpret
    self.logits_soft_cap = logits_soft_cap
    self.local_window_size = local_window_size
    self.fp8 = fp8
    self.hadamard = hadamard
    self.deterministic_grads = deterministic_grads
    self.sinks = (nnx.Param(jnp.zeros((num_heads,), self.param_dtype))
                  if use_sinks else None)

  def __call__(
      self,
      inputs_q: jax.Array,
      inputs_k: jax.Array | None = None,
      inputs_v: jax.Array | None = None,
      *,
      mask: jax.Array | None = None,
      deterministic: bool | None = None,
      rngs: Any = None,
      sow_weights: bool = False,
      decode: bool | None = None,
      is_causal: bool = False,
      out_sharding: Any = None,
      qkv_sharding: Any = None,
      input_positions: jax.Array | None = None,
      query_seq_lengths: jax.Array | None = None,
      key_value_seq_lengths: jax.Array | None = None,
      q_segment_ids: jax.Array | None = None,
      kv_segment_ids: jax.Array | None = None,
  ) -> jax.Array:
    """Applies multi-head attention; arguments as nnx.MultiHeadAttention.

    Args:
      inputs_q: [batch..., q_len, in_features].
      inputs_k: [batch..., kv_len, in_kv_features]; default inputs_q.
      inputs_v: [batch..., kv_len, in_kv_features]; default inputs_k.
      mask: optional bool [batch..., num_heads, q_len, kv_len]
        (broadcastable; True = attend), ANDed with every other mask; not in
        decode steps. It skips no work: prefer is_causal and the
        lengths.
      deterministic: disables dropout; required (here or in the constructor)
        when dropout_rate > 0.
      rngs: the dropout rngs (an `nnx.Rngs` or its `dropout` stream);
        default: the ones given to the constructor. Used only for active
        dropout.
      sow_weights: must be False.
      decode: one autoregressive step through the cache (see class doc);
        defaults to the constructor's `decode`.
      is_causal: top-left causal mask (ignored in decode steps, whose mask is
        the cache occupancy).
      out_sharding: passed to the output projection.
      qkv_sharding: passed to the q/k/v projections.
      input_positions: not supported (NotImplementedError).
      query_seq_lengths: integer [batch...]: rows past it output 0.
      key_value_seq_lengths: integer [batch...]: keys past it are masked.
      q_segment_ids: integer [batch..., q_len], packed sequences: query t
        sees key s only if q_segment_ids[..., t] == kv_segment_ids[..., s]
        (see `jflash.flash_attention`). Not in decode steps.
      kv_segment_ids: integer [batch..., kv_len]; with q_segment_ids.

    Returns:
      [batch..., q_len, out_features].
    """
    if sow_weights:
      raise NotImplementedError(
          "FlashMultiHeadAttention cannot sow attention weights: flash "
          "attention never forms the attention matrix.")
    if input_positions is not None:
      raise NotImplementedError(
          "FlashMultiHeadAttention does not take input_positions (RoPE); "
          "apply rotary embeddings to the inputs before the call.")
    inputs_k, inputs_v = flax_adapter.key_value_inputs(inputs_q, inputs_k,
                                                       inputs_v)
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(f"Incompatible input dimension: got inputs_q.shape="
                       f"{inputs_q.shape}, but in_features="
                       f"{self.in_features}.")

    query = self.query(inputs_q, out_sharding=qkv_sharding)
    key = self.key(inputs_k, out_sharding=qkv_sharding)
    value = self.value(inputs_v, out_sharding=qkv_sharding)
    if self.normalize_qk:
      query = self.query_ln(query)
      key = self.key_ln(key)

    decode = self.decode if decode is None else decode
    if decode is None:
      raise ValueError("No `decode` argument was given to "
                       "FlashMultiHeadAttention, neither in the call nor in "
                       "the constructor.")
    if decode:
      masking = flax_adapter.decode_step_masking(
          self.local_window_size, mask=mask,
          key_value_seq_lengths=key_value_seq_lengths,
          q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
      key, value, key_value_seq_lengths = self._append_to_cache(key, value)
    else:
      masking = dict(is_causal=is_causal)

    deterministic = self._resolve_deterministic(deterministic)
    x = flax_adapter.module_attention(
        self, query, key, value, mask=mask, masking=masking,
        deterministic=deterministic,
        dropout_rng=None if deterministic else self._dropout_rng(rngs),
        sinks=None if self.sinks is None else self.sinks[...],
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    return self.out(x, out_sharding=out_sharding)

  def _resolve_deterministic(self, deterministic: bool | None) -> bool:
    if self.dropout_rate == 0.0:
      return True
    deterministic = (self.deterministic if deterministic is None
                     else deterministic)
    if deterministic is None:
      raise ValueError("No `deterministic` argument was given to "
                       "FlashMultiHeadAttention (needed with dropout_rate > "
                       "0), neither in the call nor in the constructor.")
    return deterministic

  def _dropout_rng(self, rngs):
    """One key from the call's or the constructor's dropout stream."""
    rngs = self.rngs if rngs is None else rngs
    if isinstance(rngs, nnx.Rngs):
      rngs = rngs.dropout
    if rngs is None:
      raise ValueError("FlashMultiHeadAttention needs `rngs` for dropout "
                       "(dropout_rate > 0, deterministic=False): pass them "
                       "to the call, or keep_rngs=True in the constructor.")
    return rngs()

  def _append_to_cache(self, key, value):
    """Writes one step's key/value; returns the caches and their lengths."""
    if self.cached_key is None or self.cache_index is None:
      raise ValueError("Autoregressive cache not initialized: call "
                       "`init_cache` first.")
    cached_key, cached_value, lengths = flax_adapter.append_to_cache(
        self.cached_key[...], self.cached_value[...], self.cache_index[...],
        key, value)
    self.cached_key[...] = cached_key
    self.cached_value[...] = cached_value
    self.cache_index[...] = lengths
    return cached_key, cached_value, lengths

  def init_cache(self, input_shape, dtype: Any = jnp.float32):
    """Creates an empty decode cache.

    Args:
      input_shape: [batch..., max_length, in_features], the shape of the
        longest input the cache will hold.
      dtype: dtype of the cached keys and values.
    """
    *batch_dims, max_length, _ = input_shape
    cache_shape = (*batch_dims, max_length, self.num_kv_heads, self.head_dim)
    self.cached_key = nnx.Cache(jnp.zeros(cache_shape, dtype))
    self.cached_value = nnx.Cache(jnp.zeros(cache_shape, dtype))
    self.cache_index = nnx.Cache(jnp.zeros(tuple(batch_dims), jnp.int32))

  def set_view(self, deterministic=None, decode=None, batch_size=None,
               max_length=None):
    """Used by `nnx.view`; creates a per-element cache when decode is set."""
    if deterministic is not None:
      self.deterministic = deterministic
    if decode is not None:
      self.decode = decode
      if decode and self.cached_key is None:
        if batch_size is None or max_length is None:
          raise TypeError("'batch_size' and 'max_length' must be provided "
                          "when initializing the cache.")
        if isinstance(batch_size, int):
          batch_size = (batch_size,)
        self.init_cache((*batch_size, max_length, self.in_features),
                        self.dtype or jnp.float32)
