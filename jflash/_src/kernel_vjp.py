"""The kernels bound as one differentiable function through `jax.custom_vjp`.

Two entry points share the rules: `flash_attention_kernels` (the output) and
`flash_attention_kernels_with_lse` (output and natural-log lse, both
differentiable). Residuals saved by the forward rule: q, k, v, the output O
and the base-2 log-sum-exp (float32 [batch, num_heads, q_len]), plus the
integer lengths and segment ids, the caller's own bias and mask, and the
modifiers' operands (modifiers.py); nothing of size seq x seq is created.

Transforms:
- `vmap`: each kernel launch is wrapped with `fold_vmap_into_batch`, which
  folds any vmapped axes into the batch axis the kernels already have, so
  nested `vmap`s never add grid dimensions (Triton grids have at most three).
  Not with a dense bias or mask yet (their batch axis may be a broadcast
  one): NotImplementedError.
- `grad`, `jit`, `jax.checkpoint`: through `custom_vjp` as usual.
- Higher-order derivatives raise `NotImplementedError` (the backward kernels
  are not themselves differentiable).
"""

from __future__ import annotations

import functools
import math

import jax
from jax import custom_batching
import jax.numpy as jnp

from jflash._src import backward
from jflash._src import forward
from jflash._src import modifiers
from jflash._src import tiles
from jflash._src.forward import KernelConfig


def fold_vmap_into_batch(fn, vmappable: bool = True):
  """Makes `fn` batch under `vmap` by folding the mapped axis into axis 0.

  Every argument and output of `fn` must have the kernels' batch axis first.
  Under `vmap`, the mapped axis (moved to the front) and the batch axis are
  merged, `fn` runs once on the larger batch, and the outputs are split back.
  Unbatched arguments are broadcast first (the kernels index every operand by
  batch element). With vmappable=False, vmap raises NotImplementedError.
  """

  @custom_batching.custom_vmap
  def folded(*args):
    return fn(*args)

  @folded.def_vmap
  def _rule(axis_size, in_batched, *args):
    if not vmappable:
      raise NotImplementedError(
          "jflash.flash_attention: vmap with a dense `bias` or `mask` is not "
          "supported yet; put the vmapped axis into the batch axis instead.")
    merged = []
    for arg, batched in zip(args, in_batched):
      if not batched:
        arg = jnp.broadcast_to(arg, (axis_size, *arg.shape))
      merged.append(arg.reshape((axis_size * arg.shape[1], *arg.shape[2:])))
    outs = folded(*merged)
    outs = jax.tree.map(
        lambda x: x.reshape((axis_size, x.shape[0] // axis_size,
                             *x.shape[1:])), outs)
    return outs, jax.tree.map(lambda _: True, outs)

  return folded


def _no_higher_order(fn, what: str):
  """Wraps `fn` so that differentiating it raises a clear error."""

  @jax.custom_jvp
  def wrapped(*args):
    return fn(*args)

  @wrapped.defjvp
  def _jvp(primals, tangents):
    del primals, tangents
    raise NotImplementedError(
        f"jflash.flash_attention: {what} is not differentiable; higher-order"
        " derivatives (e.g. grad of grad, or jvp of grad) are not supported."
    )

  return wrapped


def _vmappable(config: KernelConfig) -> bool:
  return not (config.has_bias or config.has_dense_mask)


def _extras(segment_ids, bias, dense_mask):
  """The kernels' optional operands, in `forward.split_extras` order."""
  return (*segment_ids, *(x for x in (bias, dense_mask) if x is not None))


def _forward(q, k, v, q_lens, kv_lens, mods: modifiers.Operands, *extras,
             config: KernelConfig):
  call = functools.partial(forward.forward_call, config=config)
  return fold_vmap_into_batch(call, _vmappable(config))(
      q, k, v, q_lens, kv_lens, *extras, *config.modifiers.select(mods))


def _sinks_gradient(sinks, lse2, delta):
  """d loss / d sinks, float32 [batch, num_heads].

  The sink enters row t only through its normalizer: with
  p_sink = exp(sink - lse), d lse / d sink = p_sink and d p_c / d sink =
  -p_c p_sink, so d out_t / d sink = -p_sink out_t and the row contributes
  p_sink * (dlse_t - dO_t . O_t) = -p_sink * delta_t (delta already shifted
  by dlse). Rows with lse2 = +-inf (padding rows, or a -inf sink and no key)
  contribute 0.
  """
  p_sink = jnp.where(jnp.isinf(lse2), 0.0,
                     jnp.exp2(sinks[..., None] * tiles.LOG2_E - lse2))
  return -jnp.sum(p_sink * delta, axis=-1)


def _backward(config: KernelConfig, q, k, v, out, lse, q_lens, kv_lens, mods,
              dout, dlse=None, extras=()):
  """(dq, dk, dv, dbias, dmods); dbias is None without a bias."""
  fold = functools.partial(fold_vmap_into_batch,
                           vmappable=_vmappable(config))
  delta = fold(
      functools.partial(backward.delta_call, config=config))(out, dout)
  if dlse is not None:
    # d lse / d s_c = p_c, so lse's cotangent enters as a shift of delta:
    # dS = p * (dP - delta) + p * dlse = p * (dP - (delta - dlse)).
    delta = delta - dlse
  mod_operands = config.modifiers.for_backward().select(mods)
  dk, dv = fold(
      functools.partial(backward.dkv_call, config=config))(
          q, k, v, dout, lse, delta, q_lens, kv_lens, *extras, *mod_operands)
  dq = fold(
      functools.partial(backward.dq_call, config=config))(
          q, k, v, dout, lse, delta, q_lens, kv_lens, *extras, *mod_operands)
  dbias = None
  if config.has_bias:
    dbias = fold(functools.partial(backward.dbias_call, config=config))(
        q, k, v, dout, lse, delta, q_lens, kv_lens, *extras)
  # ALiBi slopes take no gradient (api.py makes differentiating them an
  # error).
  dmods = modifiers.Operands(
      sinks=(None if mods.sinks is None
             else _sinks_gradient(mods.sinks, lse, delta)))
  return dq, dk, dv, dbias, dmods


def natural_lse(lse2):
  """Stored base-2 lse [B, N, T] -> natural-log lse [B, T, N] (jax.nn's).

  Rows with no visible key: stored as +inf (see forward.py), returned as
  log(0) = -inf.
  """
  lse = jnp.where(jnp.isinf(lse2), -jnp.inf, lse2 * math.log(2.0))
  return jnp.swapaxes(lse, 1, 2)


def _make_kernels_vjp(with_lse: bool):
  """The custom_vjp function, returning out or (out, natural lse).

  Its `segment_ids` argument is () without segments, else the pair
  (q_ids, kv_ids) of int32 [batch, q_len] and [batch, kv_len] arrays; `bias`
  and `dense_mask` (int8) are None or [bias_batch, 1 or num_heads, q_len,
  kv_len] (see dense.py). The bias is differentiable. `mods` holds the
  modifiers' arrays (`modifiers.Operands`); the sinks are differentiable.
  """

  def kernels(q, k, v, q_lens, kv_lens, segment_ids, bias, dense_mask, mods,
              config: KernelConfig):
    out, lse2 = _forward(q, k, v, q_lens, kv_lens, mods,
                         *_extras(segment_ids, bias, dense_mask),
                         config=config)
    return (out, natural_lse(lse2)) if with_lse else out

  kernels.__name__ = kernels.__qualname__ = (
      "flash_attention_kernels_with_lse" if with_lse
      else "flash_attention_kernels")
  kernels = jax.custom_vjp(kernels, nondiff_argnums=(9,))

  def fwd_rule(q, k, v, q_lens, kv_lens, segment_ids, bias, dense_mask, mods,
               config: KernelConfig):
    # Differentiating the forward rule happens only for higher-order
    # derivatives: make that a clear error rather than a Pallas internal one.
    forward_fn = _no_higher_order(
        functools.partial(_forward, config=config), "the forward pass")
    extras = _extras(segment_ids, bias, dense_mask)
    out, lse2 = forward_fn(q, k, v, q_lens, kv_lens, mods, *extras)
    primal = (out, natural_lse(lse2)) if with_lse else out
    return primal, (q, k, v, out, lse2, q_lens, kv_lens, mods, extras)

  def bwd_rule(config: KernelConfig, residuals, cotangent):
    q, k, v, out, lse2, q_lens, kv_lens, mods, extras = residuals
    dlse = None
    if with_lse:
      dout, dlse = cotangent
      # [B, T, N] -> [B, N, T]; rows without keys (p = 0) take no gradient.
      dlse = jnp.where(jnp.isinf(lse2), 0.0, jnp.swapaxes(dlse, 1, 2))
    else:
      dout = cotangent
    backward_fn = _no_higher_order(
        functools.partial(_backward, config), "the backward pass")
    dq, dk, dv, dbias, dmods = backward_fn(
        q, k, v, out, lse2, q_lens, kv_lens, mods, dout, dlse, extras)
    # Lengths, segment ids and the mask are integers: no cotangent.
    return dq, dk, dv, None, None, None, dbias, None, dmods

  kernels.defvjp(fwd_rule, bwd_rule)
  return kernels


# Attention through the Pallas kernels; shapes as `forward.forward_call`.
flash_attention_kernels = _make_kernels_vjp(with_lse=False)
# The same, also returning the natural-log lse [B, T, N], differentiable.
flash_attention_kernels_with_lse = _make_kernels_vjp(with_lse=True)
