"""`FlashMultiHeadDotProductAttention`: linen's module on jflash kernels."""

from __future__ import annotations

import functools

from flax import linen as nn
from flax.linen.module import merge_param
import jax
import jax.numpy as jnp

from jflash._src import flax_adapter
from jflash._src.api import BlockSizes


class FlashMultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
  """`nn.MultiHeadDotProductAttention` whose attention runs on jflash.

  Same fields and the same parameter tree (`query`, `key`, `value`, `out`,
  and `query_ln` / `key_ln` with `normalize_qk`) as the stock module, so
  variables move between the two unchanged; plus jflash's `implementation`,
  `block_sizes`, `interpret`, `logits_soft_cap` and `local_window_size`, and
  `use_sinks` (a learnable `sinks` parameter, one attention-sink logit per
  head, zeros at init; see `jflash.flash_attention`). Attention dropout
  works as in the stock module (`dropout_rate`, `broadcast_dropout`,
  `deterministic`, the `dropout` rng or `dropout_rng`), with jflash's
  in-kernel masks (same distribution, other bits than Flax's). `fp8=True`
  (inference only: leave it off for training, differentiating raises
  NotImplementedError) quantizes q, k and v to float8_e4m3fn per batch
  element and kv head and runs FP8 attention (`jflash.flash_attention`'s
  FP8 section), with `hadamard=True` rotating q and k first
  (`jflash.quantize_qkv`); parameters and the cache keep their dtypes.
  `deterministic_grads=False` is `jflash.flash_attention`'s (faster kernels
  whose gradients vary in their last bits; not `deterministic`, which turns
  dropout off).

  Differences from the stock module:
  - `__call__` also takes `is_causal`, `query_seq_lengths` /
    `key_value_seq_lengths` (integer [batch...]) and `q_segment_ids` /
    `kv_segment_ids` (packed sequences); a dense `mask` works as in the
    stock module (not in decode steps); `sow_weights=True` raises
    NotImplementedError.
  - With `decode=True` the cache keeps one position per batch element
    (`cache_index` has shape [batch...]); each step of element b writes at
    `cache_index[b]` and attends to its first `cache_index[b] + 1` positions.
    As in the stock module, `init` with a full-length input creates the cache.
  - `attention_fn` is not used (it must stay the default).
  """

  implementation: str | None = None
  block_sizes: BlockSizes | None = None
  interpret: bool = False
  logits_soft_cap: float | None = None
  local_window_size: int | tuple[int, int] | None = None
  use_sinks: bool = False
  fp8: bool = False
  hadamard: bool = False
  deterministic_grads: bool = True

  @nn.compact
  def __call__(
      self,
      inputs_q: jax.Array,
      inputs_k: jax.Array | None = None,
      inputs_v: jax.Array | None = None,
      *,
      inputs_kv: jax.Array | None = None,
      mask: jax.Array | None = None,
      deterministic: bool | None = None,
      dropout_rng: jax.Array | None = None,
      sow_weights: bool = False,
      is_causal: bool = False,
      query_seq_lengths: jax.Array | None = None,
      key_value_seq_lengths: jax.Array | None = None,
      q_segment_ids: jax.Array | None = None,
      kv_segment_ids: jax.Array | None = None,
  ) -> jax.Array:
    """Applies multi-head attention; arguments as the stock module's.

    Args:
      inputs_q: [batch..., q_len, features].
      inputs_k: [batch..., kv_len, features]; default inputs_q.
      inputs_v: [batch..., kv_len, features]; default inputs_k.
      inputs_kv: deprecated in Flax; sets both inputs_k and inputs_v.
      mask: optional bool [batch..., num_heads, q_len, kv_len]
        (broadcastable; True = attend), ANDed with every other mask; not in
        decode steps. Read tile by tile, it skips no work: prefer is_causal,
        the lengths and the segment ids where they express the mask.
      deterministic: disables dropout; required when dropout_rate > 0.
      dropout_rng: the dropout key; default: `self.make_rng('dropout')`.
      sow_weights: must be False.
      is_causal: top-left causal mask (ignored in decode steps).
      query_seq_lengths: integer [batch...]: rows past it output 0.
      key_value_seq_lengths: integer [batch...]: keys past it are masked.
      q_segment_ids: integer [batch..., q_len], packed sequences: query t
        sees key s only if q_segment_ids[..., t] == kv_segment_ids[..., s]
        (see `jflash.flash_attention`). Not in decode steps.
      kv_segment_ids: integer [batch..., kv_len]; with q_segment_ids.

    Returns:
      [batch..., q_len, out_features or features].
    """
    if self.attention_fn is not nn.dot_product_attention:
      raise ValueError(
          "FlashMultiHeadDotProductAttention always uses jflash attention; "
          "leave attention_fn at its default (to plug jflash into the stock "
          "module, pass attention_fn=jflash.linen.attention_fn()).")
    if sow_weights:
      raise NotImplementedError(
          "FlashMultiHeadDotProductAttention cannot sow attention weights: "
          "flash attention never forms the attention matrix.")
    inputs_k, inputs_v = flax_adapter.key_value_inputs(
        inputs_q, inputs_k, inputs_v, inputs_kv=inputs_kv)

    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    if qkv_features % self.num_heads:
      raise ValueError(f"qkv_features ({qkv_features}) must be divisible by "
                       f"num_heads ({self.num_heads}).")
    head_dim = qkv_features // self.num_heads
    dense = functools.partial(
        nn.DenseGeneral, axis=-1, dtype=self.dtype,
        param_dtype=self.param_dtype, features=(self.num_heads, head_dim),
        kernel_init=self.kernel_init, bias_init=self.bias_init,
        use_bias=self.use_bias, precision=self.precision,
        dot_general=self.qkv_dot_general,
        dot_general_cls=self.qkv_dot_general_cls)
    query = dense(name="query")(inputs_q)
    key = dense(name="key")(inputs_k)
    value = dense(name="value")(inputs_v)
    if self.normalize_qk:
      layer_norm = functools.partial(nn.LayerNorm, use_bias=False,
                                     dtype=self.dtype,
                                     param_dtype=self.param_dtype)
      query = layer_norm(name="query_ln")(query)
      key = layer_norm(name="key_ln")(key)

    masking = dict(is_causal=is_causal)
    if self.decode:
      initialized = self.has_variable("cache", "cached_key")
      cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape,
                                 key.dtype)
      cached_value = self.variable("cache", "cached_value", jnp.zeros,
                                   value.shape, value.dtype)
      cache_index = self.variable(
          "cache", "cache_index",
          lambda: jnp.zeros(key.shape[:-3], jnp.int32))
      if initialized:
        masking = flax_adapter.decode_step_masking(
            self.local_window_size, mask=mask,
            key_value_seq_lengths=key_value_seq_lengths,
            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
        key, value, key_value_seq_lengths = flax_adapter.append_to_cache(
            cached_key.value, cached_value.value, cache_index.value, key,
            value)
        cached_key.value, cached_value.value = key, value
        cache_index.value = key_value_seq_lengths

    if self.dropout_rate > 0.0:
      deterministic = merge_param("deterministic", self.deterministic,
                                  deterministic)
      if not deterministic and dropout_rng is None:
        dropout_rng = self.make_rng("dropout")
    else:
      deterministic = True
    sinks = None
    if self.use_sinks:
      sinks = self.param("sinks", nn.initializers.zeros_init(),
                         (self.num_heads,), self.param_dtype)
    x = flax_adapter.module_attention(
        self, query, key, value, mask=mask, masking=masking,
        deterministic=deterministic, dropout_rng=dropout_rng, sinks=sinks,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    return nn.DenseGeneral(
        features=features, axis=(-2, -1),
        kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.out_bias_init or self.bias_init,
        use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, precision=self.precision,
        dot_general=self.out_dot_general,
        dot_general_cls=self.out_dot_general_cls, name="out")(x)
