"""Batch and head sharding, for every backend, in the one binding.

A `pallas_call` is opaque to XLA's partitioner: left alone, XLA gathers a
sharded q/k/v onto every device and each computes the whole attention. The
binding (binding.py) therefore runs each call per shard, by one of three
mechanisms chosen at trace time from the query's type (`placement`):

- "manual": inside a user's `shard_map` the arrays are already one shard;
  the call runs as is. Kernel outputs declare the inputs' varying manual
  axes (`varying_axes`), and cotangents are summed over the axes their
  primal does not vary over (`match_vma`), so `check_vma=True` works.
- "explicit": the query's type carries a mesh with Explicit axes
  (`jax.typeof(q).sharding`): the whole call, forward and backward, runs
  under `jax.shard_map` with specs read from that type (`shard_map_call`).
  shard_map's transpose sums the gradient of a bias broadcast over a
  sharded batch or head axis.
- "partitioned": more than one device and no sharding in the type (Auto
  meshes, classic `Mesh` + `jit`): each pass of the `custom_vjp` is a
  `custom_partitioning` (`partitioned`) whose callback sees the shardings
  XLA's partitioner (Shardy) chose and runs the pass per shard; the
  backward sums a broadcast bias's gradient itself.
- "single": one device and no Explicit mesh: nothing is added.

Why two mechanisms: the shardings of an Auto mesh are decided after tracing,
so only `custom_partitioning` sees them; and `custom_partitioning` fails on
Explicit meshes (the kernels are traced with the global, sharded types),
where `shard_map` driven by the types is the natural fit. Both share one
layout table (`_LAYOUTS`) and one validation (`_mesh_axes`).

Only the batch and head axes may be sharded. A device holds whole GQA
groups: the head axes must divide the number of key/value heads. A sharded
sequence raises ValueError pointing to context parallelism
(`jflash.ring_attention`, ring.py); under "partitioned" the error surfaces
when the call is compiled, as a JaxRuntimeError that carries the same
message.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jflash._src.spec import CallSpec
from jflash._src.spec import Operands

MANUAL, EXPLICIT, PARTITIONED, SINGLE = (
    "manual", "explicit", "partitioned", "single")

# The factors of every array the binding passes, one letter per axis: b
# batch, t query positions, s key positions, n query heads, k key/value
# heads, h head dim, "2" the dropout seeds' pair. n and k are sharded over
# the same mesh axes (whole GQA groups per device); b, n and k are the only
# factors that may be sharded. Dense bias/mask axes of size 1 that broadcast
# over the batch or the heads are never sharded (`_array_factors`).
_LAYOUTS = {
    "query": "btnh", "key": "bskh", "value": "bskh",
    "q_lengths": "b", "kv_lengths": "b",
    "q_segment_ids": "bt", "kv_segment_ids": "bs",
    "bias": "bnts", "mask": "bnts",
    "sinks": "bn", "alibi_slopes": "bn", "dropout_seeds": "bn2",
    # FP8 descales, per (batch, kv head): sharded like the kv heads.
    "q_descale": "bk", "k_descale": "bk", "v_descale": "bk",
    # A paged cache: the table's rows are the batch's; the pages (key and
    # value, [P, page_size, K, H], `_array_factors`) are shared by every
    # batch element: never split along P.
    "block_table": "bm",
    "out": "btnh", "lse2": "bnt", "dout": "btnh", "dlse": "bnt",
    "lse": "btn",  # The natural lse returned to the user.
}


def placement(query: jax.Array) -> str:
  """How a call on `query` is distributed (see the module docstring)."""
  aval = jax.typeof(query)
  context = jax.sharding.get_abstract_mesh()
  if aval.mat.varying or (not context.empty and context.manual_axes):
    return MANUAL
  mesh = aval.sharding.mesh
  if not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types:
    # Also for a mesh of one device: kernels cannot index refs whose type
    # says "sharded", and shard_map hands them plain local arrays.
    return EXPLICIT
  if jax.device_count() == 1:
    return SINGLE
  return PARTITIONED


def _axes(entry) -> tuple[str, ...]:
  """A PartitionSpec entry as a tuple of mesh axis names."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _padded(spec, ndim: int) -> tuple:
  spec = tuple(spec)
  return spec + (None,) * (ndim - len(spec))


def _mesh_axes(mesh, q_spec, k_spec, spec: CallSpec):
  """(batch axes, head axes) of a call whose q and k have these specs.

  Raises:
    ValueError: for a sharded sequence or head_dim, or head axes that do
      not divide the key/value heads.
  """
  q_spec, k_spec = _padded(q_spec, 4), _padded(k_spec, 4)
  for name, array_spec, length in (("query", q_spec, "T"),
                                   ("key/value", k_spec, "S")):
    if _axes(array_spec[1]):
      raise ValueError(
          f"jflash.flash_attention: {name} is sharded along its sequence "
          f"axis ({length}, axis 1) over mesh axes {_axes(array_spec[1])}. "
          "Sharding the sequence needs context parallelism: use "
          "jflash.ring_attention (or ring_attention_local inside "
          "shard_map), or shard only the batch and/or the heads here.")
    if _axes(array_spec[3]):
      raise ValueError(
          f"jflash.flash_attention: {name} is sharded along head_dim "
          f"(axis 3) over mesh axes {_axes(array_spec[3])}; only the batch "
          "and head axes may be sharded.")
  batch_axes, head_axes = _axes(q_spec[0]), _axes(q_spec[2])
  devices = math.prod(mesh.shape[a] for a in head_axes)
  if spec.num_kv_heads % devices:
    raise ValueError(
        f"jflash.flash_attention: the heads are sharded {devices} ways over "
        f"mesh axes {head_axes}, which does not divide num_kv_heads="
        f"{spec.num_kv_heads} (num_heads={spec.num_heads}): each device "
        "must hold whole GQA groups. Shard the heads over fewer devices, or "
        "repeat the key/value heads first (jnp.repeat(key, r, axis=2), and "
        "the same for value).")
  return batch_axes, head_axes


def _array_factors(name: str, shape, spec: CallSpec) -> str:
  """The layout letters of one array; size-1 broadcast axes of a dense
  bias or mask become "1" (never sharded)."""
  factors = _LAYOUTS[name]
  if spec.mask.paged and name in ("key", "value"):
    factors = "pskh"
  if name in ("bias", "mask"):
    broadcast_batch = shape[0] == 1 and spec.batch != 1
    broadcast_heads = shape[1] == 1 and spec.num_heads != 1
    factors = (("1" if broadcast_batch else "b")
               + ("1" if broadcast_heads else "n") + "ts")
  return factors


def _partition_spec(factors: str, batch_axes, head_axes) -> P:
  entry = {"b": _entry(batch_axes), "n": _entry(head_axes),
           "k": _entry(head_axes)}
  return P(*(entry.get(f) for f in factors))


def _named_leaves(tree, names: tuple[str, ...]):
  """[(layout name, array)] of a pass's arguments or results: Operands
  fields by name, other arrays by `names` (None entries are absent)."""
  result = []
  for name, item in zip(names, tree):
    if isinstance(item, Operands):
      result += [(f.name, getattr(item, f.name))
                 for f in dataclasses.fields(item)
                 if getattr(item, f.name) is not None]
    elif item is not None:
      result.append((name, item))
  return result


def _bias_sum_axes(bias_shape, spec: CallSpec, batch_axes, head_axes):
  """Mesh axes over which a broadcast bias's local gradients add up."""
  factors = _array_factors("bias", bias_shape, spec)
  return ((batch_axes if factors[0] == "1" else ())
          + (head_axes if factors[1] == "1" else ()))


# The explicit mechanism: shard_map over the whole call.


def shard_map_call(fn: Callable[[Operands], Any], spec: CallSpec,
                   operands: Operands):
  """Runs fn(operands) per shard on the mesh of the query's Explicit type.

  Operands are resharded to the layout table's specs first (a no-op where
  they already are; optional operands laid out differently are moved, q, k
  and v only ever lose replication).
  """
  q_sharding = jax.typeof(operands.query).sharding
  mesh = q_sharding.mesh
  batch_axes, head_axes = _mesh_axes(
      mesh, q_sharding.spec, jax.typeof(operands.key).sharding.spec, spec)
  if not batch_axes and not head_axes:
    return fn(operands)
  in_specs = Operands(**{
      name: _partition_spec(_array_factors(name, x.shape, spec), batch_axes,
                            head_axes)
      for name, x in _named_leaves((operands,), ("operands",))})
  operands = jax.tree.map(jax.sharding.reshard, operands, in_specs)
  out_spec = _partition_spec(_LAYOUTS["out"], batch_axes, head_axes)
  lse_spec = _partition_spec(_LAYOUTS["lse"], batch_axes, head_axes)
  # check_vma=False: the body is ours, and its kernels run unchanged.
  return jax.shard_map(
      fn, mesh=mesh, in_specs=(in_specs,),
      out_specs=(out_spec, lse_spec) if spec.return_lse else out_spec,
      check_vma=False)(operands)


# The partitioned mechanism: custom_partitioning around each pass.


def _spec_of(sharding, mesh, ndim: int):
  """The PartitionSpec of a sharding the partitioner chose, or None when it
  splits an axis over part of a mesh axis (the compound head factor does
  that when the head axes do not divide the key/value heads)."""
  if isinstance(sharding, NamedSharding):
    return _padded(sharding.spec, ndim)
  # Not a named sharding (decode_shardings=False): JAX's own parser, private
  # API; anything it cannot express is reported as undecodable.
  from jax._src import sharding_impls  # pylint: disable=g-import-not-at-top
  try:
    return _padded(sharding_impls.parse_flatten_op_sharding(
        sharding._hlo_sharding, mesh)[0], ndim)  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-exception-caught
    return None


def partitioned(fn: Callable[..., Any], spec: CallSpec,
                arg_names: tuple[str, ...], result_names: tuple[str, ...]):
  """`fn` as a custom_partitioning that runs it per shard.

  Args:
    fn: one pass. Its positional arguments are `Operands` or arrays (or
      None), its results a tuple of arrays or an `Operands` of cotangents.
    spec: the call.
    arg_names: the layout name of each argument (`_LAYOUTS`), "operands"
      for an Operands.
    result_names: the layout names of its result leaves, in order
      (cotangents carry their primal's name).

  Returns:
    A function of the same arguments as `fn`.
  """

  def call(*args):
    arg_leaves = _named_leaves(args, arg_names)
    shapes = {name: x.shape for name, x in arg_leaves}
    shapes.update(out=shapes["query"], dout=shapes["query"])
    result_leaves = [(name, shapes.get(name)) for name in result_names]
    wrapped = custom_partitioning(fn)

    def partition(mesh, arg_shapes, result_shape):
      names = [name for name, _ in arg_leaves]
      arg_shapes = jax.tree.leaves(arg_shapes)
      q_spec = _spec_of(arg_shapes[names.index("query")].sharding, mesh, 4)
      k_spec = _spec_of(arg_shapes[names.index("key")].sharding, mesh, 4)
      if k_spec is None:
        # The partitioner split the kv heads over part of a mesh axis: the
        # head axes do not divide them (`_mesh_axes` says so).
        k_spec = (None,) * 4
      if q_spec is None:
        raise ValueError("jflash.flash_attention: the query's sharding "
                         f"{arg_shapes[0].sharding} cannot be split into "
                         "batch and head shards.")
      batch_axes, head_axes = _mesh_axes(mesh, q_spec, k_spec, spec)
      to_sharding = lambda name, shape: NamedSharding(mesh, _partition_spec(
          _array_factors(name, shape, spec), batch_axes, head_axes))
      arg_shardings = jax.tree.unflatten(
          jax.tree.structure(args),
          [to_sharding(name, x.shape) for name, x in arg_leaves])
      result_shardings = jax.tree.unflatten(
          jax.tree.structure(result_shape),
          [to_sharding(name, shape) for name, shape in result_leaves])
      sum_axes = () if "bias" not in shapes else _bias_sum_axes(
          shapes["bias"], spec, batch_axes, head_axes)

      def per_shard(*local_args):
        result = fn(*local_args)
        if (sum_axes and isinstance(result, Operands)
            and result.bias is not None):
          result = result.replace(bias=lax.psum(result.bias, sum_axes))
        return result

      return mesh, per_shard, result_shardings, arg_shardings

    unique = iter(range(1 << 30))
    # Shardy factor names: n is the compound (k g), broadcast axes get a
    # factor of their own (never sharded).
    factor = lambda f: {"n": "(k g)", "2": "two"}.get(
        f, f"one{next(unique)}" if f == "1" else f)
    layout = lambda name, shape: " ".join(
        factor(f) for f in _array_factors(name, shape, spec))
    rule = (", ".join(layout(name, x.shape) for name, x in arg_leaves)
            + " -> "
            + ", ".join(layout(name, shape) for name, shape in result_leaves))
    wrapped.def_partition(
        partition=partition, sharding_rule=rule, decode_shardings=False,
        need_replication_factors=tuple(
            f for f in ("h", "two") if f in rule.split()),
        g=spec.group)
    return wrapped(*args)

  return call


def varying_axes(*trees) -> frozenset[str]:
  """The manual mesh axes any array of `trees` varies over (inside a user's
  `shard_map` with check_vma=True; empty elsewhere)."""
  return frozenset().union(*(jax.typeof(x).mat.varying
                             for x in jax.tree.leaves(trees)))


def output_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
  """A kernel output's ShapeDtypeStruct, varying over what its inputs vary
  over (Pallas needs that under shard_map(check_vma=True))."""
  varying = varying_axes(*inputs)
  if not varying:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(
      shape, dtype,
      manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def match_vma(cotangents, primals):
  """Cotangents with their primals' manual-axis types: where a primal is
  invariant over an axis its cotangent varies over (a bias broadcast over a
  sharded batch, each shard holding a partial sum), the cotangent is summed
  over it. A no-op outside shard_map(check_vma=True)."""

  def match(cotangent, primal):
    if cotangent is None or primal is None:
      return cotangent
    extra = (jax.typeof(cotangent).mat.varying
             - jax.typeof(primal).mat.varying)
    return lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent

  return jax.tree.map(match, cotangents, primals,
                      is_leaf=lambda x: x is None)
