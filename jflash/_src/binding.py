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
under `vmap` every pass folds the vmapped axis into the batch axis
(batching.py). Batch and head sharding: sharding.py, applied in
`attention`.
"""

from __future__ import annotations

import functools

import jax

from jflash._src import batching
from jflash._src import numerics
from jflash._src import registry
from jflash._src import sharding
from jflash._src.spec import CallSpec
from jflash._src.spec import Operands


def forward_only(fn, message: str):
  """`fn`, whose derivative (forward or reverse mode, with respect to any
  argument) raises NotImplementedError(message)."""

  @jax.custom_jvp
  def wrapped(*args):
    return fn(*args)

  @wrapped.defjvp
  def _jvp(primals, tangents):
    del primals, tangents
    raise NotImplementedError(message)

  return wrapped


def _no_higher_order(fn, what: str):
  """Wraps `fn` so that differentiating it raises a clear error."""
  return forward_only(
      fn, f"jflash.flash_attention: {what} is not differentiable; "
      "higher-order derivatives (e.g. grad of grad, or jvp of grad) are not "
      "supported.")


# The layout names (sharding.py) of each pass's arguments and results.
_FORWARD_ARGS, _FORWARD_RESULTS = ("operands",), ("out", "lse2")
_BACKWARD_ARGS = ("operands", "out", "lse2", "dout", "dlse")


def _run_pass(spec: CallSpec, plan: registry.Plan, pass_: str,
              partition: bool, *args):
  """Runs one pass with the backend the plan chose for it.

  Layers, inside out: the backend's function bound to the call and its
  configuration; per-shard partitioning (`partition`: more than one device
  and no sharding in the types, see sharding.py); a guard that makes
  differentiating a kernel pass a clear error; and the fold of `vmap` into
  the batch axis (kernel grids have no room for a vmap axis).
  """
  name, config = ((plan.forward, plan.forward_config)
                  if pass_ == registry.FORWARD
                  else (plan.backward, plan.backward_config))
  backend = registry.get(name)
  fn = functools.partial(_shared_pass, name, pass_, spec, config)
  if partition:
    if pass_ == registry.FORWARD:
      fn = sharding.partitioned(fn, spec, _FORWARD_ARGS, _FORWARD_RESULTS)
    else:
      present = [f for f in ("bias", "sinks")
                 if getattr(args[0], f) is not None]
      fn = sharding.partitioned(fn, spec, _BACKWARD_ARGS,
                                ("query", "key", "value", *present))
  if not backend.differentiable:
    fn = _no_higher_order(fn, f"the {pass_} pass")
  return batching.fold_vmap_into_batch(fn)(*args)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _shared_pass(name: str, pass_: str, spec: CallSpec, config, *args):
  """Backend `name`'s `pass_` of the call, under a `jax.jit` keyed by the
  call's static description: equal calls in one program (the layers of an
  unrolled model) trace to one jaxpr, which JAX lowers once, so their
  kernels are one module, lowered and compiled once (each Pallas lowering
  names its module apart, so equal kernels lowered twice are compiled
  twice: RECORD 2026-11-26, "kernels compiled once per program")."""
  return getattr(registry.get(name), pass_)(spec, config, *args)


def clear_traced_passes() -> None:
  """Drops the passes `_shared_pass` has traced. For code that changes
  what a pass reads while it traces (a benchmark comparing module
  switches or launches under `mock.patch`, a test's spy): without this, a
  call equal to one traced before reuses that trace, and the change is
  silently not seen."""
  _shared_pass.clear_cache()


def forward_pass(spec: CallSpec, plan: registry.Plan, operands: Operands):
  """(out, lse2) of the call's forward pass, outside the `custom_vjp`.

  For code that composes several calls and writes the backward of the
  composition itself (ring.py: one call per key shard, merged through the
  lse): the pass runs as in `attention` (vmap folded into the batch), on
  arrays that are one shard, and saves nothing.

  Raises:
    NotImplementedError: when the planned backend has no separate forward
      pass (cudnn: only jax.nn's whole call).
  """
  if registry.get(plan.forward).forward is None:
    raise NotImplementedError(
        f"implementation={plan.forward!r} has no separate forward pass (it "
        "runs only as one differentiable call); a composition of calls "
        "needs one that returns the lse.")
  return _run_pass(spec, plan, registry.FORWARD, False, operands)


def backward_pass(spec: CallSpec, plan: registry.Plan, operands: Operands,
                  out, lse2, dout, dlse=None) -> Operands:
  """Cotangents of the call's backward pass from residuals given by the
  caller: `out` [B, T, N, H] and `lse2` (float32 [B, N, T], base 2, +inf on
  rows without keys) may be those of a larger call whose keys include
  these (every backend takes p = exp2(s2 - lse2) and delta = rowsum(dout *
  out) from them), which gives this call's share of that call's gradients.
  `dlse`: the natural lse's cotangent, [B, N, T], zero on rows without
  keys, or None.

  Raises:
    NotImplementedError: when the plan has no backward backend for the call.
  """
  if plan.backward is None:
    raise NotImplementedError(plan.backward_error)
  return _run_pass(spec, plan, registry.BACKWARD, False, operands, out, lse2,
                   dout, dlse)


def _outputs(spec: CallSpec, out, lse2):
  return (out, numerics.natural_lse(lse2)) if spec.return_lse else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attention_vjp(spec: CallSpec, plan: registry.Plan, partition: bool,
                   operands: Operands):
  return _outputs(spec, *_run_pass(spec, plan, registry.FORWARD, partition,
                                   operands))


def _forward_rule(spec: CallSpec, plan: registry.Plan, partition: bool,
                  operands: Operands):
  out, lse2 = _run_pass(spec, plan, registry.FORWARD, partition, operands)
  return _outputs(spec, out, lse2), (operands, out, lse2)


def _backward_rule(spec: CallSpec, plan: registry.Plan, partition: bool,
                   residuals, cotangent):
  if plan.backward is None:
    raise NotImplementedError(plan.backward_error)
  operands, out, lse2 = residuals
  dlse = None
  if spec.return_lse:
    dout, dlse = cotangent
    dlse = numerics.natural_lse_cotangent(dlse, lse2)
  else:
    dout = cotangent
  cotangents = _run_pass(spec, plan, registry.BACKWARD, partition, operands,
                         out, lse2, dout, dlse)
  # Inside a user's shard_map(check_vma=True): each cotangent must vary as
  # its primal does (a broadcast bias's partial sums are added up).
  return (sharding.match_vma(cotangents, operands),)


_attention_vjp.defvjp(_forward_rule, _backward_rule)


def _unsharded(spec: CallSpec, plan: registry.Plan, partition: bool,
               operands: Operands):
  """The call on arrays that are (or act as) one shard."""
  backend = registry.get(plan.forward)
  if backend.direct is not None and (plan.forward == plan.backward
                                     or backend.forward is None):
    direct = functools.partial(backend.direct, spec, plan.forward_config)
    if plan.backward is None:
      # A backend that is one differentiable call (cudnn) serving a call
      # no backward exists for (FP8): its autodiff must not run.
      direct = forward_only(direct, plan.backward_error)
    return direct(operands)
  return _attention_vjp(spec, plan, partition, operands)


def attention(spec: CallSpec, plan: registry.Plan, operands: Operands):
  """Attention of `operands` as `spec` describes, with `plan`'s backends.

  Batch and head sharding are handled here, for every backend (sharding.py).

  Returns:
    out [B, T, N, H] in the query's dtype; with spec.return_lse, the pair
    (out, natural lse float32 [B, T, N]), both differentiable.
  """
  where = sharding.placement(operands.query)
  if where == sharding.EXPLICIT:
    return sharding.shard_map_call(
        functools.partial(_unsharded, spec, plan, False), spec, operands)
  return _unsharded(spec, plan, where == sharding.PARTITIONED, operands)
