"""One description of an attention call: its static spec and its operands.

Every backend receives a call as two objects:

- `CallSpec`: the static options, frozen and hashable (shapes, dtype, scale,
  the mask description, soft cap, modifiers, whether the lse is returned). It
  is what the registry checks a backend's capabilities against and what the
  `custom_vjp` binding carries as a non-differentiable argument.
- `Operands`: a pytree (registered dataclass) of the arrays, in which an
  absent operand is `None`.

Which optional operands are present is derived once, from the operands, by
`describe_call`; nothing else sets the presence flags. Tiles, `interpret`
and other launch choices are not part of the call: the user's spellings of
them travel beside it as `BackendOptions`, which the registry hands to the
backend they belong to, whose configuration they become.

This module imports no Pallas backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

# FP8 dtypes a call may take (q, k and v all of one): the real value of an
# element is its FP8 value times its (batch, kv head)'s descale.
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# The output dtype of an FP8 call without out_dtype (FlashAttention-3's).
FP8_OUT_DTYPE = "bfloat16"
# What a backend without FP8 kernels computes an FP8 call in, on dequantized
# inputs (registry.plan decides where): bfloat16, the 16-bit kernels' dtype
# on a GPU. An FP8 value times its float32 descale rounds to bfloat16 with a
# relative error of at most 2^-9, small next to e4m3's own 2^-4. The CPU
# (xla, the interpreted Triton kernels) computes in bfloat16 too, so the CPU
# suite checks the numerics a GPU runs.
DEQUANTIZED_DTYPE = "bfloat16"


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """Static part of the mask (the predicate is `masks.visible`).

  Attributes:
    is_causal: causal mask.
    has_lengths: whether per-batch lengths were given. Without them the
      lengths are the static array lengths, and a kernel may use them as
      compile-time constants.
    bottom_right: alignment of the causal mask, windows and ALiBi
      positions: False for top-left (query row r sits at position r: with
      is_causal it sees keys c <= r, jax.nn's convention), True for
      bottom-right (row r sits at r + kv_len - q_len: c <= r + kv_len -
      q_len, FlashAttention's and KV-cache prefill's convention; rows with
      r + kv_len - q_len < 0 see nothing). Only set when something uses
      positions (causal, a window or ALiBi).
    window: (left, right) local window, as jax.nn's local_window_size: row r
      sees keys r + offset - left <= c <= r + offset + right (offset as for
      the causal mask). None: no window.
    has_segments: whether segment ids were given (packed sequences): row r
      sees column c only if their ids are equal.
    has_dense_mask: whether a dense boolean mask was given.
    paged: whether the keys and values are a paged cache read through a
      block table (`Operands.block_table`).
  """

  is_causal: bool
  has_lengths: bool = True
  bottom_right: bool = False
  window: tuple[int, int] | None = None
  has_segments: bool = False
  has_dense_mask: bool = False
  paged: bool = False


@dataclasses.dataclass(frozen=True)
class ModifierSpec:
  """Static part of the per-head score modifiers (modifiers.py).

  Attributes:
    has_sinks: per-head attention sinks.
    has_alibi: ALiBi position bias.
    dropout_rate: attention dropout rate in [0, 1); 0: none.
  """

  has_sinks: bool = False
  has_alibi: bool = False
  dropout_rate: float = 0.0

  @property
  def has_dropout(self) -> bool:
    return self.dropout_rate > 0.0

  @property
  def uses_positions(self) -> bool:
    """Whether tiles need their column positions even where unmasked."""
    return self.has_alibi or self.has_dropout

  def for_backward(self) -> ModifierSpec:
    """The modifiers a backward pass recomputes (sinks live in the lse)."""
    return dataclasses.replace(self, has_sinks=False)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Operands:
  """The arrays of one call; absent optional operands are None.

  Shapes use B = batch, T = query length, S = key/value length, N = query
  heads, K = key/value heads, H = head dim.

  Attributes:
    query: [B, T, N, H].
    key: [B, S, K, H]; with `block_table`, pages [P, page_size, K, H]
      (S = max_pages * page_size).
    value: shaped as `key`.
    q_lengths: int32 [B], valid query rows, in [0, T].
    kv_lengths: int32 [B], valid keys, in [0, S].
    q_segment_ids: int32 [B, T], packed-sequence ids of the queries.
    kv_segment_ids: int32 [B, S], of the keys.
    bias: float [Bb, Nb, T, S], Bb in {1, B}, Nb in {1, N} (broadcast batch
      and head axes are kept at size 1).
    mask: bool, shaped like `bias`; True = attend.
    sinks: float32 [B, N], natural-log sink logits.
    alibi_slopes: float32 [B, N].
    dropout_seeds: uint32 [B, N, 2] (dropout.seeds).
    block_table: int32 [B, max_pages]: sequence b's position p lives in
      page block_table[b, p // page_size] at row p % page_size.
    q_descale: float32 [B, K], with FP8 q/k/v only (`CallSpec.is_fp8`):
      the real value of query[b, t, n, :] is its FP8 value times
      q_descale[b, n // (N // K)] (one scale per kv head's group of query
      heads, FlashAttention-3's convention).
    k_descale: float32 [B, K]: key[b, s, k, :] is scaled by k_descale[b, k]
      (paged: the pages sequence b reads through its table).
    v_descale: float32 [B, K], as k_descale for value.
  """

  query: jax.Array
  key: jax.Array
  value: jax.Array
  q_lengths: jax.Array | None = None
  kv_lengths: jax.Array | None = None
  q_segment_ids: jax.Array | None = None
  kv_segment_ids: jax.Array | None = None
  bias: jax.Array | None = None
  mask: jax.Array | None = None
  sinks: jax.Array | None = None
  alibi_slopes: jax.Array | None = None
  dropout_seeds: jax.Array | None = None
  block_table: jax.Array | None = None
  q_descale: jax.Array | None = None
  k_descale: jax.Array | None = None
  v_descale: jax.Array | None = None

  @property
  def kv_seq(self) -> int:
    """S: keys per sequence (pages per sequence x page size when paged)."""
    if self.block_table is None:
      return self.key.shape[1]
    return self.block_table.shape[1] * self.key.shape[1]

  def lengths(self) -> tuple[jax.Array, jax.Array]:
    """(q_lengths, kv_lengths), the full lengths where none were given."""
    batch, q_seq = self.query.shape[:2]
    kv_seq = self.kv_seq
    full = lambda n: jnp.full((batch,), n, jnp.int32)
    return (full(q_seq) if self.q_lengths is None else self.q_lengths,
            full(kv_seq) if self.kv_lengths is None else self.kv_lengths)

  def replace(self, **changes) -> Operands:
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class CallSpec:
  """The static description of one call.

  Shapes are the call's as the public function saw them. Under `vmap` or a
  sharding wrapper a backend sees other batch (and head) sizes: kernels read
  shapes from their arrays, the spec's shapes serve capability checks and
  tuning.

  Attributes:
    batch, q_len, kv_len, num_heads, num_kv_heads, head_dim: B, T, S, N, K, H.
    dtype: the name of q/k/v's dtype, e.g. "bfloat16", or an FP8 dtype of
      `FP8_DTYPES` (then the operands carry the three descales).
    scale: logit scale (natural units).
    mask: the mask description.
    logits_soft_cap: cap of `cap * tanh(logit / cap)`, or None.
    has_bias: whether a dense bias is added to the logits.
    modifiers: sinks, ALiBi, dropout.
    return_lse: whether the call also returns the natural-log lse.
    out_dtype: the name of the output's dtype, set for FP8 calls only
      (default "bfloat16"); None: the inputs' dtype.
    deterministic_grads: whether the gradients must be bitwise the same
      run to run (`flash_attention`'s `deterministic_grads`): False lets a
      backend pick kernels whose float32 sums vary in order where they are
      faster.
  """

  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: str
  scale: float
  mask: MaskSpec
  logits_soft_cap: float | None = None
  has_bias: bool = False
  modifiers: ModifierSpec = ModifierSpec()
  return_lse: bool = False
  out_dtype: str | None = None
  deterministic_grads: bool = True

  @property
  def group(self) -> int:
    """Query heads per key/value head (GQA group size)."""
    return self.num_heads // self.num_kv_heads

  @property
  def is_fp8(self) -> bool:
    """Whether q, k and v are FP8 (scaled by the operands' descales)."""
    return self.dtype in FP8_DTYPES

  @property
  def output_dtype(self) -> str:
    """The name of the output's dtype."""
    return self.out_dtype or self.dtype

  def dequantized(self) -> CallSpec:
    """This FP8 call as a backend without FP8 kernels runs it: q, k and v
    dequantized to `DEQUANTIZED_DTYPE` (a paged cache gathered into a dense
    one first, since a page has no batch element whose descale it could
    take), the output in that dtype (`fp8.dequantize_operands`)."""
    return dataclasses.replace(
        self, dtype=DEQUANTIZED_DTYPE, out_dtype=None,
        mask=dataclasses.replace(self.mask, paged=False))


def describe_call(operands: Operands, *, scale: float, is_causal: bool,
                  bottom_right: bool = False,
                  window: tuple[int, int] | None = None,
                  logits_soft_cap: float | None = None,
                  dropout_rate: float = 0.0,
                  return_lse: bool = False,
                  out_dtype: str | None = None,
                  deterministic_grads: bool = True) -> CallSpec:
  """The call's spec; every presence flag is read off `operands` here.

  Args:
    out_dtype: the output dtype's name for FP8 operands (default
      "bfloat16"); must be None otherwise.

  Raises:
    ValueError: if the dropout rate and the presence of seeds disagree, or
      FP8 operands and descales (or out_dtype) do not go together.
  """
  if (dropout_rate > 0.0) != (operands.dropout_seeds is not None):
    raise ValueError(f"dropout_rate={dropout_rate} needs dropout seeds, and "
                     "seeds need a positive rate.")
  dtype = jnp.dtype(operands.query.dtype).name
  descales = (operands.q_descale, operands.k_descale, operands.v_descale)
  fp8 = dtype in FP8_DTYPES
  if any((d is None) == fp8 for d in descales) or (
      out_dtype is not None and not fp8):
    raise ValueError(f"{dtype} operands take the three descales (and "
                     "out_dtype) if and only if they are FP8.")
  batch, q_len, num_heads, head_dim = operands.query.shape
  kv_len, num_kv_heads = operands.kv_seq, operands.key.shape[2]
  # The alignment matters only where positions do (one spec otherwise).
  uses_positions = (is_causal or window is not None
                    or operands.alibi_slopes is not None)
  mask = MaskSpec(
      is_causal=bool(is_causal),
      has_lengths=(operands.q_lengths is not None
                   or operands.kv_lengths is not None),
      bottom_right=bool(bottom_right and uses_positions), window=window,
      has_segments=operands.q_segment_ids is not None,
      has_dense_mask=operands.mask is not None,
      paged=operands.block_table is not None)
  modifiers = ModifierSpec(has_sinks=operands.sinks is not None,
                           has_alibi=operands.alibi_slopes is not None,
                           dropout_rate=float(dropout_rate))
  return CallSpec(
      batch=batch, q_len=q_len, kv_len=kv_len, num_heads=num_heads,
      num_kv_heads=num_kv_heads, head_dim=head_dim,
      dtype=dtype, scale=float(scale),
      mask=mask, logits_soft_cap=logits_soft_cap,
      has_bias=operands.bias is not None, modifiers=modifiers,
      return_lse=bool(return_lse),
      out_dtype=(out_dtype or FP8_OUT_DTYPE) if fp8 else None,
      deterministic_grads=bool(deterministic_grads))


@dataclasses.dataclass(frozen=True)
class BackendOptions:
  """The backend options of a call, as the user spelled them.

  They belong to backends by type (`registry.Backend.takes`): a call that
  sets one runs only on a backend that takes it, whose `configure` receives
  it as a keyword argument.

  Attributes:
    block_sizes: a backend's tiles, or None; its class says whose (a
      `jflash.BlockSizes` is Triton's, a `jflash.MosaicBlockSizes`
      Mosaic's: `registry.Backend.block_sizes_type`).
    interpret: run the kernels through the Pallas interpreter (backends
      whose capabilities say `interpretable`).
    num_splits: key splits per (sequence, kv head) of the split-K decode
      kernel (`decode_attention`'s option; the "decode" backend's).
  """

  block_sizes: Any = None
  interpret: bool = False
  num_splits: int | None = None

  def given(self) -> dict[str, Any]:
    """The options set (not None or False), by their keyword names."""
    return {field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if getattr(self, field.name) is not field.default}
