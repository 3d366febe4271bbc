"""Traced JAX functions evaluated in NumPy: the CPU models' index arithmetic.

The Mosaic model (tests/mosaic_model.py) takes every decision of the
kernels from jflash's own helpers, traced under the kernels' named axes, and
its segment tables from jflash's host code. Each case gives a different
program of a few hundred integer ops that runs once: XLA:CPU compiles such
a program in about a second (about 1 ms per op, with or without its
optimizations), the rules here evaluate it in a few milliseconds.

`jit(fn)` traces fn as jax.jit would (the same jaxpr, so the same calls of
the code under test) and evaluates the jaxpr one primitive at a time with
XLA's semantics: integer division rounds toward zero and
integer overflow wraps, as on the GPU; x / 0 is -1 and x % 0 is x, as
XLA:CPU computes them. Only the primitives those programs use have a rule,
with the operands they use: any other raises NotImplementedError, never a
guess. tests/jaxpr_numpy_test.py checks every rule against XLA.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.extend import core
import numpy as np


def jit(fn, static_argnums: tuple[int, ...] = ()):
  """fn as jax.jit(fn, static_argnums=...) would run it, evaluated in
  NumPy: traced once per signature (the positional arguments' pytree
  structure, shapes and dtypes, and the static arguments' values), then
  each call evaluates that jaxpr with `_RULES`. Returns NumPy arrays.

  The arguments are converted as jax.jit converts them (float64 to
  float32 without x64), Python scalars traced. jax.jit calls inside fn are
  inlined (jax.disable_jit while tracing): the same primitives, without
  tracing each called jaxpr again under every named axis of a vmap.
  """
  traced = {}

  def call(*args):
    static = {i: args[i] for i in static_argnums}
    dynamic = [x for i, x in enumerate(args) if i not in static]
    leaves, tree = jax.tree.flatten(dynamic)
    key = (tuple(static.items()), tree,
           tuple((np.shape(x), np.result_type(x),
                  isinstance(x, (bool, int, float))) for x in leaves))
    if key not in traced:

      def traceable(*dynamic):
        rest = iter(dynamic)
        return fn(*(static[i] if i in static else next(rest)
                    for i in range(len(args))))

      with jax.disable_jit():
        traced[key] = jax.make_jaxpr(traceable, return_shape=True)(*dynamic)
    closed, shapes = traced[key]
    flat = evaluate_jaxpr(closed.jaxpr, closed.consts, *leaves)
    return jax.tree.unflatten(jax.tree.structure(shapes), flat)

  return call


def evaluate_jaxpr(jaxpr: core.Jaxpr, consts, *args) -> list[np.ndarray]:
  """The outputs of `jaxpr` on consts and args, evaluated with `_RULES`."""
  env = {}

  def read(var):
    if isinstance(var, core.Literal):
      return np.asarray(var.val, var.aval.dtype)
    return env[var]

  for var, x in (*zip(jaxpr.constvars, consts, strict=True),
                 *zip(jaxpr.invars, args, strict=True)):
    env[var] = np.asarray(x, var.aval.dtype)
  # Integer overflow wraps (as in XLA), without NumPy's warning.
  with np.errstate(over="ignore"):
    for eqn in jaxpr.eqns:
      name, params = eqn.primitive.name, eqn.params
      if name == "call_hi_primitive":
        # JAX >= 0.12's higher-level primitives (jnp.searchsorted's
        # SearchSorted): the rule of the primitive object's class.
        hi = params["_prim"]
        name, params = type(hi).__name__, hi.params
      rule = _RULES.get(name)
      if rule is None:
        _unsupported(str(eqn))
      (var,) = eqn.outvars
      x = np.asarray(rule(*(read(v) for v in eqn.invars), **params))
      if (x.shape, x.dtype) != (var.aval.shape, var.aval.dtype):
        raise AssertionError(f"{eqn.primitive} gave {x.dtype}"
                             f"{list(x.shape)}, not {var.aval}")
      env[var] = x
  return [read(var) for var in jaxpr.outvars]


def _unsupported(what: str):
  raise NotImplementedError(f"no NumPy rule for {what}")


def _integer(*xs) -> bool:
  """Whether every operand is an integer (or bool) array."""
  return all(np.issubdtype(x.dtype, np.integer) or x.dtype == bool
             for x in xs)


def _integers_only(rule):
  """rule, for integer operands only (the programs' floats are selected,
  never computed on)."""

  def checked(*xs, **params):
    if not _integer(*xs):
      _unsupported(f"{rule.__name__} of {[str(x.dtype) for x in xs]}")
    return rule(*xs, **params)

  return checked


@_integers_only
def _div(x, y):
  """lax.div: rounded toward zero, x / 0 = -1."""
  wide_x, wide_y = x.astype(np.int64), y.astype(np.int64)
  safe_y = np.where(wide_y == 0, 1, wide_y)
  floor = wide_x // safe_y
  # Floor division rounds down; toward zero differs when the signs differ
  # and the division is not exact.
  inexact = (floor * safe_y != wide_x) & ((wide_x < 0) != (safe_y < 0))
  return np.where(wide_y == 0, -1, floor + inexact).astype(x.dtype)


@_integers_only
def _rem(x, y):
  """lax.rem: the sign of x (C's %), x % 0 = x."""
  wide_x, wide_y = x.astype(np.int64), y.astype(np.int64)
  return np.where(wide_y == 0, wide_x,
                  np.fmod(wide_x, np.where(wide_y == 0, 1, wide_y))
                  ).astype(x.dtype)


def _mul(x, y, *, out_dtype):
  if out_dtype is not None:
    _unsupported(f"mul with out_dtype={out_dtype}")
  return np.multiply(x, y)


def _select_n(which, *cases):
  """lax.select_n: cases[which], element-wise (which: bool or int32)."""
  if which.dtype == bool and len(cases) == 2:
    return np.where(which, cases[1], cases[0])
  return np.choose(which, np.broadcast_arrays(*cases))


def _broadcast_in_dim(x, *, shape, broadcast_dimensions, sharding):
  del sharding
  new = [d for d in range(len(shape)) if d not in broadcast_dimensions]
  return np.broadcast_to(np.expand_dims(x, new), shape)


def _iota(*, dtype, shape, dimension, sharding):
  del sharding
  index = np.arange(shape[dimension], dtype=dtype)
  others = [d for d in range(len(shape)) if d != dimension]
  return np.broadcast_to(np.expand_dims(index, others), shape)


def _convert_element_type(x, *, new_dtype, weak_type, sharding):
  del weak_type, sharding
  if not _integer(x) and np.issubdtype(new_dtype, np.integer):
    _unsupported(f"converting {x.dtype} to {new_dtype} (XLA saturates)")
  return x.astype(new_dtype)


def _reshape(x, *, new_sizes, dimensions, sharding):
  del sharding
  if dimensions is not None:
    _unsupported(f"reshape with dimensions={dimensions}")
  return x.reshape(new_sizes)


def _pad(x, value, *, padding_config):
  """lax.pad without interior padding; negative edges cut."""
  if any(interior for _, _, interior in padding_config):
    _unsupported(f"interior padding {padding_config}")
  widths = [(max(lo, 0), max(hi, 0)) for lo, hi, _ in padding_config]
  x = np.pad(x, widths, constant_values=value)
  return x[tuple(slice(max(-lo, 0), x.shape[d] - max(-hi, 0))
                 for d, (lo, hi, _) in enumerate(padding_config))]


def _cumulative(ufunc):
  """lax.cummax / cummin along `axis`, from the end with `reverse`."""

  def rule(x, *, axis, reverse):
    if reverse:
      return np.flip(ufunc.accumulate(np.flip(x, axis), axis=axis), axis)
    return ufunc.accumulate(x, axis=axis)

  return rule


def _reduce(ufunc, lowest: bool):
  """lax.reduce_max (lowest: from the dtype's lowest value, the result
  where empty) or reduce_min (from its highest) over `axes`."""

  @_integers_only
  def reduce(x, *, axes, out_sharding):
    del out_sharding
    info = np.iinfo(x.dtype)
    return ufunc.reduce(x, axis=axes,
                        initial=info.min if lowest else info.max)

  return reduce


@_integers_only
def _reduce_sum(x, *, axes, out_sharding):
  del out_sharding
  return np.sum(x, axis=axes, dtype=x.dtype)


def _gather(operand, indices, *, dimension_numbers, slice_sizes, mode,
            fill_value, indices_are_sorted, unique_indices):
  """lax.gather of single elements (slice sizes 1: jnp indexing by
  integer arrays), start indices clamped into the operand (CLIP, and
  PROMISE_IN_BOUNDS as XLA:CPU computes it)."""
  del fill_value, indices_are_sorted, unique_indices
  numbers = dimension_numbers
  if (any(size != 1 for size in slice_sizes)
      or numbers.operand_batching_dims
      or mode not in (lax.GatherScatterMode.CLIP,
                      lax.GatherScatterMode.PROMISE_IN_BOUNDS)):
    _unsupported(f"gather {numbers}, slice_sizes={slice_sizes}, {mode}")
  index = [np.zeros(indices.shape[:-1], np.int64)] * operand.ndim
  for k, dim in enumerate(numbers.start_index_map):
    index[dim] = np.clip(indices[..., k], 0, operand.shape[dim] - 1)
  return np.expand_dims(operand[tuple(index)], numbers.offset_dims)


@_integers_only
def _search_sorted(sorted_values, queries, *, side, dimension, batch_dims,
                   method):
  """jnp.searchsorted's SearchSorted (JAX >= 0.12, a `call_hi_primitive`;
  older versions lower it to the primitives above): per batch index (the leading `batch_dims` axes of
  both operands), np.searchsorted of the queries in the sorted axis."""
  del method  # How XLA searches; the positions are the same.
  if dimension != batch_dims or sorted_values.ndim != batch_dims + 1:
    _unsupported(f"SearchSorted along {dimension} with {batch_dims} batch "
                 f"dims of a {sorted_values.ndim}-d operand")
  positions = np.empty(queries.shape, np.int32)
  for index in np.ndindex(*queries.shape[:batch_dims]):
    positions[index] = np.searchsorted(sorted_values[index], queries[index],
                                       side=side)
  return positions


# rule(*operands, **params) of each primitive: NumPy's ufunc where the
# primitive has no parameters.
_RULES = {
    "add": np.add,
    "sub": np.subtract,
    "mul": _mul,
    "div": _div,
    "rem": _rem,
    "max": np.maximum,
    "min": np.minimum,
    # Bitwise: logical on bools.
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "not": np.invert,
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    # Total order (lax.lt_to, le_to): the plain order on integers.
    "lt_to": _integers_only(np.less),
    "le_to": _integers_only(np.less_equal),
    "select_n": _select_n,
    "convert_element_type": _convert_element_type,
    "iota": _iota,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "squeeze": lambda x, *, dimensions: np.squeeze(x, dimensions),
    "transpose": lambda x, *, permutation: np.transpose(x, permutation),
    "concatenate": lambda *xs, dimension: np.concatenate(xs, dimension),
    "stack": lambda *xs, axis: np.stack(xs, axis),
    "pad": _pad,
    "cummax": _cumulative(np.maximum),
    "cummin": _cumulative(np.minimum),
    "reduce_max": _reduce(np.maximum, lowest=True),
    "reduce_min": _reduce(np.minimum, lowest=False),
    "reduce_sum": _reduce_sum,
    "gather": _gather,
    "SearchSorted": _search_sorted,
}
