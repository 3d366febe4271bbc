"""The backend registry: capabilities, reasons, the choice per pass, listing."""

import contextlib
import dataclasses
from unittest import mock

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import jflash
from jflash._src import api
from jflash._src import binding
from jflash._src import platform
from jflash._src import registry
from jflash._src.backends.mosaic.config import MosaicConfig
from jflash._src.backends.triton import backend as triton_backend
from jflash._src.spec import BackendOptions
from tests import test_util

KERNELS = dict(interpret=test_util.INTERPRET,
               block_sizes=test_util.SMALL_BLOCKS)


@contextlib.contextmanager
def _registered(backend, priority):
  """Registers a backend for the duration of a test."""
  with mock.patch.dict(registry._REGISTRY), \
      mock.patch.object(registry, "_PRIORITY", list(registry._PRIORITY)):
    registry.register(backend, priority=priority)
    yield


class RegistryTest(absltest.TestCase):

  def test_implementations_lists_every_backend(self):
    listing = {b["name"]: b for b in jflash.implementations()}
    self.assertEqual(list(listing),
                     ["decode", "mosaic", "triton", "xla", "cudnn"])
    self.assertEqual(listing["decode"]["passes"], ["forward"])
    self.assertIn("at most 16 query rows", listing["decode"]["limits"])
    self.assertIn("paged", listing["decode"]["mask_features"])
    triton, xla, cudnn = listing["triton"], listing["xla"], listing["cudnn"]
    mosaic = listing["mosaic"]
    self.assertEqual(triton["available"], test_util.ON_GPU)
    self.assertEqual(triton["default_here"], test_util.ON_GPU)
    on_hopper = platform.cuda_compute_capability() == "9.0"
    self.assertEqual(mosaic["available"], on_hopper)
    self.assertEqual(mosaic["default_here"], on_hopper)
    self.assertIn("head dims 64, 128, 256; compute capability 9.0",
                  mosaic["limits"])
    self.assertEqual(mosaic["unavailable_reason"] is None, on_hopper)
    self.assertFalse(mosaic["interpretable"])
    self.assertEqual(xla["default_here"], not test_util.ON_GPU)
    self.assertEqual(xla["role_here"],
                     "fallback" if test_util.ON_GPU else "default")
    self.assertEqual(cudnn["role_here"], "named only")
    self.assertFalse(cudnn["default_here"])
    # Available means it runs here: cuDNN needs a CUDA GPU.
    self.assertEqual(cudnn["available"], test_util.ON_GPU)
    for entry in listing.values():
      self.assertEqual(entry["available"],
                       entry["unavailable_reason"] is None)
    self.assertEqual(triton["max_head_dim"], 256)
    self.assertEqual(triton["arguments"], ["block_sizes", "interpret"])
    self.assertEqual(mosaic["arguments"], ["block_sizes"])
    self.assertIn("float64", xla["dtypes"])
    for name in ("triton", "xla"):
      self.assertEqual(listing[name]["passes"], ["forward", "backward"])
      self.assertIn("segments", listing[name]["mask_features"])
    self.assertNotIn("segments", cudnn["mask_features"])

  def test_reasons_are_one_sentence_naming_what_is_missing(self):
    ids = jnp.zeros((1, 8), jnp.int32)
    cases = (
        ("triton", dict(shape=(1, 8, 2, 320)),
         "triton supports head_dim <= 256; got head_dim=320."),
        ("triton", dict(dtype=jnp.int32),
         "triton supports dtypes float32, bfloat16, float16; got int32."),
        ("cudnn", dict(q_segment_ids=ids, kv_segment_ids=ids,
                       logits_soft_cap=2.0),
         "cudnn does not support segments, soft_cap."),
    )
    for name, options, expected in cases:
      with self.subTest(expected=expected):
        shape = options.pop("shape", (1, 8, 2, 32))
        dtype = options.pop("dtype", jnp.float32)
        q = jnp.ones(shape, dtype)
        call = api.describe(q, q, q, **options,
                            **(KERNELS if name == "triton" else {}))
        with mock.patch.object(registry, "current_platform",
                               return_value="cuda"):  # cuDNN needs a GPU.
          reason = registry.unsupported_reason(
              registry.get(name), call.spec, "forward",
              call.options.given())
        self.assertStartsWith(reason, expected)
        self.assertEqual(reason.count(". "), 0, msg=reason)

  def test_reasons_name_the_compute_capability_and_head_dims(self):
    mosaic = registry.get("mosaic")
    q = jnp.ones((1, 8, 2, 96), jnp.bfloat16)
    call = api.describe(q, q, q)
    with mock.patch.object(registry, "current_platform",
                           return_value="cuda"):
      with mock.patch.object(platform, "cuda_compute_capability",
                             return_value="8.0"):
        self.assertEqual(
            registry.unsupported_reason(mosaic, call.spec, "forward", {}),
            "mosaic needs a GPU of compute capability 9.0; this one is "
            "8.0.")
      with mock.patch.object(platform, "cuda_compute_capability",
                             return_value="9.0"):
        self.assertEqual(
            registry.unsupported_reason(mosaic, call.spec, "forward", {}),
            "mosaic supports head_dim in {64, 128, 256}; got head_dim=96.")

  def test_block_sizes_choose_their_backend(self):
    # On a Hopper GPU (mocked), a jflash.MosaicBlockSizes runs the Mosaic
    # kernels and a jflash.BlockSizes the Triton ones; naming a backend
    # with the other's tiles is an error.
    q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
    mosaic_tiles = jflash.MosaicBlockSizes(block_kv=64)
    with mock.patch.object(registry, "current_platform",
                           return_value="cuda"), \
        mock.patch.object(platform, "cuda_compute_capability",
                          return_value="9.0"):
      for tiles, expected in ((mosaic_tiles, "mosaic"),
                              (test_util.SMALL_BLOCKS, "triton")):
        call = api.describe(q, q, q, block_sizes=tiles)
        plan = registry.plan(call.spec, None, call.options)
        self.assertEqual((plan.forward, plan.backward), (expected,) * 2)
      self.assertEqual(registry.plan(
          api.describe(q, q, q, block_sizes=mosaic_tiles).spec, "mosaic",
          BackendOptions(block_sizes=mosaic_tiles)).forward_config.block_sizes,
                       mosaic_tiles)
      for tiles, named, owner in (
          (test_util.SMALL_BLOCKS, "mosaic", "triton"),
          (mosaic_tiles, "triton", "mosaic")):
        call = api.describe(q, q, q, block_sizes=tiles)
        with self.assertRaisesRegex(
            ValueError, f"block_sizes \\({type(tiles).__name__}\\) "
            f"configures the {owner} backend; it cannot be combined with "
            f"implementation='{named}'"):
          registry.plan(call.spec, named, call.options)

  def test_decode_calls_go_to_the_decode_kernel(self):
    # On a Hopper GPU (mocked): a few new tokens run the split-K decode
    # kernel forward (the backward stays with the training kernels), but
    # where the measured route (tuning/route.py) found the Mosaic forward
    # faster: one sequence of a short cache; more than 16 query rows per
    # sequence never do.
    lengths = jnp.array([3000], jnp.int32)
    with mock.patch.object(registry, "current_platform",
                           return_value="cuda"), \
        mock.patch.object(platform, "cuda_compute_capability",
                          return_value="9.0"):
      for q_len, kv_len, expected in ((1, 4096, "decode"),
                                      (16, 2048, "decode"),
                                      (1, 256, "mosaic"),
                                      (17, 4096, "mosaic")):
        q = jnp.ones((1, q_len, 8, 64), jnp.bfloat16)
        k = jnp.ones((1, kv_len, 2, 64), jnp.bfloat16)
        call = api.describe(q, k, k, is_causal=True,
                            causal_alignment="bottom_right",
                            key_value_seq_lengths=lengths)
        plan = registry.plan(call.spec, None, call.options)
        self.assertEqual((plan.forward, plan.backward), (expected, "mosaic"),
                         msg=f"q_len={q_len}, kv_len={kv_len}")

  def test_mosaic_tiles_must_fit_shared_memory(self):
    q = jnp.ones((1, 64, 2, 128), jnp.bfloat16)
    call = api.describe(q, q, q)
    too_big = jflash.MosaicBlockSizes(block_kv=256, num_stages=3)
    # Q 32 KiB, two 3-stage rings of 256 x 128 keys 384 KiB, the lse
    # staging 1 KiB (each allocation 1 KiB-aligned): 427008 bytes.
    with self.assertRaisesRegex(ValueError, "need 427008 bytes of shared "
                                "memory in the forward pass at "
                                "head_dim=128"):
      MosaicConfig.for_call(call.spec, block_sizes=too_big)
    for bad in (dict(block_q=32), dict(block_kv_dq=100),
                dict(num_stages=1), dict(backward_stages=1.5)):
      with self.subTest(**bad), self.assertRaisesRegex(ValueError, "must"):
        jflash.MosaicBlockSizes(**bad)

  def test_a_named_forward_only_backend_raises_when_differentiated(self):
    # Its forward runs; the gradient names the pass it lacks.
    forward_only = dataclasses.replace(
        triton_backend.BACKEND, name="forward_only",
        capabilities=dataclasses.replace(
            triton_backend.CAPABILITIES,
            passes=frozenset({registry.FORWARD})),
        backward=None)
    q, k, v, _ = test_util.random_inputs(153, q_len=16, kv_len=16,
                                         num_heads=2)
    fn = lambda q: jflash.flash_attention(
        q, k, v, implementation="forward_only", **KERNELS).sum()
    with _registered(forward_only, priority=0):
      self.assertTrue(np.isfinite(float(fn(q))))
      with self.assertRaisesRegex(
          NotImplementedError, "implementation='forward_only' cannot run "
          "the backward pass of this call: forward_only has no backward "
          "pass."):
        jax.grad(fn)(q)

  def test_a_named_backend_that_cannot_run_raises_before_tracing(self):
    q = jnp.ones((1, 8, 2, 320))
    with self.assertRaisesRegex(NotImplementedError,
                                "triton supports head_dim <= 256"):
      jax.jit(lambda q: jflash.flash_attention(
          q, q, q, implementation="triton", **KERNELS)).trace(q)

  def test_backend_options_must_belong_to_the_named_backend(self):
    q = jnp.ones((1, 8, 2, 32))
    with self.assertRaisesRegex(ValueError, "block_sizes \\(BlockSizes\\) "
                                "configures the "
                                "triton backend.*implementation='xla'"):
      jflash.flash_attention(q, q, q, implementation="xla",
                             block_sizes=test_util.SMALL_BLOCKS)

  def test_a_forward_only_backend_leaves_the_backward_to_the_next(self):
    # A backend supplying only a forward (the Triton forward, counted) is
    # chosen for that pass; the backward falls back to Triton's.
    calls = []

    def counted_forward(*args):
      calls.append(1)
      return triton_backend.forward(*args)

    forward_only = dataclasses.replace(
        triton_backend.BACKEND, name="forward_only",
        capabilities=dataclasses.replace(
            triton_backend.CAPABILITIES,
            passes=frozenset({registry.FORWARD})),
        forward=counted_forward, backward=None)
    q, k, v, dout = test_util.random_inputs(150, q_len=40, kv_len=56,
                                            num_heads=4, num_kv_heads=2)
    with _registered(forward_only, priority=0):
      call = api.describe(q, k, v, is_causal=True, **KERNELS)
      plan = registry.plan(call.spec, None, call.options)
      self.assertEqual((plan.forward, plan.backward),
                       ("forward_only", "triton"))
      fn = lambda q, k, v: jflash.flash_attention(q, k, v, is_causal=True,
                                                  **KERNELS)
      results = jax.jit(test_util.value_and_grads, static_argnums=0)(
          fn, q, k, v, dout)
    self.assertNotEmpty(calls)
    test_util.assert_close_to_jax_nn(self, results, q, k, v, dout,
                                     is_causal=True)

  def test_passes_of_different_backends_share_the_residuals(self):
    # The residual format (out, base-2 lse) pairs any forward with any
    # backward: Triton then XLA, XLA then Triton, with the lse returned.
    q, k, v, dout = test_util.random_inputs(151, q_len=40, kv_len=56,
                                            num_heads=4, num_kv_heads=2)
    options = dict(is_causal=True, sinks=jnp.array([0.5, -1.0, 0.0, 2.0]),
                   query_seq_lengths=jnp.array([40, 17]),
                   return_residual=True)
    call = api.describe(q, k, v, **options, **KERNELS)
    triton_config = triton_backend.BACKEND.configure(
        call.spec, **call.options.given())
    dlse = jax.random.normal(jax.random.key(152), q.shape[:3])

    def results(plan):
      fn = lambda q, k, v: binding.attention(
          call.spec, plan, call.operands.replace(query=q, key=k, value=v))
      return jax.jit(test_util.value_and_all_grads, static_argnums=0)(
          fn, (dout, dlse), q, k, v)

    with jax.default_matmul_precision("highest"):
      expected = results(registry.Plan("xla", None, "xla", None))
    for plan in (registry.Plan("triton", triton_config, "xla", None),
                 registry.Plan("xla", None, "triton", triton_config)):
      with self.subTest(plan=plan.forward + "+" + plan.backward):
        ours = results(plan)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ours,
                              expected):
          # Rows past the query length: lse = -inf in both.
          np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5,
                                     err_msg=name)

  @absltest.skipIf(test_util.ON_GPU, "the Triton kernels run on a GPU")
  def test_triton_options_without_a_gpu_say_why(self):
    q = jnp.ones((1, 8, 2, 32))
    with self.assertRaisesRegex(NotImplementedError,
                                "triton needs a CUDA GPU"):
      jflash.flash_attention(q, q, q, block_sizes=test_util.SMALL_BLOCKS)


if __name__ == "__main__":
  absltest.main()
