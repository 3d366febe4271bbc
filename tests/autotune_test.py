"""jflash.autotune: checks candidates, keeps the winner, and reuses it."""

import dataclasses
import json
import os
import tempfile
from unittest import mock

from absl.testing import absltest
import jax.numpy as jnp

import jflash
from jflash._src import api
from jflash._src import platform
from jflash._src import registry
from jflash._src.backends.mosaic import config as mosaic_config
from jflash._src.backends.mosaic.config import MosaicConfig
from jflash._src.tuning import cache
from tests import test_util

FORWARD = [(16, 16, 4, 1), (32, 16, 4, 1)]
BACKWARD = [(16, 16, 16, 16, 4, 1)]


class AutotuneTest(absltest.TestCase):
  INTERPRET = test_util.INTERPRET

  def setUp(self):
    super().setUp()
    directory = self.enter_context(tempfile.TemporaryDirectory())
    self.path = os.path.join(directory, "autotune.json")
    self.inputs = test_util.random_inputs(40, batch=1, q_len=40, kv_len=40,
                                          num_heads=2, num_kv_heads=1)[:3]

  def _tune(self, **kwargs):
    return jflash.autotune(
        *self.inputs, is_causal=True, interpret=self.INTERPRET,
        forward_candidates=kwargs.pop("forward", FORWARD),
        backward_candidates=BACKWARD, repeats=1, iters=1, path=self.path,
        **kwargs)

  def test_winner_is_cached_and_used_by_flash_attention(self):
    best = self._tune()
    self.assertIn((best.block_q, best.block_k, best.num_warps,
                   best.num_stages), FORWARD)
    with open(self.path) as f:
      entries = json.load(f)
    self.assertLen(entries, 1)
    (entry,) = entries.values()
    self.assertEqual(jflash.BlockSizes(**entry["block_sizes"]), best)
    self.assertGreater(entry["forward_ms"], 0.0)

    # Called without block_sizes, flash_attention now runs the tuned tiles.
    plans = []
    record = lambda *args: plans.append(real_plan(*args)) or plans[-1]
    real_plan = registry.plan
    with mock.patch.dict(os.environ, {cache.CACHE_ENV_VAR: self.path}), \
        mock.patch.object(registry, "plan", record):
      jflash.flash_attention(*self.inputs, is_causal=True,
                             interpret=self.INTERPRET)
    (plan,) = plans
    self.assertEqual(plan.forward, "triton")
    self.assertEqual(plan.forward_config.block_sizes, best)
    self.assertEqual(plan.backward_config.block_sizes, best)

  def test_wrong_candidates_are_rejected(self):
    real = api.flash_attention

    def broken_for_block_q_32(*args, block_sizes=None, **kwargs):
      out = real(*args, block_sizes=block_sizes, **kwargs)
      if block_sizes is not None and block_sizes.block_q == 32:
        return out + 1.0  # A wrong answer, however fast.
      return out

    with mock.patch.object(api, "flash_attention", broken_for_block_q_32):
      best = self._tune()
      self.assertEqual(best.block_q, 16)
      with self.assertRaisesRegex(ValueError, "every candidate was rejected"):
        self._tune(forward=[(32, 16, 4, 1)])

  def test_mosaic_tiles_are_cached_apart_and_read_by_its_backend(self):
    # What jflash.autotune(..., implementation="mosaic") writes on a Hopper
    # GPU, the Mosaic backend reads for that device and shape; Triton's
    # entry for the same shape is another key.
    q = jnp.ones((1, 256, 2, 128), jnp.bfloat16)
    spec = api.describe(q, q, q, is_causal=True).spec
    shape = dict(q_len=256, kv_len=256, num_heads=2, num_kv_heads=2,
                 head_dim=128, dtype="bfloat16", is_causal=True,
                 device_kind="NVIDIA H100 80GB HBM3")
    tuned = jflash.MosaicBlockSizes(block_kv=64, num_stages=3,
                                    backward_stages=2)
    cache.store(self.path, cache.shape_key(**shape, backend="mosaic"),
                {"block_sizes": dataclasses.asdict(tuned)})
    cache.store(self.path, cache.shape_key(**shape),
                {"block_sizes": dataclasses.asdict(jflash.BlockSizes())})
    with mock.patch.dict(os.environ, {cache.CACHE_ENV_VAR: self.path}), \
        mock.patch.object(platform, "device_kind",
                          return_value=shape["device_kind"]):
      self.assertEqual(MosaicConfig.for_call(spec).block_sizes, tuned)
      other = api.describe(q[:, :128], q[:, :128], q[:, :128],
                           is_causal=True).spec
      self.assertEqual(MosaicConfig.for_call(other).block_sizes,
                       mosaic_config.default_block_sizes(128))

  def test_mosaic_search_on_hopper(self):
    if platform.cuda_compute_capability() != "9.0":
      self.skipTest("the Mosaic kernels run on Hopper GPUs only (the "
                    "GPU suite on an H100/H200 runs this test)")
    q, k, v = test_util.random_inputs(41, batch=1, q_len=200, kv_len=200,
                                      num_heads=2, head_dim=128,
                                      dtype="bfloat16")[:3]
    best = jflash.autotune(
        q, k, v, is_causal=True, implementation="mosaic",
        forward_candidates=[(64, 64, 2), (64, 128, 2), (64, 256, 3)],
        backward_candidates=[(64, 64, 64, 64, 2)], repeats=1, iters=1,
        path=self.path)
    self.assertIsInstance(best, jflash.MosaicBlockSizes)
    self.assertIn(best.block_kv, (64, 128))  # 256 x 3 stages do not fit.
    with open(self.path) as f:
      (key,) = json.load(f)
    self.assertStartsWith(key, "mosaic|")

  def test_mosaic_autotune_needs_hopper_and_names_the_reason(self):
    if platform.cuda_compute_capability() == "9.0":
      self.skipTest("on Hopper the Mosaic search runs (GPU suite)")
    q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
    with self.assertRaisesRegex(NotImplementedError,
                                "jflash.autotune: mosaic needs"):
      jflash.autotune(q, q, q, implementation="mosaic", path=self.path)
    with self.assertRaisesRegex(ValueError, "implementation must be one of "
                                "\\('mosaic', 'triton'\\); got 'xla'"):
      jflash.autotune(q, q, q, implementation="xla", path=self.path)

  def test_cache_can_be_disabled(self):
    spec = api.describe(*self.inputs, is_causal=True).spec
    cache.store(self.path, cache.call_key(spec, "triton"),
                {"block_sizes": dataclasses.asdict(jflash.BlockSizes())})
    with mock.patch.dict(os.environ, {cache.CACHE_ENV_VAR: self.path}):
      self.assertEqual(cache.tuned(spec, "triton", jflash.BlockSizes),
                       jflash.BlockSizes())
    with mock.patch.dict(os.environ, {cache.CACHE_ENV_VAR: "off"}):
      self.assertIsNone(cache.cache_path())
      self.assertIsNone(cache.tuned(spec, "triton", jflash.BlockSizes))

  def test_backends_with_tiles_declare_their_search(self):
    # The search runs on every backend that declares a tuning space, for
    # the tiles that backend takes; each candidate sets its named fields.
    spaces = {name: registry.get(name).tuning for name in registry.names()
              if registry.get(name).tuning is not None}
    self.assertEqual(sorted(spaces), ["mosaic", "triton"])
    for name, space in spaces.items():
      with self.subTest(name):
        self.assertIs(space.block_sizes_type,
                      registry.get(name).block_sizes_type)
        fields = {f.name for f in dataclasses.fields(space.block_sizes_type)}
        for names, candidates in (
            (space.forward_fields, space.forward_candidates),
            (space.backward_fields, space.backward_candidates)):
          self.assertLessEqual(set(names), fields)
          for candidate in candidates:
            self.assertLen(candidate, len(names))


if __name__ == "__main__":
  absltest.main()
