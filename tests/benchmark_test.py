"""Smoke test of benchmarks/run.py: tiny shapes, xla and jflash, on any host.

Runs the benchmark's `main` with --allow-cpu (jflash in the Pallas interpreter
off the GPU) and checks the JSON, the plot and the FLOP count.
"""

import contextlib
import importlib.util
import io
import json
import os
import tempfile

from absl.testing import absltest


def _load_run_module():
  # benchmarks/ is scripts, not a package: load run.py by its path.
  path = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                      "benchmarks", "run.py")
  spec = importlib.util.spec_from_file_location("benchmarks_run", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


run = _load_run_module()

_SHAPES = ("1,64,2,32", "1,64,4,32,2")  # The second one is GQA (2 kv heads).
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
    gqa = [r for r in rows if r["shape"] == "1,64,4,32,2"]
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

  def test_parse_shape(self):
    self.assertEqual(run.parse_shape("1,64,4,32").num_kv_heads, 4)
    self.assertEqual(str(run.parse_shape("1,64,4,32,4")), "1,64,4,32")
    for bad in ("1,64,4", "1,64,4,32,3", "1,64,0,32", "1,a,4,32"):
      with self.subTest(bad=bad), self.assertRaises(
          run.argparse.ArgumentTypeError):
        run.parse_shape(bad)


if __name__ == "__main__":
  absltest.main()
