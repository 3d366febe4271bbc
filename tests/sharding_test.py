"""Batch and head sharding on 8 CPU devices, per backend (sharding.py).

The cases need 8 devices, which must be set before JAX starts: the CPU
suite's processes have 8 CPU devices (conftest.py) and run them directly.
A process with fewer (the GPU suite, or this file run alone) skips them,
saying so, and `EightDevicesTest` runs this file again in a subprocess with
JFLASH_TEST_CPU_DEVICES=8, failing with its output if any case fails.

Each case compares forward and gradients with the unsharded call (on the
xla backend, shared by all backends' cases), checks that outputs and
gradients keep the inputs' sharding, and that the compiled HLO gathers none
of q, k, v (an all-gather of a replicated bias's gradient is expected: the
user's bias is replicated, its gradient must be too).
"""

import contextlib
import functools
import re

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import jflash
from jflash._src import sharding
from tests import test_base
from tests import test_util

DEVICES = 8
B, T, N, K, H = 4, 40, 8, 4, 16
MESH_SHAPE, MESH_AXES = (2, 4), ("data", "model")
LAYOUTS = {"batch": P("data", None, None, None),
           "heads": P(None, None, "model", None),
           "batch_heads": P("data", None, "model", None)}


def _mesh(kind):
  types = (AxisType.Explicit if kind == "explicit" else AxisType.Auto,) * 2
  return jax.make_mesh(MESH_SHAPE, MESH_AXES, axis_types=types)


def _inputs(seed=0, num_kv_heads=K):
  """q, k, v, dout as NumPy arrays: placed on a mesh from the host, where a
  JAX array on one device would compile a small program per shape and mesh
  to be split (~0.05 s of CPU each)."""
  return tuple(map(np.asarray, test_util.random_inputs(
      seed, batch=B, q_len=T, kv_len=T, num_heads=N,
      num_kv_heads=num_kv_heads, head_dim=H)))


def _options(seed=1):
  """Lengths, segment ids, a head-broadcast bias and sinks: every operand
  kind the layout table has. Drawn with NumPy, as `_inputs` (jax.random
  compiles its samplers)."""
  rng = np.random.default_rng(seed)
  ids = jnp.asarray(np.stack([np.arange(T) // 11] * B), jnp.int32)
  return dict(
      is_causal=True, query_seq_lengths=jnp.array([T, 31, 17, T]),
      key_value_seq_lengths=jnp.array([T, T, 25, 9]),
      q_segment_ids=ids, kv_segment_ids=ids,
      bias=rng.standard_normal((1, N, T, T), np.float32),
      sinks=jnp.asarray(rng.standard_normal((N,), np.float32)))


def _gathers_of(hlo: str, shapes) -> list[str]:
  """All-gather instructions of the HLO whose result has one of `shapes`."""
  found = []
  for line in hlo.splitlines():
    match = re.search(r"= \w+\[([\d,]*)\][^ ]* all-gather(-start)?\(", line)
    if match:
      shape = tuple(int(d) for d in match.group(1).split(",") if d)
      if shape in shapes:
        found.append(line.strip())
  return found


_UNSHARDED = {}


def _unsharded(fn, args, key):
  """fn(*args) unsharded, computed once per key (the cases share inputs)."""
  if key not in _UNSHARDED:
    _UNSHARDED[key] = jax.jit(fn)(*args)
  return _UNSHARDED[key]


def _unsharded_xla(dout, args, key, **options):
  """Values and all gradients of the unsharded call on the xla backend:
  the expected results of every backend's sharded call (computed once per
  key for all of them; the interpreted Triton kernels' own unsharded call
  costs up to 11 s of compilation, and OneDeviceMeshTest runs it)."""
  fn = lambda *a: jflash.flash_attention(*a, implementation="xla", **options)
  return _unsharded(functools.partial(test_util.value_and_all_grads, fn,
                                      dout), args, key=("xla", *key))


@contextlib.contextmanager
def _interpret_under_check_vma():
  """Lets the Pallas interpreter run inside shard_map(check_vma=True).

  JAX 0.11.2's interpreter lowers a kernel with its inputs' manual-axis
  types but traces the kernel without them, and fails ("Primitive
  dynamic_slice requires varying manual axes to match"). Compiled kernels
  do not go through it. For this test only, the interpreter's lowering gets
  vma-free types; the shard_map around it still checks everything else.
  """
  from jax._src import config  # pylint: disable=g-import-not-at-top
  from jax._src import core  # pylint: disable=g-import-not-at-top
  from jax._src.interpreters import mlir  # pylint: disable=g-import-not-at-top
  from jax._src.pallas import pallas_call  # pylint: disable=g-import-not-at-top
  primitive = pallas_call.pallas_call_p
  lowerings = mlir._lowerings  # pylint: disable=protected-access
  original = lowerings[primitive]

  def lowering(ctx, *args, interpret, **params):
    if interpret:
      strip = lambda a: a.update_manual_axis_type(core.empty_mat)
      ctx = ctx.replace(avals_in=[strip(a) for a in ctx.avals_in],
                        avals_out=[strip(a) for a in ctx.avals_out])
      with config._check_vma(False):  # pylint: disable=protected-access
        return original.rule(ctx, *args, interpret=interpret, **params)
    return original.rule(ctx, *args, interpret=interpret, **params)

  mlir.register_lowering(primitive, lowering, inline=original.inline)
  try:
    yield
  finally:
    lowerings[primitive] = original


class ShardingTest(test_base.BackendTestCase):

  def setUp(self):
    super().setUp()
    if jax.device_count() < DEVICES:
      self.skipTest(f"needs {DEVICES} devices: runs in EightDevicesTest's "
                    "subprocess")

  def _check_sharded(self, mesh_kind, layout, options):
    q, k, v, dout = _inputs()
    bias = options.pop("bias", None)
    flash = self.flash(**options)
    args = (q, k, v) if bias is None else (q, k, v, bias)
    fn = lambda *a: flash(*a)
    expected = _unsharded_xla(dout, args, (bool(options),), **options)

    mesh = _mesh(mesh_kind)
    spec = LAYOUTS[layout]
    with jax.set_mesh(mesh):
      put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
      sharded = [put(x, spec) for x in (q, k, v)]
      if bias is not None:
        sharded.append(put(bias, P()))
      compiled = jax.jit(functools.partial(
          test_util.value_and_all_grads, fn, put(dout, spec))).lower(
              *sharded).compile()
      out, *grads = compiled(*sharded)
    chex.assert_trees_all_close((out, *grads), expected, atol=1e-5,
                                rtol=1e-5)
    self.assertEqual(out.sharding.spec, spec)
    for name, grad in zip("qkv", grads[:3]):
      self.assertEqual(grad.sharding.spec, spec, msg=f"d{name}")
    self.assertEqual(_gathers_of(compiled.as_text(), {
        q.shape, k.shape, (B, T, N), (B, N, T)}), [])

  @parameterized.product(mesh_kind=("explicit", "auto"),
                         layout=("batch", "heads"))
  def test_plain_call(self, mesh_kind, layout):
    self._check_sharded(mesh_kind, layout, {})

  @parameterized.parameters("explicit", "auto")
  def test_every_operand_kind(self, mesh_kind):
    self._check_sharded(mesh_kind, "batch_heads", _options())

  def _skip_where_xla_partitions_itself(self, mesh_kind):
    if mesh_kind == "auto" and not self.runs_kernels:
      self.skipTest(f"{self.implementation} is plain JAX: on an Auto mesh "
                    "XLA's partitioner distributes it as it is, with the "
                    "communication any sharding needs")

  @parameterized.parameters("explicit", "auto")
  def test_paged_cache(self, mesh_kind):
    # The block table's rows shard with the batch; the pages are shared by
    # every batch element, never split along the pages (forward only).
    q, k, v, _ = _inputs()
    page, per_sequence = 16, -(-T // 16)
    # Keys padded to whole pages; the lengths hide the padding. (On the
    # host, as `_inputs`.)
    k, v = (np.pad(x, [(0, 0), (0, page * per_sequence - T), (0, 0),
                       (0, 0)]) for x in (k, v))
    order = np.random.default_rng(0).permutation(B * per_sequence)
    pool = lambda x: x.reshape(B * per_sequence, page, K, H)[order]
    table = jnp.asarray(np.argsort(order).reshape(B, per_sequence),
                        jnp.int32)
    lengths = jnp.array([T, 31, 17, 9])
    expected = _unsharded(functools.partial(
        jflash.flash_attention, implementation="xla",
        key_value_seq_lengths=lengths), (q, k, v), key=("xla", "paged"))
    flash = self.flash_forward(block_table=table,
                               key_value_seq_lengths=lengths)
    mesh = _mesh(mesh_kind)
    with jax.set_mesh(mesh):
      put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
      out = jax.jit(lambda q, k, v: flash(q, k, v))(
          put(q, LAYOUTS["batch_heads"]), put(pool(k), P()),
          put(pool(v), P()))
    chex.assert_trees_all_close(out, expected, atol=1e-5, rtol=1e-5)

  @parameterized.parameters("explicit", "auto")
  def test_sharded_sequence_is_refused(self, mesh_kind):
    self._skip_where_xla_partitions_itself(mesh_kind)
    q, k, v, _ = _inputs()
    mesh = _mesh(mesh_kind)
    with jax.set_mesh(mesh):
      put = lambda x: jax.device_put(x, NamedSharding(
          mesh, P(None, "model", None, None)))
      # Explicit meshes: a ValueError at trace time; Auto meshes: the
      # partitioner's callback raises it at compile time, and JAX reports
      # it as a runtime error carrying the message.
      with self.assertRaisesRegex(Exception, "context parallelism"):
        jax.jit(self.flash()).lower(put(q), put(k), put(v)).compile()

  @parameterized.parameters("explicit", "auto")
  def test_heads_must_hold_whole_groups(self, mesh_kind):
    self._skip_where_xla_partitions_itself(mesh_kind)
    q, k, v, _ = _inputs(num_kv_heads=2)  # 2 kv heads, 4 head shards.
    mesh = _mesh(mesh_kind)
    with jax.set_mesh(mesh):
      put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
      args = (put(q, P(None, None, "model", None)), put(k, P()), put(v, P()))
      with self.assertRaisesRegex(Exception, "num_kv_heads=2"):
        jax.jit(self.flash()).lower(*args).compile()

  @parameterized.parameters(False, True)
  def test_inside_a_user_shard_map(self, check_vma):
    q, k, v, dout = _inputs()
    # The bias is shared by the batch: shards of the batch add up its
    # gradient (shard_map's transpose, or match_vma with check_vma=True).
    bias = _options()["bias"]
    mesh = _mesh("auto")
    flash = self.flash(is_causal=True)
    fn = lambda q, k, v, bias: flash(q, k, v, bias)
    args = (q, k, v, bias)
    expected = _unsharded_xla(dout, args, ("user shard_map",),
                              is_causal=True)
    spec = LAYOUTS["batch_heads"]
    inner = jax.shard_map(
        fn, mesh=mesh, in_specs=(spec, spec, spec, P(None, "model")),
        out_specs=spec, check_vma=check_vma)
    patch = (_interpret_under_check_vma() if check_vma and self.interpret
             else contextlib.nullcontext())
    with jax.set_mesh(mesh), patch:
      result = jax.jit(functools.partial(test_util.value_and_all_grads,
                                         inner, dout))(*args)
    chex.assert_trees_all_close(result, expected, atol=1e-5, rtol=1e-5)

  def test_vmap_of_sharded_inputs(self):
    q, k, v, _ = _inputs()
    stacked = [np.stack([x, 2.0 * x]) for x in (q, k, v)]
    expected = _unsharded(
        jax.vmap(functools.partial(jflash.flash_attention,
                                   implementation="xla")),
        stacked, key=("xla", "vmap"))
    mesh = _mesh("explicit")
    with jax.set_mesh(mesh):
      sharded = [jax.device_put(x, NamedSharding(
          mesh, P(None, "data", None, "model", None))) for x in stacked]
      out = jax.jit(jax.vmap(self.flash()))(*sharded)
    chex.assert_trees_all_close(out, expected, atol=1e-5, rtol=1e-5)


class OneDeviceMeshTest(test_base.BackendTestCase):
  """Meshes of one device: in the suite's own process, so also compiled on
  a GPU (JFLASH_TEST_ON_GPU=1). About kernels: pallas_call cannot index refs
  typed "sharded", and Pallas needs the outputs' manual axes under
  check_vma; the plain-JAX xla backend meets neither (its sharding runs in
  EightDevicesTest's cases)."""

  def setUp(self):
    super().setUp()
    self.require_kernels("the one-device cases are about pallas_call under "
                         "a mesh; the 8-device cases cover the xla backend")

  @parameterized.parameters("explicit", "auto")
  def test_one_device_mesh_runs_the_same_kernels(self, mesh_kind):
    q, k, v, dout = _inputs()
    types = (AxisType.Explicit if mesh_kind == "explicit"
             else AxisType.Auto,)
    mesh = jax.make_mesh((1,), ("data",), axis_types=types,
                         devices=jax.devices()[:1])
    fn = lambda *a: test_util.value_and_grads(self.flash(), *a, dout)
    plain = jax.make_jaxpr(fn)(q, k, v)
    with jax.set_mesh(mesh):
      sharded = [jax.device_put(x, NamedSharding(mesh, P("data")))
                 for x in (q, k, v)]
      expected_placement = (
          sharding.EXPLICIT if mesh_kind == "explicit"
          else sharding.SINGLE if jax.device_count() == 1
          else sharding.PARTITIONED)
      self.assertEqual(sharding.placement(sharded[0]), expected_placement)
      on_mesh = jax.make_jaxpr(fn)(*sharded)
      results = jax.jit(fn)(*sharded)
    self.assertEqual(test_util.kernel_jaxprs(on_mesh),
                     test_util.kernel_jaxprs(plain))
    # The call off the mesh, computed once for both mesh kinds.
    expected = _unsharded(fn, (q, k, v),
                          key=(self.implementation, "one device, plain"))
    chex.assert_trees_all_close(results, expected, atol=1e-6, rtol=1e-6)

  @parameterized.parameters(False, True)
  def test_inside_a_user_shard_map_of_one_device(self, check_vma):
    q, k, v, dout = _inputs()
    bias = _options()["bias"]
    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:1])
    fn = lambda q, k, v, bias: self.flash(is_causal=True)(q, k, v, bias)
    args = (q, k, v, bias)
    # Off the mesh, computed once for both check_vma cases.
    expected = _unsharded(
        functools.partial(test_util.value_and_all_grads, fn, dout), args,
        key=(self.implementation, "one device, user shard_map"))
    spec = P("data")
    inner = jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec, P()),
                          out_specs=spec, check_vma=check_vma)
    patch = (_interpret_under_check_vma() if check_vma and self.interpret
             else contextlib.nullcontext())
    with jax.set_mesh(mesh), patch:
      put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
      sharded = [put(q, spec), put(k, spec), put(v, spec), put(bias, P())]
      result = jax.jit(functools.partial(
          test_util.value_and_all_grads, inner, put(dout, spec)))(*sharded)
    chex.assert_trees_all_close(result, expected, atol=1e-5, rtol=1e-5)


test_base.for_each_backend(globals(), ShardingTest)
test_base.for_each_backend(globals(), OneDeviceMeshTest)


class EightDevicesTest(absltest.TestCase):
  """Runs this file's cases in a subprocess with 8 CPU devices."""

  @absltest.skipIf(jax.device_count() >= DEVICES,
                   "this process has the devices: the cases run here")
  def test_cases_pass_on_eight_cpu_devices(self):
    test_util.run_file_on_cpu_devices(self, __file__, DEVICES,
                                      "ShardingTest")


if __name__ == "__main__":
  absltest.main()
