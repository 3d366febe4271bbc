"""benchmarks/run.py works end to end (tiny shapes, on CPU when no GPU)."""

import contextlib
import importlib.util
import io
import json
import os
import tempfile

from absl.testing import absltest

_PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "run.py")


def _load_benchmark():
  spec = importlib.util.spec_from_file_location("benchmark_run", _PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


class BenchmarkTest(absltest.TestCase):

  def test_runs_and_writes_json_and_plot(self):
    run = _load_benchmark()
    directory = self.enter_context(tempfile.TemporaryDirectory())
    json_path = os.path.join(directory, "bench.json")
    plot_path = os.path.join(directory, "bench.png")
    with contextlib.redirect_stdout(io.StringIO()), \
        contextlib.redirect_stderr(io.StringIO()):
      code = run.main([
          "run.py", "--allow-cpu", "--impls", "xla,triton", "--shapes",
          "1,64,2,32", "1,64,4,32,2", "--causal", "yes", "--repeats", "1",
          "--iters", "1", "--warmup", "0", "--no-progress", "--json",
          json_path, "--plot", plot_path])
    self.assertEqual(code, 0)
    with open(json_path) as f:
      rows = json.load(f)["rows"]
    seen = {(r["shape"], r["impl"], r["pass"]) for r in rows}
    self.assertEqual(seen, {(shape, impl, pass_)
                            for shape in ("1,64,2,32", "1,64,4,32,2")
                            for impl in ("xla", "triton")
                            for pass_ in ("fwd", "fwd+bwd")})
    for row in rows:
      self.assertIsNone(row["error"], msg=row)
      self.assertGreater(row["tflops"], 0.0, msg=row)
      self.assertGreater(row["mem_mib"], 0.0, msg=row)
    with open(plot_path, "rb") as f:
      self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

  def test_flops_convention(self):
    run = _load_benchmark()
    shape = run.parse_shape("2,1024,16,128,4")
    self.assertEqual(shape.num_kv_heads, 4)
    forward = 4 * 2 * 16 * 1024**2 * 128
    self.assertEqual(run.flops(shape, False, "fwd"), forward)
    self.assertEqual(run.flops(shape, True, "fwd+bwd"), forward * 0.5 * 3.5)


if __name__ == "__main__":
  absltest.main()
