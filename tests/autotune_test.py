"""jflash.autotune: checks candidates, keeps the winner, and reuses it."""

import json
import os
import tempfile
from unittest import mock

from absl.testing import absltest
import jax.numpy as jnp

import jflash
from jflash._src import api
from jflash._src import registry
from jflash._src.backends.triton import backend as triton_backend
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

  def test_cache_can_be_disabled(self):
    with mock.patch.dict(os.environ, {cache.CACHE_ENV_VAR: "off"}):
      self.assertIsNone(cache.cache_path())
      self.assertIsNone(triton_backend.tuned_block_sizes(
          q_len=40, kv_len=40, num_heads=2, num_kv_heads=1, head_dim=32,
          dtype=jnp.float32, is_causal=True, device_kind="cpu"))


if __name__ == "__main__":
  absltest.main()
