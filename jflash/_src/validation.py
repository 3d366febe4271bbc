"""Validation of `flash_attention`'s arguments, before any backend runs.

Each check raises ValueError naming the argument and the shapes for bad
input, and returns the argument in the form the call description takes
(spec.py). Which dtypes, head dimensions and options a backend supports is
not checked here but by the registry (registry.py), per backend.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jflash._src.spec import FP8_DTYPES


def check_operands(query, key, value, *, same_batch: bool = True):
  """Validates q, k, v: ranks, shapes, the GQA head ratio, one dtype.

  `same_batch=False`: k/v's leading axis is not the batch (paged caches).
  """
  shapes = f"query.shape={query.shape}, key.shape={key.shape}, " \
           f"value.shape={value.shape}"
  if query.ndim not in (3, 4) or key.ndim != query.ndim or \
      value.ndim != query.ndim:
    raise ValueError(
        "query, key and value must all be 4-D [batch, seq_len, num_heads, "
        f"head_dim] or all 3-D [seq_len, num_heads, head_dim]; got {shapes}.")
  if key.shape != value.shape:
    raise ValueError(f"key and value must have the same shape; got {shapes}.")
  if same_batch and query.ndim == 4 and query.shape[0] != key.shape[0]:
    raise ValueError(f"query and key must have the same batch size; got "
                     f"{shapes}.")
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(f"query and key must have the same head_dim; got "
                     f"{shapes}.")
  num_heads, num_kv_heads = query.shape[-2], key.shape[-2]
  if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
    raise ValueError(
        f"The number of query heads ({num_heads}) must be a multiple of the "
        f"number of key/value heads ({num_kv_heads}); got {shapes}.")
  if not query.dtype == key.dtype == value.dtype:
    fp8 = any(jnp.dtype(x.dtype).name in FP8_DTYPES
              for x in (query, key, value))
    raise ValueError(
        f"query, key and value must have the same dtype; got "
        f"query.dtype={query.dtype}, key.dtype={key.dtype}, "
        f"value.dtype={value.dtype}."
        + (" FP8 attention takes all three in FP8 (jflash.quantize_qkv "
           "quantizes them together)." if fp8 else ""))
  head_dim = query.shape[-1]
  if head_dim == 0:
    raise ValueError(f"head_dim must be positive; got {shapes}.")


# Paged caches: page sizes are multiples of this (the decode kernel's
# smallest key tile).
PAGE_MULTIPLE = 16


def check_block_table(block_table, query, key):
  """Validates a paged cache's block table (int [batch, max_pages]) and page
  size; returns it as int32, or None without one."""
  if block_table is None:
    return None
  block_table = jnp.asarray(block_table)
  batch = query.shape[0] if query.ndim == 4 else 1
  if (block_table.ndim != 2 or block_table.shape[0] != batch
      or not jnp.issubdtype(block_table.dtype, jnp.integer)):
    raise ValueError(
        f"block_table must be an integer array [batch, max_pages] = "
        f"[{batch}, max_pages]; got shape {block_table.shape} and dtype "
        f"{block_table.dtype}.")
  if query.ndim != 4:
    raise ValueError("block_table needs batched inputs: query [batch, "
                     "seq_len, num_heads, head_dim]; got query.shape="
                     f"{query.shape}.")
  page_size = key.shape[1]
  if page_size % PAGE_MULTIPLE:
    raise ValueError(
        f"with block_table, key is [num_pages, page_size, kv_heads, "
        f"head_dim] with page_size a multiple of {PAGE_MULTIPLE}; got "
        f"key.shape={key.shape}.")
  return block_table.astype(jnp.int32)


def check_sinks(sinks, query_shape):
  """Validates sinks: a float [num_heads] array, or None."""
  if sinks is None:
    return None
  sinks = jnp.asarray(sinks)
  num_heads = query_shape[-2]
  if sinks.shape != (num_heads,):
    raise ValueError(
        f"sinks must have shape (num_heads,) = ({num_heads},), one logit per "
        f"query head; got sinks.shape={sinks.shape} (query.shape="
        f"{query_shape}).")
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise ValueError(f"sinks must be a float array; got "
                     f"sinks.dtype={sinks.dtype}.")
  return sinks


def check_alibi_slopes(slopes, query_shape):
  """Validates ALiBi slopes; returns them, not differentiable, or None."""
  if slopes is None:
    return None
  slopes = jnp.asarray(slopes)
  num_heads = query_shape[-2]
  shapes = [(num_heads,)]
  if len(query_shape) == 4:
    shapes.append((query_shape[0], num_heads))
  if slopes.shape not in shapes:
    expected = " or ".join(str(x) for x in shapes)
    raise ValueError(
        f"alibi_slopes must have shape (num_heads,) or (batch, num_heads) = "
        f"{expected}; got alibi_slopes.shape={slopes.shape} "
        f"(query.shape={query_shape}).")
  if not jnp.issubdtype(slopes.dtype, jnp.floating):
    raise ValueError(f"alibi_slopes must be a float array; got "
                     f"alibi_slopes.dtype={slopes.dtype}.")
  return not_differentiable(slopes)


def check_dropout(rate, rng, broadcast) -> float:
  """Validates the dropout options; returns the rate as a float."""
  rate = check_static_float(rate, "dropout_rate")
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1); got {rate!r}.")
  if not isinstance(broadcast, (bool, np.bool_)):
    raise ValueError(
        f"broadcast_dropout must be a bool, got {broadcast!r}.")
  if rate == 0.0:
    return rate
  if rng is None:
    raise ValueError(f"dropout_rng (a jax.random key) is required when "
                     f"dropout_rate > 0; got {rate=} and dropout_rng=None.")
  rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
  typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
  if (typed and rng.shape != ()) or (not typed and (
      rng.dtype != jnp.uint32 or rng.ndim != 1)):
    raise ValueError(
        f"dropout_rng must be one jax.random key (jax.random.key(...), or a "
        f"raw uint32 jax.random.PRNGKey); got dropout_rng.shape={rng.shape}, "
        f"dropout_rng.dtype={rng.dtype}.")
  return rate


@jax.custom_jvp
def not_differentiable(slopes):
  return slopes


@not_differentiable.defjvp
def _not_differentiable_jvp(primals, tangents):
  del primals, tangents
  raise NotImplementedError(
      "flash_attention: alibi_slopes are not differentiable; wrap them in "
      "jax.lax.stop_gradient if they are parameters.")


def check_static_float(value, name: str) -> float:
  """A float option known at trace time (kernels are compiled for it)."""
  if isinstance(value, (str, bytes, bool)):
    raise ValueError(f"{name} must be a Python float; got {value!r}.")
  try:
    result = float(value)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(
        f"{name} must be a Python float known at trace time; got {value!r}."
    ) from e
  if not math.isfinite(result):
    raise ValueError(f"{name} must be finite; got {value!r}.")
  return result


def check_window(local_window_size) -> tuple[int, int] | None:
  """Validates local_window_size; returns (left, right) or None."""
  if local_window_size is None:
    return None
  window = local_window_size
  if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
    window = (window, window)
  if (not isinstance(window, (tuple, list)) or len(window) != 2
      or not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool)
                 and w >= 0 for w in window)):
    raise ValueError("local_window_size must be a non-negative int or a pair "
                     f"(left, right) of them; got {local_window_size!r}.")
  return int(window[0]), int(window[1])


def check_dense(operand, name: str, query, key):
  """Validates `bias` or `mask`; returns None or [Bb, Nb, T, S].

  As jax.nn: rank <= 4, leading axes added as size 1, each axis 1 or the
  operands' (B, N, T, S) (B = 1 for unbatched operands). Size-1 query or key
  axes are broadcast here (materializing [Bb, Nb, T, S]); batch and head
  axes never are (the kernels index them).
  """
  if operand is None:
    return None
  operand = jnp.asarray(operand)
  batch = query.shape[0] if query.ndim == 4 else 1
  full = (batch, query.shape[-2], query.shape[-3], key.shape[-3])
  shapes = (f"{name}.shape={operand.shape}, query.shape={query.shape}, "
            f"key.shape={key.shape}")
  if operand.ndim > 4:
    raise ValueError(f"{name} must have at most 4 dimensions, broadcastable "
                     f"to [B, N, T, S] = {full}; got {shapes}.")
  given_shape = operand.shape
  operand = operand.reshape((1,) * (4 - operand.ndim) + operand.shape)
  if any(d not in (1, f) for d, f in zip(operand.shape, full)):
    hint = ""
    if name == "mask" and given_shape == (batch, full[3]) and query.ndim == 4:
      # A [B, S] padding mask (jax.nn reads a 2-D mask as [T, S]).
      hint = (" For a [B, S] padding mask (True = a real key), pass "
              "mask[:, None, None, :], or the number of real keys per "
              "example as key_value_seq_lengths (which also skips the padded "
              "tiles).")
    raise ValueError(f"{name} must be broadcastable to [B, N, T, S] = {full} "
                     f"(each axis 1 or full); got {shapes}.{hint}")
  if name == "mask" and operand.dtype != jnp.bool_:
    raise ValueError(f"mask must be a boolean array (True = attend); got "
                     f"mask.dtype={operand.dtype}.")
  if name == "bias" and not jnp.issubdtype(operand.dtype, jnp.floating):
    raise ValueError(f"bias must be a floating-point array; got "
                     f"bias.dtype={operand.dtype}.")
  return jnp.broadcast_to(operand, operand.shape[:2] + full[2:])


def check_segment_ids(q_segment_ids, kv_segment_ids, query, key):
  """Validates segment ids; returns () or the int32 pair (q_ids, kv_ids).

  Shapes are those of the (possibly unbatched) operands: [B, T] and [B, S],
  or [T] and [S].
  """
  if q_segment_ids is None and kv_segment_ids is None:
    return ()
  if q_segment_ids is None or kv_segment_ids is None:
    given, missing = (("q_segment_ids", "kv_segment_ids")
                      if kv_segment_ids is None
                      else ("kv_segment_ids", "q_segment_ids"))
    shape = jnp.shape(q_segment_ids if kv_segment_ids is None
                      else kv_segment_ids)
    raise ValueError(f"{given} (shape {shape}) was given without {missing}; "
                     "pass both or neither.")
  result = []
  for name, ids, operand, axis in (
      ("q_segment_ids", q_segment_ids, query, "T"),
      ("kv_segment_ids", kv_segment_ids, key, "S")):
    ids = jnp.asarray(ids)
    expected = operand.shape[:-2]
    dims = "[B, T]" if query.ndim == 4 else "[T]"
    dims = dims.replace("T", axis)
    if ids.shape != expected:
      raise ValueError(
          f"{name} must have shape {dims} = {expected}; got "
          f"{name}.shape={ids.shape} (query.shape={query.shape}, "
          f"key.shape={key.shape}).")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer array; got "
                       f"{name}.dtype={ids.dtype}.")
    result.append(ids.astype(jnp.int32))
  return tuple(result)


def check_lengths(lengths, name: str, batch: int, seq_len: int):
  """Validates a lengths argument; returns int32 [batch] clipped to seq_len,
  or None."""
  if lengths is None:
    return None
  lengths = jnp.asarray(lengths)
  if lengths.shape != (batch,):
    raise ValueError(f"{name} must have shape (batch,) = ({batch},); got "
                     f"{name}.shape={lengths.shape}.")
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array; got "
                     f"{name}.dtype={lengths.dtype}.")
  return jnp.clip(lengths, 0, seq_len).astype(jnp.int32)


def check_bool(value, name: str) -> bool:
  """A Python (or numpy) bool option."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be a bool, got {value!r}.")
  return bool(value)


def check_causal_alignment(causal_alignment) -> bool:
  """Validates causal_alignment; returns whether it is bottom-right."""
  if causal_alignment not in ("top_left", "bottom_right"):
    raise ValueError("causal_alignment must be 'top_left' or 'bottom_right'; "
                     f"got {causal_alignment!r}.")
  return causal_alignment == "bottom_right"


def check_soft_cap(logits_soft_cap) -> float | None:
  """Validates logits_soft_cap: None or a positive Python float."""
  if logits_soft_cap is None:
    return None
  soft_cap = check_static_float(logits_soft_cap, "logits_soft_cap")
  if soft_cap <= 0.0:
    raise ValueError(f"logits_soft_cap must be positive; got "
                     f"{logits_soft_cap!r}.")
  return soft_cap



# The output dtypes an FP8 call may ask for.
FP8_OUT_DTYPES = ("bfloat16", "float16", "float32")
DESCALES = ("q_descale", "k_descale", "v_descale")


def check_fp8(query, key, descales: dict, out_dtype):
  """Validates the FP8 options of a call on q/k/v of one dtype.

  Args:
    query, key: the call's (possibly unbatched, or paged) operands.
    descales: {"q_descale": ..., "k_descale": ..., "v_descale": ...}, each
      None or array-like.
    out_dtype: the output dtype asked for, or None.

  Returns:
    (descales, out_dtype): for FP8 inputs the three descales as float32
    [B, K] (B = 1 for unbatched inputs) and out_dtype's name or None (the
    default); for other inputs (None, None, None) and None.

  Raises:
    ValueError: FP8 inputs without all three descales; descales or an
      out_dtype other than the inputs' dtype with other inputs; a descale
      that is not a float array broadcastable to [B, K] ([K] unbatched:
      rank 0 or 1) or, batched, of rank 1 (ambiguous: use [1, K] or
      [B, 1]); an out_dtype outside FP8_OUT_DTYPES.
  """
  dtype = jnp.dtype(query.dtype).name
  if dtype not in FP8_DTYPES:
    given = [name for name in DESCALES if descales[name] is not None]
    if given:
      raise ValueError(
          f"{', '.join(given)} scale FP8 inputs ({', '.join(FP8_DTYPES)}) "
          f"only; got query.dtype={dtype}.")
    if out_dtype is not None and _dtype_name(out_dtype, "out_dtype") != dtype:
      raise ValueError(
          f"out_dtype applies to FP8 inputs; the output of {dtype} inputs "
          f"is {dtype}: pass out_dtype=None; got out_dtype={out_dtype!r}.")
    return (None, None, None), None
  batched = query.ndim == 4
  batch = query.shape[0] if batched else 1
  num_kv_heads = key.shape[-2]
  full = (batch, num_kv_heads) if batched else (num_kv_heads,)
  expected = (f"[batch, num_kv_heads] = {full}" if batched
              else f"[num_kv_heads] = {full} (unbatched inputs)")
  missing = [name for name in DESCALES if descales[name] is None]
  if missing:
    raise ValueError(
        f"FP8 inputs (query.dtype={dtype}) need q_descale, k_descale and "
        f"v_descale, float32 arrays broadcastable to {expected}; missing: "
        f"{', '.join(missing)}. jflash.quantize_qkv returns all three.")
  result = []
  for name in DESCALES:
    descale = jnp.asarray(descales[name])
    ranks = (0, 2) if batched else (0, 1)
    if (descale.ndim not in ranks or any(
        d not in (1, f) for d, f in zip(descale.shape, full[-descale.ndim:]
                                        if descale.ndim else ()))):
      hint = (" (a rank-1 descale is ambiguous for batched inputs: pass "
              "[1, num_kv_heads] or [batch, 1])"
              if batched and descale.ndim == 1 else "")
      raise ValueError(
          f"{name} must be a scalar or broadcastable to {expected}{hint}; "
          f"got {name}.shape={descale.shape} (query.shape={query.shape}, "
          f"key.shape={key.shape}).")
    if not jnp.issubdtype(descale.dtype, jnp.floating):
      raise ValueError(f"{name} must be a float array (cast to float32); "
                       f"got {name}.dtype={descale.dtype}.")
    descale = jnp.broadcast_to(descale.astype(jnp.float32), full)
    result.append(descale if batched else descale[None])
  if out_dtype is not None:
    out_dtype = _dtype_name(out_dtype, "out_dtype")
    if out_dtype not in FP8_OUT_DTYPES:
      raise ValueError(f"out_dtype of FP8 attention must be one of "
                       f"{FP8_OUT_DTYPES} or None (bfloat16); got "
                       f"out_dtype={out_dtype}.")
  return tuple(result), out_dtype


def _dtype_name(dtype, name: str) -> str:
  try:
    return jnp.dtype(dtype).name
  except TypeError as e:
    raise ValueError(f"{name} must be a dtype or None; got {dtype!r}."
                     ) from e


def check_residual_dtype(residual_dtype, input_dtype,
                         return_residual: bool):
  """The lse's dtype: `residual_dtype` (a floating dtype) or the inputs'."""
  if residual_dtype is not None and not return_residual:
    raise ValueError(f"residual_dtype={residual_dtype!r} applies only with "
                     "return_residual=True.")
  if residual_dtype is None:
    return jnp.dtype(input_dtype)
  try:
    dtype = jnp.dtype(residual_dtype)
  except TypeError as e:
    raise ValueError(f"residual_dtype must be a floating dtype or None; got "
                     f"{residual_dtype!r}.") from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"residual_dtype must be a floating dtype or None; got "
                     f"{dtype}.")
  return dtype
