"""Every ```python block of README.md runs as pasted, each on its own."""

import os
import re
import traceback

from absl.testing import absltest
from absl.testing import parameterized

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
# A fenced block opened by ```python alone on its line, up to its closing ```.
PYTHON_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$",
                          re.MULTILINE | re.DOTALL)


def python_blocks() -> list[str]:
  with open(README, encoding="utf-8") as f:
    return PYTHON_BLOCK.findall(f.read())


def first_line(code: str) -> str:
  return next((line for line in code.splitlines() if line.strip()), "")


class ReadmeTest(parameterized.TestCase):

  def test_readme_has_python_blocks(self):
    # Without blocks the parameterized test below would pass vacuously.
    self.assertNotEmpty(python_blocks(), msg=f"no ```python block in {README}")

  # Each block runs in a namespace of its own, so a block that uses a name
  # it does not define fails as it would pasted into a fresh interpreter;
  # in this process, not a subprocess, so JAX is imported and started once.
  @parameterized.named_parameters(
      (f"block_{i}", i, code) for i, code in enumerate(python_blocks()))
  def test_block_runs(self, index, code):
    namespace = {"__name__": "__readme__"}
    program = compile(code, f"<README.md python block {index}>", "exec")
    try:
      exec(program, namespace)  # pylint: disable=exec-used
    except Exception as e:  # pylint: disable=broad-exception-caught
      self.fail(f"README block starting {first_line(code)!r} raised "
                f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


if __name__ == "__main__":
  absltest.main()
