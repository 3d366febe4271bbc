"""The kernels bound as one differentiable function through `jax.custom_vjp`.

Residuals saved by the forward rule: q, k, v, the output O and the base-2
log-sum-exp (float32 [batch, num_heads, q_len]); nothing of size seq x seq.

Transforms:
- `vmap`: each kernel launch is wrapped with `fold_vmap_into_batch`, which
  folds any vmapped axes into the batch axis the kernels already have, so
  nested `vmap`s never add grid dimensions (Triton grids have at most three).
- `grad`, `jit`, `jax.checkpoint`: through `custom_vjp` as usual.
- Higher-order derivatives raise `NotImplementedError` (the backward kernels
  are not themselves differentiable).
"""

from __future__ import annotations

import functools

import jax
from jax import custom_batching
import jax.numpy as jnp

from jflash._src import backward
from jflash._src import forward
from jflash._src.forward import KernelConfig


def fold_vmap_into_batch(fn):
  """Makes `fn` batch under `vmap` by folding the mapped axis into axis 0.

  Every argument and output of `fn` must have the kernels' batch axis first.
  Under `vmap`, the mapped axis (moved to the front) and the batch axis are
  merged, `fn` runs once on the larger batch, and the outputs are split back.
  Unbatched arguments are broadcast first (the kernels index every operand by
  batch element).
  """

  @custom_batching.custom_vmap
  def folded(*args):
    return fn(*args)

  @folded.def_vmap
  def _rule(axis_size, in_batched, *args):
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


def _forward(q, k, v, q_lens, kv_lens, config: KernelConfig):
  call = functools.partial(forward.forward_call, config=config)
  return fold_vmap_into_batch(call)(q, k, v, q_lens, kv_lens)


def _backward(config: KernelConfig, q, k, v, out, lse, q_lens, kv_lens, dout):
  delta = fold_vmap_into_batch(
      functools.partial(backward.delta_call, config=config))(out, dout)
  dk, dv = fold_vmap_into_batch(
      functools.partial(backward.dkv_call, config=config))(
          q, k, v, dout, lse, delta, q_lens, kv_lens)
  dq = fold_vmap_into_batch(
      functools.partial(backward.dq_call, config=config))(
          q, k, v, dout, lse, delta, q_lens, kv_lens)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def flash_attention_kernels(q, k, v, q_lens, kv_lens, config: KernelConfig):
  """Attention through the Pallas kernels; shapes as `forward.forward_call`."""
  out, _ = _forward(q, k, v, q_lens, kv_lens, config)
  return out


def _fwd_rule(q, k, v, q_lens, kv_lens, config: KernelConfig):
  # Differentiating the forward rule happens only for higher-order
  # derivatives: make that a clear error rather than a Pallas internal one.
  forward_fn = _no_higher_order(
      functools.partial(_forward, config=config), "the forward pass")
  out, lse = forward_fn(q, k, v, q_lens, kv_lens)
  return out, (q, k, v, out, lse, q_lens, kv_lens)


def _bwd_rule(config: KernelConfig, residuals, dout):
  q, k, v, out, lse, q_lens, kv_lens = residuals
  backward_fn = _no_higher_order(
      functools.partial(_backward, config), "the backward pass")
  dq, dk, dv = backward_fn(q, k, v, out, lse, q_lens, kv_lens, dout)
  # Lengths are integers: no cotangent.
  return dq, dk, dv, None, None


flash_attention_kernels.defvjp(_fwd_rule, _bwd_rule)
