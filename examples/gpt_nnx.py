"""Example 2: a character-level GPT in Flax NNX, on jflash attention.

Trains a small decoder-only transformer on text that ships with Python (the
docstrings of some standard-library modules; nothing is downloaded), then
generates text with a KV cache. The attention layer is
`jflash.nnx.FlashMultiHeadAttention`, a drop-in subclass of
`flax.nnx.MultiHeadAttention`; `--attention flax` builds the same model on
the stock layer from the same seed, so the two loss curves can be compared
line by line.

Run:
  python examples/gpt_nnx.py                    # GPU sizes; small on CPU
  python examples/gpt_nnx.py --attention flax   # same model, stock attention
  python examples/gpt_nnx.py --tiny --interpret # seconds on CPU, through the
                                                # real kernels (interpreted)

Without a GPU the script shrinks its defaults by itself (and says so); on
CPU jflash then runs its pure-JAX path, or the Pallas kernels through the
interpreter with `--interpret` (slow: keep the sizes tiny).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import time
import warnings
from typing import Any, Sequence

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

import jflash.nnx

# Sizes: tuned for one GPU, shrunk when there is none, and a preset for tests.
GPU_SETTINGS = dict(steps=600, batch=32, seq_len=256, layers=4, dim=192,
                    heads=6, learning_rate=2e-3, generate=200, log_every=50)
CPU_SETTINGS = dict(steps=500, batch=16, seq_len=128, layers=2, dim=64,
                    heads=4, learning_rate=3e-3, generate=100, log_every=50)
TINY_SETTINGS = dict(steps=8, batch=4, seq_len=32, layers=1, dim=32,
                     heads=2, learning_rate=1e-2, generate=16, log_every=1)

# The corpus: docstrings of these modules and of their public classes,
# functions and methods, in a fixed order (about 600 kB on Python 3.12; a
# module missing from the running Python is skipped).
CORPUS_MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "cmd", "code",
    "codecs", "collections", "concurrent.futures", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal",
    "difflib", "dis", "doctest", "email", "email.message", "email.utils",
    "enum", "fnmatch", "fractions", "ftplib", "functools", "getopt", "glob",
    "graphlib", "gzip", "hashlib", "heapq", "hmac", "http.client",
    "http.cookiejar", "http.server", "imaplib", "importlib.metadata",
    "inspect", "ipaddress", "itertools", "json", "logging", "mailbox",
    "mimetypes", "numbers", "optparse", "pathlib", "pdb", "pickle",
    "platform", "plistlib", "poplib", "pprint", "pydoc", "queue", "random",
    "re", "reprlib", "sched", "secrets", "selectors", "shelve", "shlex",
    "shutil", "smtplib", "socket", "statistics", "string", "subprocess",
    "sysconfig", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "trace", "traceback", "types", "typing", "unittest",
    "urllib.parse", "urllib.request", "uuid", "warnings", "weakref",
    "xml.dom.minidom", "xml.etree.ElementTree", "zipfile", "zipimport")

# A fixed vocabulary: newline and printable ASCII; anything else becomes "?".
VOCAB = "\n" + "".join(chr(i) for i in range(32, 127))
CHAR_TO_ID = {c: i for i, c in enumerate(VOCAB)}


def load_corpus() -> str:
  """Returns the standard-library docstrings, deterministically ordered."""
  seen, parts = set(), []

  def add(obj):
    doc = inspect.getdoc(obj)
    if doc and doc not in seen:  # Inherited docstrings appear only once.
      seen.add(doc)
      parts.append(doc)

  for module_name in CORPUS_MODULES:
    try:
      module = importlib.import_module(module_name)
    except ImportError:  # Removed from newer Pythons, or not built here.
      continue
    add(module)
    with warnings.catch_warnings():
      # Reading typing.io / typing.re warns that they are deprecated.
      warnings.simplefilter("ignore", DeprecationWarning)
      add_members(module, add)
  return "\n\n".join(parts)


def add_members(module, add):
  """Calls `add` on the public classes, functions and methods of `module`."""
  for name, obj in sorted(vars(module).items()):
    # Only what the module defines itself (not what it imports).
    if name.startswith("_") or getattr(obj, "__module__", None) != \
        module.__name__:
      continue
    if inspect.isfunction(obj):
      add(obj)
    elif inspect.isclass(obj):
      add(obj)
      for method_name, method in sorted(vars(obj).items()):
        if not method_name.startswith("_") and inspect.isfunction(method):
          add(method)


def encode_text(text: str) -> np.ndarray:
  unknown = CHAR_TO_ID["?"]
  return np.array([CHAR_TO_ID.get(c, unknown) for c in text], np.int32)


def decode_text(ids) -> str:
  return "".join(VOCAB[int(i)] for i in ids)


class Block(nnx.Module):
  """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

  def __init__(self, dim: int, heads: int, kv_heads: int | None, *,
               attention_cls: type[nnx.MultiHeadAttention],
               attention_options: dict[str, Any], rngs: nnx.Rngs):
    self.attention_norm = nnx.LayerNorm(dim, rngs=rngs)
    # Both attention classes take the same arguments and draw the same
    # parameters from `rngs`, so --attention does not change the init.
    self.attention = attention_cls(
        num_heads=heads, in_features=dim, num_kv_heads=kv_heads,
        decode=False, rngs=rngs, **attention_options)
    self.mlp_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.mlp_in = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x: jax.Array, *, decode: bool) -> jax.Array:
    # Training masks causally; a decode step masks by the cache occupancy.
    # (is_causal must be False there: flax <= 0.12.10's stock layer applies
    # it to the 1-token query and then sees only the first cached key.)
    x = x + self.attention(self.attention_norm(x), is_causal=not decode,
                           decode=decode)
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))


class GPT(nnx.Module):
  """Token + learned position embeddings, blocks, tied output head."""

  def __init__(self, *, vocab_size: int, max_len: int, dim: int, layers: int,
               heads: int, kv_heads: int | None, attention: str,
               interpret: bool, rngs: nnx.Rngs):
    if attention == "jflash":
      attention_cls = jflash.nnx.FlashMultiHeadAttention
      attention_options = dict(interpret=interpret)
    else:
      attention_cls, attention_options = nnx.MultiHeadAttention, {}
    self.max_len = max_len
    self.token_embed = nnx.Embed(vocab_size, dim, rngs=rngs)
    self.position_embed = nnx.Embed(max_len, dim, rngs=rngs)
    self.blocks = nnx.List([
        Block(dim, heads, kv_heads, attention_cls=attention_cls,
              attention_options=attention_options, rngs=rngs)
        for _ in range(layers)])
    self.final_norm = nnx.LayerNorm(dim, rngs=rngs)

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               *, decode: bool = False) -> jax.Array:
    """Returns logits [batch, seq_len, vocab] for tokens [batch, seq_len]."""
    if positions is None:
      positions = jnp.arange(tokens.shape[-1])
    # Explicit ranks ([batch or 1, seq, dim]): code that forbids implicit
    # rank promotion runs this model too.
    positions = jnp.broadcast_to(positions, tokens.shape)
    x = self.token_embed(tokens) + self.position_embed(positions)
    for block in self.blocks:
      x = block(x, decode=decode)
    return self.token_embed.attend(self.final_norm(x))

  def init_cache(self, batch: int, dtype=jnp.float32):
    """Empties every layer's KV cache, sized for `max_len` tokens."""
    for block in self.blocks:
      block.attention.init_cache(
          (batch, self.max_len, block.attention.in_features), dtype)


def sequence_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross entropy of one sequence: [T, V], [T] -> []."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, targets).mean()


def sample_batch(data: jax.Array, key: jax.Array, batch: int, seq_len: int):
  """Random windows of `data`: inputs and next-token targets [batch, T]."""
  starts = jax.random.randint(key, (batch,), 0, data.shape[0] - seq_len - 1)
  windows = jax.vmap(
      lambda start: lax.dynamic_slice(data, (start,), (seq_len + 1,)))(starts)
  return windows[:, :-1], windows[:, 1:]


def loss_fn(model: GPT, inputs: jax.Array, targets: jax.Array) -> jax.Array:
  logits = model(inputs)
  # One loss per example, then their mean.
  return jax.vmap(sequence_loss)(logits, targets).mean()


@nnx.jit(static_argnames=("batch", "seq_len"))
def train_step(model, optimizer, data, key, *, batch, seq_len):
  inputs, targets = sample_batch(data, key, batch, seq_len)
  loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets)
  optimizer.update(model, grads)
  return loss


@nnx.jit(static_argnames=("batch", "seq_len"))
def eval_step(model, data, key, *, batch, seq_len):
  return loss_fn(model, *sample_batch(data, key, batch, seq_len))


@nnx.jit
def decode_step(model, token, position, key, temperature):
  """Feeds one token [batch] at `position`; returns its logits and a draw."""
  logits = model(token[:, None], position[None], decode=True)[:, 0]
  greedy = jnp.argmax(logits, axis=-1)
  sampled = jax.random.categorical(
      key, logits / jnp.maximum(temperature, 1e-6), axis=-1)
  return logits, jnp.where(temperature > 0, sampled, greedy)


@nnx.jit
def full_forward(model, tokens):
  return model(tokens)


def generate(model: GPT, prompt: str, num_tokens: int, key: jax.Array,
             temperature: float):
  """Feeds `prompt` token by token through the KV cache, then samples.

  Returns:
    The generated text, the token ids fed to the model (the prompt and all
    generated tokens but the last) and the logits [len(fed), vocab] that the
    cached steps produced for them.
  """
  model.init_cache(batch=1)
  token_ids = list(encode_text(prompt))
  logits_per_step = []
  temperature = jnp.float32(temperature)
  next_token = None
  for position in range(len(token_ids) + num_tokens - 1):
    if position >= len(token_ids):
      token_ids.append(int(next_token[0]))
    key, step_key = jax.random.split(key)
    logits, next_token = decode_step(
        model, jnp.array(token_ids[position:position + 1], jnp.int32),
        jnp.int32(position), step_key, temperature)
    logits_per_step.append(logits[0])
  token_ids.append(int(next_token[0]))
  fed = token_ids[:-1]
  return (decode_text(token_ids[len(prompt):]), np.array(fed, np.int32),
          jnp.stack(logits_per_step))


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      epilog="Sizes left out take the GPU defaults on a GPU, CPU ones "
      "elsewhere, or --tiny's. Progress bars appear only when stderr is a "
      "terminal.")
  parser.add_argument("--attention", choices=("jflash", "flax"),
                      default="jflash",
                      help="jflash.nnx.FlashMultiHeadAttention or Flax's "
                      "stock nnx.MultiHeadAttention (default: %(default)s)")
  parser.add_argument("--interpret", action="store_true",
                      help="run jflash's Pallas kernels through the "
                      "interpreter (any backend; slow)")
  parser.add_argument("--tiny", action="store_true",
                      help="a few steps of a 1-layer model (for tests)")
  parser.add_argument("--steps", type=int, help="training steps")
  parser.add_argument("--batch", type=int, help="sequences per step")
  parser.add_argument("--seq-len", type=int,
                      help="characters per sequence (and the longest "
                      "generation, prompt included)")
  parser.add_argument("--layers", type=int, help="transformer blocks")
  parser.add_argument("--dim", type=int, help="model width")
  parser.add_argument("--heads", type=int, help="query heads")
  parser.add_argument("--kv-heads", type=int,
                      help="key/value heads (GQA); default: --heads")
  parser.add_argument("--learning-rate", type=float,
                      help="peak of the warmup-cosine schedule")
  parser.add_argument("--log-every", type=int,
                      help="steps between logged training and validation "
                      "losses")
  parser.add_argument("--generate", type=int, help="tokens to generate")
  parser.add_argument("--prompt", default="Return the ",
                      help="prompt of the generation (default: "
                      "%(default)r)")
  parser.add_argument("--temperature", type=float, default=0.8,
                      help="sampling temperature; 0 decodes greedily "
                      "(default: %(default)s)")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the parameters, batches and sampling")
  return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Trains, generates and checks the cache; returns what it printed."""
  args = parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  if args.tiny:
    preset, preset_name = TINY_SETTINGS, "--tiny"
  elif on_gpu:
    preset, preset_name = GPU_SETTINGS, "GPU defaults"
  else:
    preset, preset_name = CPU_SETTINGS, "CPU defaults"
    print("No GPU found: falling back to small CPU settings (pass --steps, "
          "--dim, ... to override).")
  for name, value in preset.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  if args.steps < 1 or args.generate < 1:
    raise ValueError(f"--steps and --generate must be positive; got "
                     f"{args.steps=}, {args.generate=}.")
  if not 0 < len(args.prompt) < args.seq_len:
    raise ValueError(f"--prompt must have 1 to seq_len - 1 = "
                     f"{args.seq_len - 1} characters; got {args.prompt!r}.")
  if args.attention == "flax" and args.interpret:
    print("--interpret applies to jflash only; ignored with --attention "
          "flax.")

  device = jax.devices()[0]
  kernels = ("Pallas kernels, interpreted" if args.interpret else
             "Triton kernels" if on_gpu else "pure-JAX path")
  print(f"device: {device.platform} ({device.device_kind})")
  print(f"attention: {args.attention}"
        + (f" ({kernels})" if args.attention == "jflash" else ""))
  print(f"settings ({preset_name}): steps={args.steps} batch={args.batch} "
        f"seq_len={args.seq_len} layers={args.layers} dim={args.dim} "
        f"heads={args.heads} kv_heads={args.kv_heads or args.heads} "
        f"lr={args.learning_rate}")

  text = load_corpus()
  ids = encode_text(text)
  split = int(0.9 * len(ids))
  train_data, valid_data = jnp.asarray(ids[:split]), jnp.asarray(ids[split:])
  print(f"corpus: {len(text):,} characters of standard-library docstrings, "
        f"vocab {len(VOCAB)}; {split:,} train / {len(ids) - split:,} "
        "validation")

  # Built under jit: one compiled program draws every parameter (op by op,
  # each initializer would compile on its own). The values are the same.
  model = nnx.jit(lambda: GPT(
      vocab_size=len(VOCAB), max_len=args.seq_len, dim=args.dim,
      layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
      attention=args.attention, interpret=args.interpret,
      rngs=nnx.Rngs(args.seed)))()
  num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model,
                                                              nnx.Param)))
  print(f"model: {num_params:,} parameters")
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=args.learning_rate / 10, peak_value=args.learning_rate,
      warmup_steps=max(1, args.steps // 10), decay_steps=args.steps,
      end_value=args.learning_rate / 10)
  optimizer = nnx.Optimizer(
      model, optax.chain(optax.clip_by_global_norm(1.0),
                         optax.adamw(schedule, weight_decay=0.1)),
      wrt=nnx.Param)

  key = jax.random.key(args.seed)
  sizes = dict(batch=args.batch, seq_len=args.seq_len)
  losses, curve = [], []
  start = time.perf_counter()
  # A bar only on a terminal: written to a file (`> log 2>&1`), its redraws
  # would interleave with the log lines; those go through tqdm.write, which
  # keeps a live bar below them.
  progress = tqdm.trange(args.steps, desc="training", unit="step",
                         file=sys.stderr, disable=not sys.stderr.isatty())
  for step in progress:
    log = step % args.log_every == 0 or step == args.steps - 1
    if log:  # Same parameters as the training loss: before the update.
      valid_loss = float(eval_step(model, valid_data, jax.random.key(1),
                                   **sizes))  # Always the same windows.
    key, step_key = jax.random.split(key)
    losses.append(train_step(model, optimizer, train_data, step_key, **sizes))
    if log:
      loss = float(losses[-1])
      curve.append((step, loss, valid_loss))
      progress.set_postfix(loss=f"{loss:.4f}")
      tqdm.tqdm.write(f"step {step:5d}  loss {loss:.4f}  validation loss "
                      f"{valid_loss:.4f}")
  progress.close()
  losses = [float(x) for x in losses]
  elapsed = time.perf_counter() - start
  print(f"trained {args.steps} steps in {elapsed:.1f} s (with the "
        "validation and the first step's compilation)")

  # Generation through the KV cache.
  num_tokens = args.generate
  if len(args.prompt) + num_tokens > args.seq_len:
    num_tokens = max(1, args.seq_len - len(args.prompt))
    print(f"generating {num_tokens} tokens, not {args.generate}: the "
          f"position embeddings stop at seq_len={args.seq_len}.")
  sample, fed, cached_logits = generate(
      model, args.prompt, num_tokens, jax.random.key(args.seed + 1),
      args.temperature)
  print(f"--- sample (temperature {args.temperature}) ---")
  print(args.prompt + sample)
  print("---")

  # The cache must reproduce the full-sequence forward pass.
  full_logits = full_forward(model, jnp.asarray(fed)[None])[0]
  last_diff = float(jnp.max(jnp.abs(cached_logits[-1] - full_logits[-1])))
  all_diff = float(jnp.max(jnp.abs(cached_logits - full_logits)))
  print(f"KV-cache decoding vs full forward, {len(fed)} positions: max |diff| "
        f"at the last position {last_diff:.2e}, over all positions "
        f"{all_diff:.2e}")
  if on_gpu and jax.config.jax_default_matmul_precision is None:
    print("(float32 matmuls may run as TF32 on a GPU: set "
          "JAX_DEFAULT_MATMUL_PRECISION=highest for differences near 1e-6)")
  print(f"first loss {losses[0]:.4f} -> last loss {losses[-1]:.4f}")
  return dict(losses=losses, curve=curve, valid_loss=valid_loss,
              sample=sample, decode_last_diff=last_diff,
              decode_max_diff=all_diff)


if __name__ == "__main__":
  main()
