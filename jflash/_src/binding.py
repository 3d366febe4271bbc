"""The one differentiable binding of every backend: `attention`.

`attention(spec, plan, operands)` runs the call with the backends the
registry planned for each pass, under one `jax.custom_vjp`:

- the forward rule runs the forward backend and saves the residuals: the
  operands, the output and the base-2 lse (float32 [batch, num_heads,
  q_len], numerics.py) — the one format every forward produces and every
  backward consumes, so the two passes may come from different backends;
- the backward rule runs the backward backend on them; with
  `spec.return_lse`, the natural lse is an output too, and its cotangent
  reaches the backward as `numerics.natural_lse_cotangent`.

A plan whose two passes are one backend written in plain JAX (the "xla"
backend, `registry.Backend.direct`) bypasses the `custom_vjp`: JAX
differentiates it itself, to any order and in forward mode. Kernel passes
are not differentiable again: higher-order derivatives raise a clear
NotImplementedError.

Transforms: `jit` and `jax.checkpoint` work through `custom_vjp` as usual;
`vmap` is each backend's business (the Triton backend folds the vmapped axis
into the batch).
"""

from __future__ import annotations

import functools

import jax

from jflash._src import numerics
from jflash._src import registry
from jflash._src.spec import CallSpec
from jflash._src.spec import Operands


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


def _pass_function(spec: CallSpec, plan: registry.Plan, pass_: str):
  """The backend function of one pass, bound to the call and its config:
  a function of arrays only (positional pytrees)."""
  name, config = ((plan.forward, plan.forward_config)
                  if pass_ == registry.FORWARD
                  else (plan.backward, plan.backward_config))
  backend = registry.get(name)
  fn = functools.partial(getattr(backend, pass_), spec, config)
  if not backend.differentiable:
    fn = _no_higher_order(fn, f"the {pass_} pass")
  return fn


def _outputs(spec: CallSpec, out, lse2):
  return (out, numerics.natural_lse(lse2)) if spec.return_lse else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention_vjp(spec: CallSpec, plan: registry.Plan, operands: Operands):
  forward = registry.get(plan.forward).forward
  return _outputs(spec, *forward(spec, plan.forward_config, operands))


def _forward_rule(spec: CallSpec, plan: registry.Plan, operands: Operands):
  # Differentiating this rule happens only for higher-order derivatives:
  # `_pass_function` makes that a clear error rather than a Pallas internal
  # one.
  out, lse2 = _pass_function(spec, plan, registry.FORWARD)(operands)
  return _outputs(spec, out, lse2), (operands, out, lse2)


def _backward_rule(spec: CallSpec, plan: registry.Plan, residuals,
                   cotangent):
  operands, out, lse2 = residuals
  dlse = None
  if spec.return_lse:
    dout, dlse = cotangent
    dlse = numerics.natural_lse_cotangent(dlse, lse2)
  else:
    dout = cotangent
  cotangents = _pass_function(spec, plan, registry.BACKWARD)(
      operands, out, lse2, dout, dlse)
  return (cotangents,)


_attention_vjp.defvjp(_forward_rule, _backward_rule)


def attention(spec: CallSpec, plan: registry.Plan, operands: Operands):
  """Attention of `operands` as `spec` describes, with `plan`'s backends.

  Returns:
    out [B, T, N, H] in the query's dtype; with spec.return_lse, the pair
    (out, natural lse float32 [B, T, N]), both differentiable.
  """
  backend = registry.get(plan.forward)
  if plan.forward == plan.backward and backend.direct is not None:
    return backend.direct(spec, plan.forward_config, operands)
  return _attention_vjp(spec, plan, operands)
