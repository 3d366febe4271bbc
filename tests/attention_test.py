"""Forward and gradients of every backend against jax.nn.dot_product_attention.

Runs per backend (tests/test_base.py): the Pallas kernels through the
interpreter on CPU and compiled on a GPU (JFLASH_TEST_ON_GPU=1), and the
XLA path.
"""

import dataclasses
import functools
import os
import subprocess
import sys
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import jflash
from jflash._src import api
from jflash._src.backends.mosaic import config as mosaic_config
from jflash._src.backends.mosaic import forward as mosaic_forward
from jflash._src.spec import Operands
from tests import test_base
from tests import test_util
from tests import tolerances


# Jitted: run eagerly, the XLA path compiles each of its operations apart
# (transforms_test checks eager against jit).
_step = test_util.STEP


class AttentionTest(test_base.BackendTestCase):

  def _check(self, seed, *, is_causal=False, scale=None, tiles=None,
             **shape):
    q, k, v, dout = test_util.random_inputs(seed, **shape)
    kwargs = dict(is_causal=is_causal)
    if scale is not None:
      kwargs.update(scale=scale)
    fn = self.flash(**kwargs, **(tiles or {}))
    results = _step(fn, q, k, v, dout)
    test_util.assert_close_to_jax_nn(self, results, q, k, v, dout, **kwargs)
    return results

  # On CPU each dtype once and each causality at least once: the mask code
  # does not depend on the dtype (the interpreter runs the same lines), the
  # other tests run causal and non-causal float32 and bfloat16 again.
  # Every case also takes a scale other than the default 1/sqrt(head_dim)
  # (that of every other test), checked against jax.nn's: the scale is
  # static, and a test of its own (float32, causal) compiled one more
  # program on CPU.
  @parameterized.parameters(*test_util.sweep(
      [dict(dtype=dtype, is_causal=is_causal)
       for dtype in ("float32", "bfloat16", "float16")
       for is_causal in (False, True)],
      cpu_cases=[dict(dtype="float32", is_causal=True),
                 dict(dtype="bfloat16", is_causal=False),
                 dict(dtype="float16", is_causal=True)]))
  def test_dtypes_and_scale(self, dtype, is_causal):
    self._check(0, dtype=dtype, is_causal=is_causal, q_len=80, kv_len=80,
                scale=0.37)

  # On CPU (16/32-row tiles, SMALL_BLOCKS): one partial tile on both axes
  # (len1); several tiles with partial last tiles, q shorter than kv
  # (q_shorter: 17 = 16 + 1 query rows, 100 = 3 * 32 + 4 keys) and q longer
  # than kv (q_longer). len17, len100, len257 and q1_kv257 cross the same
  # tile edges in the same interpreted lines; compiled on a GPU each length
  # is its own code, so they run there.
  @parameterized.named_parameters(*test_util.sweep(
      [("len1", 1, 1), ("len17", 17, 17), ("len100", 100, 100),
       ("len257", 257, 257), ("q_shorter", 17, 100), ("q_longer", 100, 33),
       ("q1_kv257", 1, 257)],
      cpu_cases=[("len1", 1, 1), ("q_shorter", 17, 100),
                 ("q_longer", 100, 33)]))
  def test_sequence_lengths(self, q_len, kv_len):
    causalities = (False, True)
    if q_len == kv_len == 1:
      # One query and one key: the key is visible either way. On CPU
      # causal only (the other cases run the non-causal partial tiles).
      causalities = test_util.sweep(causalities, (True,))
    for is_causal in causalities:
      with self.subTest(is_causal=is_causal):
        self._check(q_len + kv_len, q_len=q_len, kv_len=kv_len, batch=1,
                    is_causal=is_causal, dtype="bfloat16")

  # On CPU one head dim padded to the next power of two (80 -> 128: the
  # padding columns masked on every load and store). An unpadded width
  # (128 here) runs the same interpreted lines as the unpadded head dim 32
  # of every other test of this file (bfloat16 and causal in
  # test_sequence_lengths, over several partial tiles), so it is left to
  # the GPU with the other widths: one compiled program fewer on CPU.
  @parameterized.parameters(*test_util.sweep(
      [(d,) for d in (32, 64, 80, 96, 128, 192, 256)], cpu_cases=[(80,)]))
  def test_head_dims(self, head_dim):
    self._check(head_dim, head_dim=head_dim, q_len=48, kv_len=40, batch=1,
                is_causal=True, dtype="bfloat16")

  # Both have groups of 4 query heads per kv head: on CPU one of each
  # causality runs the same lines as the other two.
  @parameterized.named_parameters(*test_util.sweep(
      [("gqa_8_2", 8, 2, False), ("gqa_8_2_causal", 8, 2, True),
       ("mqa_4_1", 4, 1, False), ("mqa_4_1_causal", 4, 1, True)],
      cpu_cases=[("gqa_8_2", 8, 2, False),
                 ("mqa_4_1_causal", 4, 1, True)]))
  def test_grouped_query_attention(self, num_heads, num_kv_heads, is_causal):
    self._check(num_heads, num_heads=num_heads, num_kv_heads=num_kv_heads,
                q_len=40, kv_len=72, batch=1, is_causal=is_causal,
                dtype="float32")

  @parameterized.named_parameters(
      ("padding", False), ("padding_causal", True))
  def test_sequence_length_masks(self, is_causal):
    # Batches 0-2: lengths inside the arrays, on tile edges, and the full
    # length. Batch 3: every key masked (kv length 0), and its query rows
    # from 5 on masked (query length 5): rows without a visible key. (The
    # keyless batch was a test of its own, one more compiled program on
    # CPU; it needs no shape of its own.)
    lengths = ([70, 16, 33, 5], [16, 70, 1, 0])
    q, k, v, dout = test_util.random_inputs(7, batch=4, q_len=70, kv_len=70,
                                            num_heads=2, num_kv_heads=1)
    fn = self.flash(is_causal=is_causal,
                    query_seq_lengths=jnp.asarray(lengths[0], jnp.int32),
                    key_value_seq_lengths=jnp.asarray(lengths[1], jnp.int32))
    out, dq, dk, dv = _step(fn, q, k, v, dout)
    chex.assert_tree_all_finite((out, dq, dk, dv))
    # Batches 0-2 against jax.nn (a batch without keys is not attention:
    # jax.nn gives its rows no defined value), unaffected by batch 3.
    visible = slice(0, 3)
    test_util.assert_close_to_jax_nn(
        self, (out[visible], dq[visible], dk[visible], dv[visible]),
        q[visible], k[visible], v[visible], dout[visible],
        is_causal=is_causal,
        query_seq_lengths=jnp.asarray(lengths[0][visible], jnp.int32),
        key_value_seq_lengths=jnp.asarray(lengths[1][visible], jnp.int32))
    # Query rows past the length: exactly 0, with 0 gradient; the rows
    # before it are not.
    for b, q_len in enumerate(lengths[0]):
      np.testing.assert_array_equal(np.asarray(out[b, q_len:]), 0.0)
      np.testing.assert_array_equal(np.asarray(dq[b, q_len:]), 0.0)
    self.assertGreater(float(jnp.min(jnp.abs(out[1, :16]).max(-1))), 0.0)
    # Batch 3 sees no key: its output and all its gradients are exactly 0.
    for name, x in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv)):
      np.testing.assert_array_equal(np.asarray(x[3]), 0.0, err_msg=name)

  def test_default_block_sizes(self):
    # The backend's own default tiles, not the suite's small ones.
    self._check(3, q_len=130, kv_len=200, is_causal=True,
                tiles=dict(block_sizes=None), dtype="bfloat16")

  def test_unbatched_inputs(self):
    # The inputs and call of test_grouped_query_attention's mqa_4_1_causal:
    # equal functions (test_base.BoundFlash), the batched call reuses its
    # compiled program.
    q, k, v, dout = test_util.random_inputs(4, num_heads=4, num_kv_heads=1,
                                            q_len=40, kv_len=72, batch=1,
                                            dtype="float32")
    fn = self.flash(is_causal=True)
    batched = _step(fn, q, k, v, dout)
    unbatched = _step(fn, q[0], k[0], v[0], dout[0])
    chex.assert_trees_all_close(unbatched, tuple(x[0] for x in batched),
                                rtol=1e-6, atol=1e-6)

  def test_deterministic(self):
    # The call of test_unbatched_inputs (grouped query heads, whose dK/dV
    # sum over the group): one compiled program for both tests.
    q, k, v, dout = test_util.random_inputs(4, num_heads=4, num_kv_heads=1,
                                            q_len=40, kv_len=72, batch=1,
                                            dtype="float32")
    flash = self.flash(is_causal=True)
    chex.assert_trees_all_equal(_step(flash, q, k, v, dout),
                                _step(flash, q, k, v, dout))


test_base.for_each_backend(globals(), AttentionTest)


class MosaicPersistentAtSizeTest(parameterized.TestCase):
  """The persistent Mosaic forward with several blocks per program: more
  work items than an H100/H200 has SMs (the suite's other shapes give each
  program one block), at the default tiles, with the Q prefetch
  (`forward.Q_PREFETCH`) off and on: the same bits (it moves a load, not
  the arithmetic), and the XLA path's result. Hopper only."""

  def setUp(self):
    super().setUp()
    test_util.skip_unless_mosaic_gpu(self)

  @parameterized.parameters((128, False), (128, True), (64, False))
  def test_q_prefetch_changes_no_bit(self, head_dim, is_causal):
    # 2 x 8 heads x 32 query tiles of 128 rows: 512 items (256 causal
    # pairs), 2-4 blocks per program.
    q, k, v, _ = test_util.random_inputs(
        head_dim, batch=2, q_len=4096, kv_len=4096, num_heads=8,
        head_dim=head_dim, dtype="bfloat16")
    spec = api.describe(q, k, v, is_causal=is_causal).spec
    sizes = mosaic_config.default_block_sizes(head_dim, 2)
    self.assertTrue(mosaic_forward.is_persistent(spec.mask))
    self.assertTrue(sizes.fits_output_tiles(head_dim, 2))
    outputs = []
    for prefetch in (False, True):
      with mock.patch.object(mosaic_forward, "Q_PREFETCH", prefetch):
        forward = jax.jit(functools.partial(
            mosaic_forward.forward_call, spec=spec, block_sizes=sizes))
        outputs.append(jax.block_until_ready(forward(Operands(q, k, v))))
    chex.assert_trees_all_equal(outputs[0], outputs[1])
    expected = jax.jit(functools.partial(
        jflash.flash_attention, is_causal=is_causal,
        implementation="xla"))(q, k, v)
    tolerance = tolerances.direct(jnp.bfloat16)
    chex.assert_trees_all_close(outputs[1][0], expected, atol=tolerance,
                                rtol=tolerance)


class MosaicHeadDim256BackwardTest(parameterized.TestCase):
  """The Mosaic backward at head dim 256, whose two compute warpgroups
  share each row tile (`config.backward_splits_products`: one hands the
  probabilities to the other; the column split as the option), over
  several tiles with each mask the kernels take, against the XLA path, and
  bitwise the same on a second run. Hopper only."""

  def setUp(self):
    super().setUp()
    test_util.skip_unless_mosaic_gpu(self)

  @parameterized.product(
      case=("causal_gqa", "lengths_soft_cap", "segments_sinks",
            "bottom_right_window_lengths"),
      split=("products", "columns"))
  def test_gradients(self, case, split):
    batch, q_len, kv_len = 2, 300, 430
    q, k, v, dout = test_util.random_inputs(
        len(case), batch=batch, q_len=q_len, kv_len=kv_len, num_heads=4,
        num_kv_heads=2, head_dim=256, dtype="bfloat16")
    lengths = dict(query_seq_lengths=jnp.array([300, 129], jnp.int32),
                   key_value_seq_lengths=jnp.array([77, 430], jnp.int32))
    ids = lambda n, edge: jnp.stack(
        [(jnp.arange(n) >= edge).astype(jnp.int32)] * batch)
    kwargs = {
        "causal_gqa": dict(is_causal=True),
        "lengths_soft_cap": dict(logits_soft_cap=20.0, **lengths),
        "segments_sinks": dict(
            is_causal=True, q_segment_ids=ids(q_len, 130),
            kv_segment_ids=ids(kv_len, 130),
            sinks=jnp.linspace(-1.0, 1.0, 4)),
        "bottom_right_window_lengths": dict(
            is_causal=True, causal_alignment="bottom_right",
            local_window_size=(150, 20), **lengths),
    }[case]
    fn = functools.partial(jflash.flash_attention, implementation="mosaic",
                           **kwargs)
    with mock.patch.object(mosaic_config, "BWD_SHARED_ROW_SPLIT", split):
      step = jax.jit(functools.partial(test_util.value_and_grads, fn))
      results = jax.block_until_ready(step(q, k, v, dout))
      again = jax.block_until_ready(step(q, k, v, dout))
    chex.assert_trees_all_equal(results, again)
    test_util.assert_close_to_reference(self, results, q, k, v, dout,
                                        **kwargs)


class MosaicAtomicDqTest(parameterized.TestCase):
  """The 5-product Mosaic backward (`MosaicBlockSizes(atomic_dq=True)`:
  dQ by reduce-adds from the dK/dV kernel, its pieces dealt out to the two
  warpgroups, `config.atomic_dq_pieces`) against the XLA path, with masks
  that make one row group skip tiles the other computes (calls at head dim
  64 take it by themselves only over longer sequences:
  config.atomic_dq_where_faster). Deterministic calls add in
  int32 fixed point: run twice, bitwise the same; with
  deterministic_grads=False in float32. Hopper only."""

  def setUp(self):
    super().setUp()
    test_util.skip_unless_mosaic_gpu(self)

  @parameterized.named_parameters(
      ("d128_causal_gqa", 128, {}, dict(is_causal=True), True),
      ("d64_lengths_soft_cap", 64, {}, "lengths_soft_cap", True),
      ("d64_one_piece_segments", 64, dict(block_q_dkv=64), "segments",
       False),
      ("d128_bottom_right_window", 128, {}, "bottom_right_window", False),
  )
  def test_gradients(self, head_dim, tiles, case, deterministic):
    batch, q_len, kv_len = 2, 300, 430
    q, k, v, dout = test_util.random_inputs(
        31, batch=batch, q_len=q_len, kv_len=kv_len,
        num_heads=4, num_kv_heads=2, head_dim=head_dim, dtype="bfloat16")
    lengths = dict(query_seq_lengths=jnp.array([300, 129], jnp.int32),
                   key_value_seq_lengths=jnp.array([77, 430], jnp.int32))
    ids = lambda n, edge: jnp.stack(
        [(jnp.arange(n) >= edge).astype(jnp.int32)] * batch)
    kwargs = case if isinstance(case, dict) else {
        "lengths_soft_cap": dict(logits_soft_cap=20.0, **lengths),
        "segments": dict(q_segment_ids=ids(q_len, 130),
                         kv_segment_ids=ids(kv_len, 200)),
        "bottom_right_window": dict(
            is_causal=True, causal_alignment="bottom_right",
            local_window_size=(150, 20), **lengths),
    }[case]
    sizes = dataclasses.replace(
        mosaic_config.default_block_sizes(head_dim), atomic_dq=True, **tiles)
    fn = functools.partial(jflash.flash_attention, implementation="mosaic",
                           block_sizes=sizes,
                           deterministic_grads=deterministic, **kwargs)
    step = jax.jit(functools.partial(test_util.value_and_grads, fn))
    results = jax.block_until_ready(step(q, k, v, dout))
    test_util.assert_close_to_reference(self, results, q, k, v, dout,
                                        **kwargs)
    if deterministic:
      # dQ's int32 fixed-point sums are exact: the same bits on every run.
      again = jax.block_until_ready(step(q, k, v, dout))
      for first, second in zip(jax.tree.leaves(results),
                               jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(first), np.asarray(second))

  @parameterized.named_parameters(
      ("d128_one_step", 128, 2, 2), ("d128_two_steps", 128, 4, 2),
      ("d64_one_step", 64, 2, 2), ("d64_two_steps", 64, 4, 2))
  def test_blocks_of_one_or_two_steps(self, head_dim, num_heads,
                                      num_kv_heads):
    """A single query tile: each dK/dV block walks one step (or one per
    query head of its GQA group), the edge of the dQ pieces' one-step-late
    order (the last step's added after the loop). 430 keys: the last
    block's second row group lies wholly past them and skips its tile,
    whose dQ pieces still carry the first row group's keys (and, in fixed
    point, need the tile's factors: a bug these cases caught)."""
    q, k, v, dout = test_util.random_inputs(
        32, batch=2, q_len=50, kv_len=430, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype="bfloat16")
    sizes = dataclasses.replace(
        mosaic_config.default_block_sizes(head_dim), atomic_dq=True)
    fn = functools.partial(jflash.flash_attention, implementation="mosaic",
                           block_sizes=sizes)
    step = jax.jit(functools.partial(test_util.value_and_grads, fn))
    results = jax.block_until_ready(step(q, k, v, dout))
    test_util.assert_close_to_reference(self, results, q, k, v, dout)

  @parameterized.named_parameters(("d64_deterministic", 64, True, False),
                                  ("d128_float32_adds", 128, False, True))
  def test_default_over_long_sequences(self, head_dim, deterministic,
                                       causal):
    """A default call over the head dim's shortest length in
    DETERMINISTIC_ATOMIC_DQ_MIN_LEN (deterministic, not causal: int32 fixed
    point) or NONDETERMINISTIC_ATOMIC_DQ_MIN_LEN
    (`deterministic_grads=False`: float32 adds) takes the 5-product
    backward by itself: gradients against the reference, and,
    deterministic, bitwise the same on a second run."""
    length = (mosaic_config.DETERMINISTIC_ATOMIC_DQ_MIN_LEN if deterministic
              else mosaic_config.NONDETERMINISTIC_ATOMIC_DQ_MIN_LEN)[head_dim]
    q, k, v, dout = test_util.random_inputs(
        41, batch=1, q_len=length, kv_len=length, num_heads=2,
        num_kv_heads=2, head_dim=head_dim, dtype="bfloat16")
    spec = api.describe(q, k, v, is_causal=causal,
                        deterministic_grads=deterministic).spec
    self.assertTrue(
        mosaic_config.MosaicConfig.for_call(spec).block_sizes.atomic_dq)
    fn = functools.partial(jflash.flash_attention, implementation="mosaic",
                           is_causal=causal,
                           deterministic_grads=deterministic)
    step = jax.jit(functools.partial(test_util.value_and_grads, fn))
    results = jax.block_until_ready(step(q, k, v, dout))
    test_util.assert_close_to_reference(self, results, q, k, v, dout,
                                        is_causal=causal)
    if deterministic:
      again = jax.block_until_ready(step(q, k, v, dout))
      for first, second in zip(jax.tree.leaves(results),
                               jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(first), np.asarray(second))


# One process's Mosaic fwd+bwd (D=128, causal with segments, bfloat16):
# saves the output and the three gradients to argv[1].
_GRADIENTS_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
import jflash
keys = jax.random.split(jax.random.key(0), 4)
q, k, v, g = (jax.random.normal(key, (2, 1024, 8, 128), jnp.bfloat16)
              for key in keys)
ids = (jnp.arange(1024)[None] * 3 // 1024).astype(jnp.int32).repeat(2, 0)
def loss(q, k, v):
  out = jflash.flash_attention(q, k, v, is_causal=True, q_segment_ids=ids,
                               kv_segment_ids=ids, implementation="mosaic")
  return jnp.vdot(out.astype(jnp.float32), g.astype(jnp.float32)), out
(_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(
    q, k, v)
np.savez(sys.argv[1], out=np.asarray(out, np.float32),
         **{f"d{i}": np.asarray(x, np.float32) for i, x in enumerate(grads)})
"""


class MosaicCrossProcessDeterminismTest(absltest.TestCase):
  """The Mosaic fwd+bwd gives the same bits in two processes (XLA's
  autotuner picks per process; an XLA reduction for delta made dQ and dK
  differ: RECORD 2026-11-26, "delta by a Mosaic kernel"). Hopper only."""

  def setUp(self):
    super().setUp()
    test_util.skip_unless_mosaic_gpu(self)

  def test_gradients_equal_in_two_processes(self):
    results = []
    with tempfile.TemporaryDirectory() as tmp:
      for run in range(2):
        path = os.path.join(tmp, f"{run}.npz")
        subprocess.run([sys.executable, "-c", _GRADIENTS_SCRIPT, path],
                       check=True, env=os.environ.copy())
        with np.load(path) as arrays:
          results.append({name: arrays[name] for name in arrays.files})
    for name in results[0]:
      np.testing.assert_array_equal(results[0][name], results[1][name],
                                    err_msg=name)


if __name__ == "__main__":
  absltest.main()
