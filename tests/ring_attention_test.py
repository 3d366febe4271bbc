"""Context parallelism (ring.py, ring_loop.py) against flash_attention.

The multi-device cases (`RingAttentionTest`) need 8 devices, which must be
set before JAX starts: as in sharding_test.py, the CPU suite's processes
have them (conftest.py); a process with fewer skips the cases and
`EightDevicesTest` runs them in a subprocess with
JFLASH_TEST_CPU_DEVICES=8, failing with its output if any fails. Meshes of 2, 4 and 8 devices
come from those 8. Most cases run the XLA path (cheap to compile); one per
layout runs the Triton kernels through the Pallas interpreter. Every case
compares the output and all gradients with single-device
`flash_attention(implementation="xla")` on the unsharded arrays.

Load balancing, bad input and the one-GPU check need no devices and run in
the suite's own process (the one-GPU check only with JFLASH_TEST_ON_GPU=1).
"""

import contextlib
import dataclasses
import functools
import importlib.util
import io
import math
import os
from unittest import mock

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
from jflash._src import api
from jflash._src import registry
from jflash._src import ring
from jflash._src import ring_loop
from jflash._src.spec import Operands
from tests import test_util
from tests import tolerances

DEVICES = 8
AXIS = "context"
B, T, N, K, H = 2, 64, 4, 2, 16  # GQA: 2 query heads per kv head.
SINKS = np.array([0.5, -1.0, 0.0, 2.0], np.float32)
TOLERANCE = tolerances.direct("float32")


def _inputs(seed=0, seq=T):
  """q, k, v, dout as NumPy arrays: the tests permute them (load_balance)
  and place them on meshes on the host, where JAX arrays would compile a
  small program per shape and mesh for each (~0.05 s of CPU)."""
  return tuple(map(np.asarray, test_util.random_inputs(
      seed, batch=B, q_len=seq, kv_len=seq, num_heads=N, num_kv_heads=K,
      head_dim=H)))


def _segment_ids(seq=T):
  """(q ids, kv ids): packed sequences of different lengths per batch
  element, crossing shard boundaries. In batch element 1 the keys of
  segment 2 are relabeled, so its queries see no key on any device: their
  rows must come out 0 (with sinks too), never NaN, as flash_attention's.
  NumPy arrays, as `_inputs`."""
  q_ids = np.stack([np.arange(seq) // 23, np.arange(seq) // 11])
  kv_ids = q_ids.copy()
  kv_ids[1][kv_ids[1] == 2] = 99
  return q_ids.astype(np.int32), kv_ids.astype(np.int32)


def _mesh(devices, axis_type=AxisType.Auto):
  return jax.make_mesh((devices,), (AXIS,), axis_types=(axis_type,),
                       devices=jax.devices()[:devices])


@functools.cache
def _reference(seed, seq, is_causal, segments, sinks):
  """Single-device flash_attention (XLA path): (out, d arg for each arg)."""
  q, k, v, dout = _inputs(seed, seq)
  q_ids, kv_ids = _segment_ids(seq) if segments else (None, None)
  fn = lambda q, k, v, *s: jflash.flash_attention(
      q, k, v, is_causal=is_causal, implementation="xla",
      q_segment_ids=q_ids, kv_segment_ids=kv_ids, sinks=s[0] if s else None)
  args = (q, k, v) + ((SINKS,) if sinks else ())
  return jax.jit(functools.partial(test_util.value_and_all_grads, fn,
                                   dout))(*args)


class RingAttentionTest(parameterized.TestCase):
  """Cases on 2, 4 and 8 of 8 CPU devices (EightDevicesTest's subprocess)."""

  def setUp(self):
    super().setUp()
    if jax.device_count() < DEVICES:
      self.skipTest(f"needs {DEVICES} devices: runs in EightDevicesTest's "
                    "subprocess")

  def _check(self, devices, *, strategy="ring", layout="contiguous",
             is_causal=True, segments=False, sinks=False, seq=T,
             compiler_options=None, **options):
    """Ring attention of the inputs (permuted for the balanced layout)
    against flash_attention: output and every gradient (jitted with XLA
    `compiler_options`, if given)."""
    q, k, v, dout = _inputs(0, seq)
    q_ids, kv_ids = _segment_ids(seq) if segments else (None, None)
    # On the host (NumPy), as `_inputs`: LoadBalanceTest covers the
    # permutations of JAX arrays.
    if layout == "balanced":
      into = lambda x: jflash.load_balance(np.asarray(x), devices)
      back = lambda x: jflash.load_unbalance(np.asarray(x), devices)
    else:
      into = back = np.asarray
    mesh = _mesh(devices)
    if segments:
      q_ids, kv_ids = into(q_ids), into(kv_ids)
    fn = lambda q, k, v, *s: jflash.ring_attention(
        q, k, v, mesh=mesh, axis_name=AXIS, is_causal=is_causal,
        layout=layout, strategy=strategy, q_segment_ids=q_ids,
        kv_segment_ids=kv_ids, sinks=s[0] if s else None,
        **({"implementation": "xla"} | options))
    args = tuple(map(into, (q, k, v))) + ((SINKS,) if sinks else ())
    with jax.set_mesh(mesh):
      out, *grads = jax.jit(functools.partial(
          test_util.value_and_all_grads, fn, into(dout)),
                            compiler_options=compiler_options)(*args)
    # Sequence-shaped results back to positions in order; dsinks is [N].
    results = (back(out), *map(back, grads[:3]), *grads[3:])
    expected = _reference(0, seq, is_causal, segments, sinks)
    chex.assert_tree_all_finite(results)
    chex.assert_trees_all_close(results, expected,
                                atol=TOLERANCE, rtol=TOLERANCE)

  @parameterized.named_parameters(
      ("2_devices_causal_segments", 2, "contiguous", True, True, False),
      ("2_devices_balanced_sinks", 2, "balanced", True, False, True),
      ("4_devices_balanced_segments_sinks", 4, "balanced", True, True, True),
      ("4_devices_not_causal_segments", 4, "contiguous", False, True, False),
      ("8_devices_causal_sinks", 8, "contiguous", True, False, True),
      ("8_devices_balanced_segments", 8, "balanced", True, True, False),
  )
  def test_ring(self, devices, layout, is_causal, segments, sinks):
    self._check(devices, layout=layout, is_causal=is_causal,
                segments=segments, sinks=sinks)

  @parameterized.named_parameters(
      ("2_devices_balanced_segments", 2, "balanced", True, True, False),
      ("4_devices_not_causal_sinks", 4, "contiguous", False, False, True),
      ("8_devices_causal_segments_sinks", 8, "contiguous", True, True, True),
  )
  def test_all_gather(self, devices, layout, is_causal, segments, sinks):
    self._check(devices, strategy="all_gather", layout=layout,
                is_causal=is_causal, segments=segments, sinks=sinks)

  def test_compiled_with_ring_compiler_options(self):
    # The scheduler options the GPU wants (RECORD 2026-11-26, 4 H100s)
    # change only the schedule: the same results.
    self._check(4, layout="balanced", segments=True,
                compiler_options=jflash.ring_compiler_options())

  @parameterized.named_parameters(("contiguous", "contiguous"),
                                  ("balanced", "balanced"))
  def test_triton_kernels_interpreted(self, layout):
    # The Triton kernels in the interpreter, small tiles so that the
    # 64-token shards cross several tiles (and skip other segments').
    self._check(2, layout=layout, segments=True, seq=128,
                implementation="triton", interpret=True,
                block_sizes=test_util.SMALL_BLOCKS)

  def test_batch_and_heads_sharded_on_an_explicit_mesh(self):
    q, k, v, dout = _inputs()
    mesh = jax.make_mesh((2, 2, 2), ("data", "heads", AXIS),
                         axis_types=(AxisType.Explicit,) * 3)
    spec = P("data", AXIS, "heads")
    fn = lambda q, k, v, s: jflash.ring_attention(
        q, k, v, mesh=mesh, axis_name=AXIS, is_causal=True,
        implementation="xla", sinks=s)
    with jax.set_mesh(mesh):
      put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
      out, *grads = jax.jit(functools.partial(
          test_util.value_and_all_grads, fn, put(dout)))(
              put(q), put(k), put(v), SINKS)
    self.assertEqual(out.sharding.spec, P("data", AXIS, "heads", None))
    for grad in grads[:3]:
      self.assertEqual(grad.sharding.spec, P("data", AXIS, "heads", None))
    chex.assert_trees_all_close((out, *grads),
                                _reference(0, T, True, False, True),
                                atol=TOLERANCE, rtol=TOLERANCE)

  @parameterized.named_parameters(("ring", "ring"),
                                  ("all_gather", "all_gather"))
  def test_local_inside_a_user_shard_map_with_check_vma(self, strategy):
    q, k, v, dout = _inputs()
    mesh = jax.make_mesh((2, 4), ("data", AXIS),
                         axis_types=(AxisType.Auto,) * 2)
    into = lambda x: jflash.load_balance(x, 4)
    local = lambda q, k, v, s: jflash.ring_attention_local(
        q, k, v, axis_name=AXIS, is_causal=True, layout="balanced",
        strategy=strategy, sinks=s, implementation="xla")
    rows = P("data", AXIS)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, P()),
                       out_specs=rows, check_vma=True)
    with jax.set_mesh(mesh):
      out, *grads = jax.jit(functools.partial(
          test_util.value_and_all_grads, fn, into(dout)))(
              into(q), into(k), into(v), SINKS)
    back = lambda x: jflash.load_unbalance(np.asarray(x), 4)
    results = (back(out), *map(back, grads[:3]), grads[3])
    chex.assert_trees_all_close(results, _reference(0, T, True, False, True),
                                atol=TOLERANCE, rtol=TOLERANCE)

  def _compiled(self, fn, devices, seq, dtype=jnp.float32, heads=(N, K, H)):
    """fwd+bwd of fn (a loss gradient) compiled on sequence-sharded
    abstract inputs."""
    return _compiled(fn, devices, seq, dtype, heads)

  def test_ring_hlo_permutes_and_never_gathers(self):
    # The ring's program is test_backward_memory_is_per_shard's on 8
    # devices of 32 rows (one compilation of an 8-device program for both).
    hlo = self._compiled(_ring_xla, 8, 256, heads=(1, 1, 128)).as_text()
    self.assertIn("collective-permute", hlo)
    self.assertNotIn("all-gather", hlo)
    # The blocks above the diagonal are skipped by a conditional.
    self.assertIn("conditional", hlo)
    gather_fn = lambda mesh: functools.partial(_ring_xla(mesh),
                                               strategy="all_gather")
    self.assertIn("all-gather", self._compiled(gather_fn, 8, 256).as_text())

  def test_backward_memory_is_per_shard(self):
    # One head of dim 128, so that the XLA path's [C, C] block logits are
    # small next to the [C, H] shards (the kernels never form them).
    heads = (1, 1, 128)
    temp = lambda fn, devices, seq: self._compiled(
        fn, devices, seq, heads=heads).memory_analysis().temp_size_in_bytes
    shard = 64
    ring_8 = temp(_ring_xla, 8, 8 * shard)
    # The same shard length on 4 and 8 devices: the same memory (the ring
    # holds two shards at a time, whatever the ring's length).
    self.assertLessEqual(ring_8, 1.1 * temp(_ring_xla, 4, 4 * shard))
    # Twice the sequence on 8 devices: linear, up to the small logits.
    self.assertLessEqual(ring_8, 2.5 * temp(_ring_xla, 8, 4 * shard))
    # Autodiff of the very forward loop stores every rotated shard and
    # partial output (measured 4.8x at this size).
    autodiff = temp(_autodiff_of_the_forward_loop, 8, 8 * shard)
    self.assertGreater(autodiff, 3 * ring_8)

  def test_benchmark_script_runs(self):
    # benchmarks/ring.py --tiny on 2 of the devices, one small length.
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                        "benchmarks", "ring.py")
    spec = importlib.util.spec_from_file_location("benchmarks_ring", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    with contextlib.redirect_stdout(io.StringIO()) as output:
      rows = benchmark.main(["--tiny", "--devices", "2", "--lengths", "128",
                             "--layouts", "balanced"])
    self.assertLen(rows, 3, msg=output.getvalue())  # Baseline, 2 strategies.
    for row in rows:
      self.assertIsNone(row["error"], msg=output.getvalue())
      self.assertGreater(row["tflops_per_device"], 0.0)
    self.assertIn("vs 1 GPU", output.getvalue())


def _ring_xla(mesh):
  """ring_attention's XLA path, causal, on `mesh`."""
  return functools.partial(jflash.ring_attention, mesh=mesh, axis_name=AXIS,
                           is_causal=True, implementation="xla")


@functools.cache
def _compiled(fn, devices, seq, dtype, heads):
  """fwd+bwd of fn(mesh) (a loss gradient) compiled on sequence-sharded
  abstract inputs; once per arguments (a program traced again in one
  process compiles again: the persistent cache misses it)."""
  num_heads, num_kv_heads, head_dim = heads
  mesh = _mesh(devices)
  sharding = NamedSharding(mesh, P(None, AXIS))
  args = [jax.ShapeDtypeStruct((1, seq, n, head_dim), dtype,
                               sharding=sharding)
          for n in (num_heads, num_kv_heads, num_kv_heads)]
  grad = jax.grad(lambda q, k, v: jnp.sum(fn(mesh)(q, k, v)),
                  argnums=(0, 1, 2))
  return jax.jit(grad).lower(*args).compile()


def _differentiable_partial(block, q, k, v, q_ids, kv_ids):
  """A block's (out, base-2 lse) through the XLA path, differentiable."""
  spec = dataclasses.replace(block.spec, return_lse=True)
  out, lse = registry.get("xla").direct(spec, None, Operands(
      q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids))
  return out.astype(jnp.float32), jnp.swapaxes(lse, 1, 2) * math.log2(math.e)


def _autodiff_of_the_forward_loop(mesh):
  """Ring attention whose backward is JAX's autodiff of forward_loop."""

  def local(q, k, v):
    call = api.describe(q, k, v, is_causal=True)
    # pylint: disable-next=protected-access
    loop = ring._make_ring(call, axis_name=AXIS,
                           num_devices=mesh.shape[AXIS], balanced=False,
                           implementation="xla")
    out, _ = ring_loop.forward_loop(loop, q, k, v, None, None,
                                    block_partial=_differentiable_partial)
    return out.astype(q.dtype)

  rows = P(None, AXIS)
  return jax.shard_map(local, mesh=mesh, in_specs=(rows,) * 3,
                       out_specs=rows, check_vma=False)


class LoadBalanceTest(parameterized.TestCase):

  def test_order_of_the_chunks(self):
    # 2 shards, 8 positions in 4 chunks of 2: device 0 holds chunks 0 and
    # 3, device 1 chunks 1 and 2.
    x = np.arange(8)[None]
    np.testing.assert_array_equal(jflash.load_balance(x, 2),
                                  [[0, 1, 6, 7, 2, 3, 4, 5]])

  @parameterized.parameters(1, 2, 4, 8)
  def test_round_trip(self, num_shards):
    x = np.random.default_rng(num_shards).normal(size=(3, 5, 32, 2))
    balanced = jflash.load_balance(x, num_shards, axis=2)
    self.assertIsInstance(balanced, np.ndarray)
    np.testing.assert_array_equal(
        jflash.load_unbalance(balanced, num_shards, axis=2), x)
    on_device = jflash.load_balance(jnp.asarray(x, jnp.float32), num_shards,
                                    axis=-2)
    np.testing.assert_array_equal(on_device, balanced.astype(np.float32))
    np.testing.assert_array_equal(
        jax.jit(jflash.load_unbalance, static_argnums=(1, 2))(
            on_device, num_shards, 2), x.astype(np.float32))

  def test_bad_input(self):
    x = np.zeros((2, 12))
    with self.assertRaisesRegex(ValueError, r"\(12, shape \(2, 12\)\).*8"):
      jflash.load_balance(x, 4)
    with self.assertRaisesRegex(ValueError, "num_shards"):
      jflash.load_unbalance(x, 0)
    with self.assertRaisesRegex(ValueError, "axis=2"):
      jflash.load_balance(x, 1, axis=2)


class RingCompilerOptionsTest(parameterized.TestCase):

  def test_xla_knows_the_options(self):
    # XLA rejects an unknown option ("No such compile option"): a JAX
    # version that renames one fails here, not in a user's compile.
    options = jflash.ring_compiler_options(2)
    self.assertEqual(
        options["xla_gpu_experimental_parallel_collective_overlap_limit"], 2)
    self.assertTrue(options["xla_gpu_enable_latency_hiding_scheduler"])
    x = jnp.arange(8.0)
    compiled = jax.jit(jnp.sin, compiler_options=options).lower(x).compile()
    np.testing.assert_array_equal(compiled(x), jnp.sin(x))
    with self.assertRaisesRegex(Exception, "No such compile option"):
      jax.jit(jnp.sin, compiler_options={"xla_gpu_not_an_option": 1}).lower(
          x).compile()
    # A new dict each time: a caller's edit does not leak into the next.
    options["xla_gpu_enable_latency_hiding_scheduler"] = False
    self.assertTrue(jflash.ring_compiler_options()[
        "xla_gpu_enable_latency_hiding_scheduler"])

  @parameterized.parameters(0, -1, 2.0, True, "4")
  def test_bad_count(self, count):
    with self.assertRaisesRegex(ValueError, "collectives_in_flight"):
      jflash.ring_compiler_options(count)


class BadInputTest(parameterized.TestCase):
  """Refused before anything runs; an abstract mesh stands in for 4
  devices."""

  def _call(self, q_len=64, kv_len=64, **kwargs):
    q = jnp.zeros((B, q_len, N, H))
    kv = jnp.zeros((B, kv_len, K, H))
    kwargs = {"mesh": jax.sharding.AbstractMesh((4,), (AXIS,)),
              "axis_name": AXIS, **kwargs}
    return jflash.ring_attention(q, kv, kv, **kwargs)

  def test_lengths_must_match(self):
    with self.assertRaisesRegex(
        ValueError, r"T == S.*query.shape=\(2, 64, 4, 16\), "
        r"key.shape=\(2, 32, 2, 16\)"):
      self._call(kv_len=32)

  def test_sequence_must_divide(self):
    with self.assertRaisesRegex(ValueError, r"T=66.*4 shards"):
      self._call(q_len=66, kv_len=66)
    with self.assertRaisesRegex(ValueError, r"T=68.*2 x 4 = 8 chunks"):
      self._call(q_len=68, kv_len=68, is_causal=True, layout="balanced")

  def test_unknown_names(self):
    with self.assertRaisesRegex(ValueError, r"axis_name='seq'.*'context'"):
      self._call(axis_name="seq")
    with self.assertRaisesRegex(ValueError, "layout.*'striped'"):
      self._call(layout="striped")
    with self.assertRaisesRegex(ValueError, "strategy.*'ulysses'"):
      self._call(strategy="ulysses")
    with self.assertRaisesRegex(ValueError, "mesh must be"):
      self._call(mesh=jax.devices())
    with self.assertRaisesRegex(ValueError, r"dropout_rate.*\[0, 1\).*-0.1"):
      self._call(dropout_rate=-0.1)

  def test_what_flash_attention_refuses(self):
    with self.assertRaisesRegex(ValueError, "q_segment_ids must have shape"):
      self._call(q_segment_ids=jnp.zeros((B, 32), jnp.int32),
                 kv_segment_ids=jnp.zeros((B, 64), jnp.int32))
    # Unbatched inputs: the message names the shapes as given.
    q = jnp.zeros((64, N, H))
    ids = jnp.zeros((1, 64), jnp.int32)
    with self.assertRaisesRegex(
        ValueError, r"q_segment_ids.shape=\(1, 64\) \(query.shape=\(64, 4, "
        r"16\)"):
      jflash.ring_attention(
          q, q, q, mesh=jax.sharding.AbstractMesh((4,), (AXIS,)),
          axis_name=AXIS, q_segment_ids=ids, kv_segment_ids=ids)

  @parameterized.parameters(
      ("local_window_size", (8, 0)), ("alibi_slopes", np.ones(N)),
      ("dropout_rate", 0.1), ("bias", np.zeros((1, 1, 64, 64))),
      ("mask", np.ones((1, 1, 64, 64), bool)),
      ("query_seq_lengths", np.array([64, 64])))
  def test_unsupported_options_name_themselves(self, option, value):
    with self.assertRaisesRegex(NotImplementedError, option):
      self._call(**{option: value})
    q = jnp.zeros((B, 16, N, H))
    with self.assertRaisesRegex(NotImplementedError, option):
      jflash.ring_attention_local(q, q, q, axis_name=AXIS, **{option: value})

  def test_local_outside_shard_map(self):
    q = jnp.zeros((B, 16, N, H))
    with self.assertRaisesRegex(ValueError, "axis_name='context'.*shard_map"):
      jflash.ring_attention_local(q, q, q, axis_name=AXIS)

  def test_cudnn_has_no_separate_passes(self):
    q = jnp.zeros((B, 16, N, H))
    # cudnn needs a CUDA GPU: mocked here, so the reason is the passes.
    self.enter_context(mock.patch.object(registry, "current_platform",
                                         return_value="cuda"))
    with self.assertRaisesRegex(NotImplementedError, "separate forward"):
      jflash.ring_attention(q, q, q, mesh=_mesh(1), axis_name=AXIS,
                            implementation="cudnn")


class OneGpuTest(absltest.TestCase):
  """ring_attention on a one-device mesh is flash_attention, compiled."""

  @absltest.skipIf(not test_util.ON_GPU,
                   "compiled kernels: runs with JFLASH_TEST_ON_GPU=1")
  def test_one_device_mesh_equals_flash_attention(self):
    q, k, v, dout = test_util.random_inputs(
        3, batch=2, q_len=512, kv_len=512, num_heads=8, num_kv_heads=2,
        head_dim=64, dtype="bfloat16")
    mesh = jax.make_mesh((1,), (AXIS,), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:1])
    for is_causal in (False, True):
      flash = lambda q, k, v: jflash.flash_attention(q, k, v,
                                                     is_causal=is_causal)
      ring_fn = lambda q, k, v: jflash.ring_attention(
          q, k, v, mesh=mesh, axis_name=AXIS, is_causal=is_causal)
      expected = jax.jit(test_util.value_and_grads, static_argnums=0)(
          flash, q, k, v, dout)
      with jax.set_mesh(mesh):
        put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, AXIS)))
        got = jax.jit(functools.partial(
            test_util.value_and_all_grads, ring_fn, put(dout)))(
                put(q), put(k), put(v))
      tolerance = tolerances.direct(q.dtype)
      chex.assert_trees_all_close(got, expected, atol=tolerance,
                                  rtol=tolerance)


class EightDevicesTest(absltest.TestCase):
  """Runs this file's multi-device cases in a subprocess with 8 CPU
  devices."""

  @absltest.skipIf(jax.device_count() >= DEVICES,
                   "this process has the devices: the cases run here")
  def test_ring_cases_pass_on_eight_cpu_devices(self):
    test_util.run_file_on_cpu_devices(self, __file__, DEVICES,
                                      "RingAttentionTest")


if __name__ == "__main__":
  absltest.main()
