"""`jflash.decode_attention`: attention of a few new tokens to a KV cache.

A thin public wrapper: it checks the cache, then runs `flash_attention`'s
call with the cache lengths, bottom-right positions and the page table, on
the backends the registry chooses (the split-K "decode" backend on a CUDA
GPU or with interpret=True, "xla" elsewhere).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax.numpy as jnp

from jflash._src import api
from jflash._src import registry
from jflash._src import validation
from jflash._src.backends.triton import decode_backend

MAX_NEW_TOKENS = decode_backend.MAX_NEW_TOKENS
# decode_attention's old names for the backends, and the registry's.
_RENAMED = {"triton": "decode"}


def _check(query, lengths):
  """ValueError for what `flash_attention` does not check itself (the rank,
  the token count, the lengths' presence); `api.describe` checks the rest
  (shapes, dtypes, heads, the block table)."""
  if query.ndim != 4:
    raise ValueError("decode_attention takes query [batch, new_tokens, "
                     f"num_heads, head_dim]; got query.shape={query.shape}.")
  batch, num_tokens = query.shape[:2]
  if not 1 <= num_tokens <= MAX_NEW_TOKENS:
    raise ValueError(
        f"decode_attention takes 1 to {MAX_NEW_TOKENS} new tokens per "
        f"sequence; got query.shape[1]={num_tokens}. For longer queries "
        "(prefill), use jflash.flash_attention with "
        "causal_alignment='bottom_right' and key_value_seq_lengths.")
  lengths = jnp.asarray(lengths)
  if (lengths.shape != (batch,)
      or not jnp.issubdtype(lengths.dtype, jnp.integer)):
    raise ValueError(
        "key_value_seq_lengths must be an integer array of shape "
        f"({batch},); got shape {lengths.shape} and dtype {lengths.dtype}.")


def decode_attention(query, key_cache, value_cache, key_value_seq_lengths,
                     *, block_table=None, scale=None, is_causal=True,
                     local_window_size=None, logits_soft_cap=None,
                     sinks=None, alibi_slopes=None, return_residual=False,
                     residual_dtype=None, return_residuals=False,
                     num_splits=None, implementation=None, interpret=False,
                     q_descale=None, k_descale=None, v_descale=None,
                     out_dtype=None):
  """Attention of T = 1..16 new tokens per sequence to a KV cache.

  Shapes: B batch, T new tokens, N query heads, K kv heads (N % K == 0;
  query head n reads kv head n // (N // K)), H head dim, S cache length.

  The cache holds L = key_value_seq_lengths[b] valid entries, the T new
  tokens' keys and values included, at positions L - T .. L - 1; query
  token t sits at position L - T + t. With `is_causal` it sees cache
  positions <= L - T + t; without, all L entries. A sequence with L = 0
  outputs 0. This is `jflash.flash_attention(query, key_cache,
  value_cache, key_value_seq_lengths=L, causal_alignment="bottom_right",
  block_table=...)`, which it calls: windows and ALiBi measure from the
  same positions, with or without causality.

  Args:
    query: [B, T, N, H], T in 1..16.
    key_cache, value_cache: dense [B, S, K, H]; or, with `block_table`,
      pages [num_pages, page_size, K, H], page_size a multiple of 16.
    key_value_seq_lengths: int [B], valid entries, in [0, S] (paged: S =
      max_pages * page_size).
    block_table: int [B, max_pages]: sequence b's cache position p lives
      in page block_table[b, p // page_size] at row p % page_size. Page ids
      are not checked when the call runs: an id outside [0, num_pages) for
      a position below the length is undefined behaviour (as in
      FlashAttention). Table entries and cache rows past a sequence's
      length never affect the result, whatever they hold (the kernel does
      not read them).
    scale: logit scale; default 1 / sqrt(H).
    is_causal: as above.
    local_window_size: (left, right) or one int: token t sees positions
      p with L - T + t - left <= p <= L - T + t + right (only those cache
      tiles are read).
    logits_soft_cap: cap * tanh(logits / cap), as flash_attention's.
    sinks: float [N] per-head sink logits, as flash_attention's.
    alibi_slopes: float [N]: logits minus slope * |position distance|.
    return_residual: as flash_attention (jax.nn's keyword): also return
      the natural-log lse [B, T, N] (-inf for rows that see nothing), in
      the query's dtype unless `residual_dtype` says otherwise.
    residual_dtype: the lse's dtype with return_residual=True.
    return_residuals: deprecated: return_residual=True with a float32 lse.
    num_splits: key splits per (sequence, kv head) of the "decode" kernel;
      default: enough to fill the GPU. Any count gives the same result up
      to float32 rounding. Ignored by the other backends.
    implementation: a backend of `jflash.implementations()`, as in
      flash_attention: "decode" (the split-K kernel; a CUDA GPU, or any
      machine with interpret=True), "xla" (stores [B, N, T, S] scores), or
      None: the registry's choice ("decode" on a CUDA GPU or with
      interpret=True, else "xla"). "triton", decode_attention's old name of
      the split-K kernel, is deprecated (it names the training kernels in
      flash_attention).
    interpret: run the kernel through the Pallas interpreter.
    q_descale, k_descale, v_descale, out_dtype: an FP8 query and cache, as
      in flash_attention (descales float32, broadcastable to [B, K]),
      forward only. The "decode" kernel reads a float8_e4m3fn query and
      cache (dense or paged) as they are, one byte per element, and
      applies the descales itself; other backends, and float8_e5m2, run
      the call dequantized to bfloat16 (a paged cache gathered first).

  Returns:
    out [B, T, N, H] in query's dtype (out_dtype for FP8); with
    return_residual, (out, lse).

  Raises:
    ValueError: bad shapes, dtypes, lengths, block table or page size,
      T > 16 (with a hint), bad options.
    NotImplementedError: when differentiated with a paged cache, and for
      options the named backend does not support.
  """
  query, key_cache, value_cache = (
      jnp.asarray(x) for x in (query, key_cache, value_cache))
  _check(query, key_value_seq_lengths)
  return_residual, residual_dtype = api.residual_options(
      "decode_attention", return_residual, residual_dtype, return_residuals)
  if implementation in _RENAMED:
    warnings.warn(
        f"jflash.decode_attention: implementation={implementation!r} is "
        f"deprecated; use {_RENAMED[implementation]!r} (flash_attention's "
        f"name of the split-K decode kernel).", DeprecationWarning,
        stacklevel=2)
    implementation = _RENAMED[implementation]
  if num_splits is not None and (
      isinstance(num_splits, bool) or not isinstance(num_splits, int)
      or num_splits < 1):
    raise ValueError(f"num_splits must be a positive int or None; got "
                     f"{num_splits!r}.")
  call = api.describe(
      query, key_cache, value_cache, scale=scale, is_causal=is_causal,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, interpret=interpret,
      logits_soft_cap=logits_soft_cap, causal_alignment="bottom_right",
      return_residual=return_residual, sinks=sinks,
      alibi_slopes=alibi_slopes, block_table=block_table,
      q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
      out_dtype=out_dtype)
  if num_splits is not None and _runs_decode(implementation, call):
    call = dataclasses.replace(call, options=dataclasses.replace(
        call.options, num_splits=num_splits))
  lse_dtype = validation.check_residual_dtype(
      residual_dtype, call.spec.output_dtype, return_residual)
  return api.run(call, implementation, lse_dtype)


def _runs_decode(implementation: str | None, call: api.DescribedCall
                 ) -> bool:
  """Whether the call may run on the "decode" backend, which alone takes
  `num_splits` (another backend ignores it)."""
  if implementation is not None:
    return implementation == "decode"
  backend = registry.get("decode")
  return registry.unavailable_reason(backend,
                                    call.options.interpret) is None

