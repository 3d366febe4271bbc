"""Smoke tests of benchmarks/run.py and benchmarks/train_step.py, any host.

Runs each benchmark's `main` with --allow-cpu (jflash in the Pallas
interpreter off the GPU) on tiny shapes and checks the JSON, run.py's plot and
FLOP count, and train_step.py's losses and ratios.
"""

import collections
import contextlib
import importlib.util
import io
import json
import math
import os
import sys
import tempfile
from unittest import mock

from absl.testing import absltest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_benchmark(name):
  # benchmarks/ is scripts, not a package: load them by their paths. Some
  # import `from benchmarks import run`, which needs the repository root.
  if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
  path = os.path.join(_ROOT, "benchmarks", f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


run = _load_benchmark("run")
train_step = _load_benchmark("train_step")
train_sharded = _load_benchmark("train_sharded")

# The second shape is GQA (2 kv heads), and the shape of train_step.py
# --tiny's attention (B, N = 2, 64; 4 query / 2 kv heads of 16, bf16,
# causal): its attention-share programs (below) are these, compiled once per
# process.
_SHAPES = ("1,64,2,32", "2,64,4,16,2")
_IMPLS = ("xla", "triton")


class BenchmarkTest(absltest.TestCase):

  def test_main_writes_json_and_plot(self):
    with tempfile.TemporaryDirectory() as tmp:
      json_path = os.path.join(tmp, "bench.json")
      png_path = os.path.join(tmp, "bench.png")
      stdout = io.StringIO()
      with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(
          io.StringIO()):
        code = run.main([
            "run.py", "--allow-cpu", "--shapes", *_SHAPES, "--impls",
            ",".join(_IMPLS), "--causal", "yes", "--repeats", "1", "--iters",
            "1", "--warmup", "0", "--json", json_path, "--plot", png_path])
      self.assertEqual(code, 0, stdout.getvalue())
      with open(json_path) as f:
        result = json.load(f)
      with open(png_path, "rb") as f:
        png_head = f.read(8)

    self.assertIn("device_kind", result["meta"])
    rows = result["rows"]
    self.assertLen(rows, len(_SHAPES) * len(_IMPLS) * len(run.PASSES))
    seen = set()
    for row in rows:
      with self.subTest(shape=row["shape"], impl=row["impl"],
                        pass_=row["pass"]):
        self.assertIsNone(row["error"])
        self.assertGreater(row["tflops"], 0)
        self.assertIsNotNone(row["mem_mib"])
        self.assertGreater(row["mem_mib"], 0)
        self.assertIsNone(row["vs_mha"])  # mha was not run.
      seen.add((row["shape"], row["impl"], row["pass"]))
    self.assertEqual(
        seen, {(s, i, p) for s in _SHAPES for i in _IMPLS for p in run.PASSES})
    gqa = [r for r in rows if r["shape"] == _SHAPES[1]]
    self.assertTrue(all(r["num_heads"] == 4 and r["num_kv_heads"] == 2
                        for r in gqa))
    self.assertEqual(png_head, b"\x89PNG\r\n\x1a\n")

  def test_flops(self):
    shape = run.parse_shape("2,64,4,32,2")
    self.assertEqual(shape.num_kv_heads, 2)
    # 4 * B * H * N^2 * D with query heads H = 4, halved (causal), x3.5.
    self.assertEqual(run.flops(shape, True, "fwd+bwd"),
                     4 * 2 * 4 * 64**2 * 32 * 0.5 * 3.5)
    self.assertEqual(run.flops(shape, False, "fwd"), 4 * 2 * 4 * 64**2 * 32)

  def test_a_missing_peer_names_its_package(self):
    # --impls tokamax times tokamax's kernels where the package is there;
    # without it the rows get an ImportError that says what to install
    # (run_case records it in the row and goes on).
    self.assertEqual(run.parse_impls("jflash,tokamax,cudnn"),
                     ["jflash", "tokamax", "cudnn"])
    with mock.patch.dict(sys.modules, {"tokamax": None}):
      with self.assertRaisesRegex(ImportError, "pip install tokamax"):
        run.attention_fn("tokamax", is_causal=True)

  def test_parse_shape(self):
    self.assertEqual(run.parse_shape("1,64,4,32").num_kv_heads, 4)
    self.assertEqual(str(run.parse_shape("1,64,4,32,4")), "1,64,4,32")
    for bad in ("1,64,4", "1,64,4,32,3", "1,64,0,32", "1,a,4,32"):
      with self.subTest(bad=bad), self.assertRaises(
          run.argparse.ArgumentTypeError):
        run.parse_shape(bad)

  def test_round_orders_put_each_call_after_each_other_equally_often(self):
    # The interleaved harnesses' orders (A/B timings on a power-capped GPU,
    # where a call starts at the clock its predecessor left).
    for count in range(1, 7):
      orders = run.balanced_orders(count)
      self.assertLen(orders, count if count % 2 == 0 else 2 * count)
      follows = collections.Counter()
      for order in orders:
        self.assertCountEqual(order, range(count))
        follows.update(zip(order, order[1:]))
      pairs = [(a, b) for a in range(count) for b in range(count) if a != b]
      self.assertCountEqual(follows, pairs, msg=f"count={count}")
      self.assertLen(set(follows.values()), min(1, len(pairs)),
                     msg=f"count={count}: {follows}")
    names = ["after", "under", "cudnn"]
    rounds = run.round_orders(names, 8)
    self.assertLen(rounds, 8)
    self.assertEqual(rounds[6], rounds[0])  # A cycle of 6 for three calls.
    self.assertCountEqual(rounds[1], names)
    # Every call failed to compile: rounds with nothing to time.
    self.assertEqual(run.round_orders([], 2), [[], []])


class TrainShardedTest(absltest.TestCase):

  def test_tiny_meshes(self):
    # --tiny on 1, 2 and 4 of the suite's CPU devices: one device, heads
    # split over two (model), and batch x heads over 2 x 2. XLA attention
    # and jflash's Triton kernels in the interpreter (partitioned by
    # custom_partitioning over the batch and heads shards).
    import jax  # pylint: disable=g-import-not-at-top
    if jax.device_count() < 4:
      self.skipTest("needs 4 devices (the CPU suite's processes have 8)")
    with tempfile.TemporaryDirectory() as tmp:
      json_path = os.path.join(tmp, "sharded.json")
      with contextlib.redirect_stdout(io.StringIO()):
        rows = train_sharded.main(["--tiny", "--meshes", "1x1", "1x2",
                                   "2x2", "--json", json_path])
      with open(json_path) as f:
        self.assertEqual(json.load(f)["rows"], rows)
    by = {(r["mesh"], r["impl"]): r for r in rows}
    self.assertEqual(sorted(by), sorted(
        (m, i) for m in ("1x1", "1x2", "2x2") for i in ("xla", "triton")))
    for (mesh, impl), row in by.items():
      with self.subTest(mesh=mesh, impl=impl):
        self.assertIsNone(row["error"])
        # Attention on local shards: no collective rebuilds q, k or v (nor
        # anything: the moments are sharded as their parameters).
        self.assertEqual(row["qkv_all_gathers"], [])
        self.assertEqual(row["all-gather"], 0)
        self.assertEqual(row["all-reduce"] > 0, mesh != "1x1")
        self.assertEqual(row["batch"], 2 * int(mesh[0]))
        self.assertLen(row["times"], 2)
        self.assertAlmostEqual(row["tokens_per_s_per_gpu"] * row["gpus"],
                               row["tokens_per_s"], places=3)
        # Splitting the heads changes the arithmetic's order only; the
        # kernels agree with XLA's attention.
        self.assertAlmostEqual(row["loss_first"],
                               by[("1x1", "xla")]["loss_first"]
                               if mesh != "2x2" else
                               by[("2x2", "xla")]["loss_first"], delta=5e-4)
    self.assertEqual(by[("1x1", "triton")]["vs_1gpu"], 1.0)
    self.assertIsNone(by[("1x1", "triton")]["vs_cudnn"])

  def test_collective_counts(self):
    hlo = "\n".join([
        "  %ag = bf16[8,2048,4,128]{3,2,1,0} all-gather(%x), dimensions={2}",
        "  %ags = (f32[2,64]{1,0}, f32[4,64]{1,0}) all-gather-start(%y)",
        "  %ar = f32[64]{0} all-reduce(%z), to_apply=%sum",
        "  %all-reduce.1 = f32[64]{0} all-reduce-start(%z), to_apply=%sum",
        "  %cp = bf16[4]{0} collective-permute(%w)"])
    counts = train_sharded.collective_counts(
        hlo, [(8, 2048, 16, 128), (8, 2048, 4, 128)])
    self.assertEqual(
        {k: counts[k] for k in ("all-gather", "all-reduce",
                                "reduce-scatter", "collective-permute")},
        {"all-gather": 2, "all-reduce": 2, "reduce-scatter": 0,
         "collective-permute": 1})
    self.assertEqual(counts["qkv_all_gathers"], ["bf16[8,2048,4,128]"])

  def test_bad_arguments(self):
    for argv, message in (
        (["--meshes", "2"], "DxM"),
        (["--meshes", "1x3"], "must divide --kv-heads"),
        (["--impls", "flash"], "unknown"),
        (["--batch", "0"], "--batch must be positive")):
      with self.subTest(argv=argv):
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), self.assertRaises(
            SystemExit):
          train_sharded.parse_args(argv)
        self.assertIn(message, stderr.getvalue())


class TrainStepTest(absltest.TestCase):

  def test_tiny_main_writes_json(self):
    # --tiny: 2 layers, d_model 64, 4 query / 2 kv heads, vocab 256, B x N =
    # 2 x 64; Triton kernels in the interpreter off the GPU, and XLA.
    with tempfile.TemporaryDirectory() as tmp:
      json_path = os.path.join(tmp, "train_step.json")
      stdout = io.StringIO()
      with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(
          io.StringIO()):
        code = train_step.main([
            "train_step.py", "--tiny", "--allow-cpu", "--warmup", "1",
            "--steps", "2", "--json", json_path])
      self.assertEqual(code, 0, stdout.getvalue())
      with open(json_path) as f:
        result = json.load(f)

    # Embedding and head 2 * 256 * 64, final norm 64; per layer q, o 64 * 64,
    # k, v 64 * 32, MLP 2 * 64 * 256, two norms 64.
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 * 256 + 2 * 64
    self.assertEqual(result["meta"]["params"],
                     {"2": 2 * 256 * 64 + 64 + 2 * per_layer})
    rows = result["rows"]
    self.assertEqual([r["impl"] for r in rows], ["triton", "xla"])
    for row in rows:
      with self.subTest(impl=row["impl"]):
        self.assertIsNone(row["error"])
        self.assertIsNone(row["attention_error"])
        self.assertEqual((row["batch"], row["seq_len"], row["heads"],
                          row["kv_heads"], row["head_dim"]),
                         (2, 64, 4, 2, 16))
        self.assertLen(row["step_ms_all"], 2)
        self.assertGreater(row["step_ms"], 0)
        self.assertAlmostEqual(row["tokens_per_s"],
                               2 * 64 / (row["step_ms"] * 1e-3), places=3)
        self.assertIsNone(row["vs_cudnn"])  # cuDNN was not run.
        self.assertGreater(row["attention_share"], 0)
        self.assertGreater(row["mem_mib"], 0)
        # Random tokens, small init: the loss starts near log(vocab).
        self.assertAlmostEqual(row["loss_first"], math.log(256), delta=0.1)
        self.assertTrue(math.isfinite(row["loss_last"]))
    # The same parameters and batch: the attention backends agree.
    self.assertAlmostEqual(rows[0]["loss_first"], rows[1]["loss_first"],
                           delta=1e-2)

  def test_defaults_are_the_issue_targets(self):
    args = train_step.parse_args([])
    self.assertEqual(args.shapes, [(8, 2048), (2, 8192), (1, 32768)])
    self.assertEqual(args.kv_heads, [4, 16])
    self.assertEqual((args.layers, args.d_model, args.heads, args.vocab),
                     (8, 2048, 16, 32000))
    self.assertEqual(args.impls, ["jflash", "triton", "cudnn", "xla"])
    self.assertGreaterEqual(args.steps, 5)
    self.assertEqual(args.warmup, 2)
    cfg = train_step.Config(layers=8, d_model=2048, heads=16, kv_heads=4,
                            vocab=32000, remat=True, scan_layers=True)
    self.assertEqual(cfg.head_dim, 128)
    self.assertIsNone(train_step.xla_skip_reason(2, 8192, cfg, args))
    self.assertIn("skipped: N=32768",
                  train_step.xla_skip_reason(1, 32768, cfg, args))


class CompileTimeTest(absltest.TestCase):

  def test_ptxas_reports_are_read_from_what_cpp_code_prints(self):
    # What Mosaic GPU's `ptxas -v` dump prints to file descriptor 1 (past
    # sys.stdout), captured and parsed as compile_time.py --ptxas does.
    compile_time = _load_benchmark("compile_time")

    def prints():
      os.write(1, b"ptxas info    : Used 168 registers\n"
                  b"ptxas info    : Compile time = 409.648 ms\n"
                  b"ptxas info    : Compile time = 12 ms\n")
      return "result"

    result, text = compile_time.deviceless.capture_stdout(prints)
    self.assertEqual(result, "result")
    self.assertEqual(compile_time._ptxas_seconds(text), [0.409648, 0.012])

  def test_deviceless_reads_one_report_per_kernel(self):
    # benchmarks/deviceless.py: ptxas -v's blocks, an advisory and a spill
    # warning printed before the block they belong to.
    deviceless = _load_benchmark("compile_time").deviceless
    text = (
        "ptxas info    : Compiling entry function 'a_kernel' for 'sm_90a'\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 168 registers, used 16 barriers\n"
        "ptxas info    : Compile time = 151.1 ms\n"
        "ptxas info    : (C7515) Potential Performance Loss: wgmma ...\n"
        "ptxas warning : Registers are spilled to local memory in function "
        "'b_kernel', 148 bytes spill stores, 132 bytes spill loads\n"
        "ptxas info    : Compiling entry function 'b_kernel' for 'sm_90a'\n"
        "    96 bytes stack frame, 148 bytes spill stores, 132 bytes spill "
        "loads\n"
        "ptxas info    : Used 168 registers, used 16 barriers\n"
        "ptxas info    : Compile time = 485.5 ms\n")
    reports = deviceless.parse_ptxas(text)
    self.assertEqual(
        [(r.name, r.registers, r.spill_stores, r.ptxas_ms, r.advisories)
         for r in reports],
        [("a_kernel", 168, 0, 151.1, ()),
         ("b_kernel", 168, 148, 485.5, ("C7515",))])


if __name__ == "__main__":
  absltest.main()
