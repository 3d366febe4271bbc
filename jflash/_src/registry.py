"""The backends, what each supports (as data), and the choice per pass.

A backend is registered as a `Backend`: a name, its `Capabilities`, the
options it accepts, a function that turns a call and the user's options into
its configuration, and its forward and backward functions. Which backend
runs a pass of a call is decided here, once, before anything is traced:

- `implementation=None`: for each pass separately, the first backend in
  priority order whose capabilities cover the call and that is a default on
  this device (a backend supplying only a forward, or only some options,
  leaves the rest to the next one);
- `implementation="name"`: that backend for both passes, or a
  NotImplementedError naming, in one sentence, what it cannot do.

`jflash.implementations()` lists the backends and their capabilities.

Forward functions return (out, lse2) with lse2 the base-2 log-sum-exp,
float32 [batch, num_heads, q_len] (numerics.py); backward functions take
that residual, so any forward pairs with any backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable
import warnings

import jax

from jflash._src import platform
from jflash._src.spec import BackendOptions
from jflash._src.spec import CallSpec
from jflash._src.tuning.space import TuningSpace

_PLATFORM_NAMES = {"cuda": "a CUDA GPU"}

FORWARD = "forward"
BACKWARD = "backward"
PASSES = (FORWARD, BACKWARD)

# Every mask feature and option a call can use, as capabilities name them.
MASK_FEATURES = ("causal", "bottom_right", "window", "lengths", "segments",
                 "dense_mask")
OPTIONS = ("bias", "soft_cap", "sinks", "alibi", "dropout", "return_lse")


def call_features(spec: CallSpec) -> tuple[frozenset[str], frozenset[str]]:
  """(mask features, options) a call uses, named as in `Capabilities`."""
  mask = spec.mask
  masks = {"causal": mask.is_causal, "bottom_right": mask.bottom_right,
           "window": mask.window is not None, "lengths": mask.has_lengths,
           "segments": mask.has_segments, "dense_mask": mask.has_dense_mask}
  mods = spec.modifiers
  options = {"bias": spec.has_bias,
             "soft_cap": spec.logits_soft_cap is not None,
             "sinks": mods.has_sinks, "alibi": mods.has_alibi,
             "dropout": mods.has_dropout, "return_lse": spec.return_lse}
  return (frozenset(k for k, v in masks.items() if v),
          frozenset(k for k, v in options.items() if v))


@dataclasses.dataclass(frozen=True)
class Capabilities:
  """What a backend can run, per pass.

  Attributes:
    passes: the passes it implements ("forward", "backward").
    dtypes: names of the q/k/v dtypes it takes.
    max_head_dim: the largest head dimension, or None for any.
    mask_features: the mask features it supports (`MASK_FEATURES`).
    options: the options it supports (`OPTIONS`).
    unsupported_together: (pass, features, what) triples: the features
      (mask features or options) it cannot combine in that pass, and how to
      say so, e.g. ("backward", frozenset({"bias", "alibi"}), "`bias`
      together with `alibi_slopes`").
    platforms: JAX platforms it runs on ("cuda", "cpu", ...); None: any.
    interpretable: whether `interpret=True` runs it on any platform.
    fallback_on: platforms where `implementation=None` chooses it only for
      a pass no other backend can run, and warns (the "xla" path on a GPU:
      correct, but it stores the [q_len, kv_len] scores).
    named_only: it runs only when named (`implementation=...`), never
      chosen by `implementation=None`.
    head_dims: the exact head dimensions it takes, or None for any up to
      `max_head_dim`.
    compute_capabilities: on CUDA, the compute capabilities it runs on
      (e.g. "9.0" for Hopper), or None for any.
    max_q_len: the most query rows per sequence it takes, or None.
    max_rows_per_kv_head: the most query rows per kv head (q_len x GQA
      group) it takes, or None.
    default_min_kv_len: `implementation=None` chooses it only for calls
      with at least this many keys per sequence (a backend made for one
      shape of call, such as decoding, where the others are as fast below
      it); None: no such bound. Named, it runs any call it supports.
  """

  passes: frozenset[str]
  dtypes: tuple[str, ...]
  max_head_dim: int | None
  mask_features: frozenset[str]
  options: frozenset[str]
  unsupported_together: tuple[tuple[str, frozenset[str], str], ...] = ()
  platforms: frozenset[str] | None = None
  interpretable: bool = False
  fallback_on: frozenset[str] = frozenset()
  named_only: bool = False
  head_dims: frozenset[int] | None = None
  compute_capabilities: frozenset[str] | None = None
  max_q_len: int | None = None
  max_rows_per_kv_head: int | None = None
  default_min_kv_len: int | None = None

  def describe(self) -> dict[str, Any]:
    """A plain-data summary for users (`jflash.implementations()`)."""
    return {
        "passes": sorted(self.passes, key=PASSES.index),
        "dtypes": list(self.dtypes),
        "max_head_dim": self.max_head_dim,
        "mask_features": sorted(self.mask_features,
                                key=MASK_FEATURES.index),
        "options": sorted(self.options, key=OPTIONS.index),
        "unsupported_together": [
            (pass_, sorted(combo))
            for pass_, combo, _ in self.unsupported_together],
        "platforms": None if self.platforms is None else sorted(
            self.platforms),
        "interpretable": self.interpretable,
        "fallback_on": sorted(self.fallback_on),
        "named_only": self.named_only,
        "head_dims": None if self.head_dims is None else sorted(
            self.head_dims),
        "compute_capabilities": None if self.compute_capabilities is None
        else sorted(self.compute_capabilities),
        "max_q_len": self.max_q_len,
        "max_rows_per_kv_head": self.max_rows_per_kv_head,
        "default_min_kv_len": self.default_min_kv_len,
    }


@dataclasses.dataclass(frozen=True)
class Backend:
  """A registered implementation.

  Attributes:
    name: what `implementation=` calls it.
    capabilities: what it supports.
    configure: (spec, **options) -> its hashable configuration for the
      call, e.g. a frozen dataclass (`TritonConfig.for_call`). It takes as
      keywords the user options it takes (`takes`), each passed only when
      set: `block_sizes` (an instance of `block_sizes_type`) and, where
      its capabilities are `interpretable`, `interpret`. May raise
      ValueError for bad option values.
    forward: (spec, config, operands) -> (out, lse2).
    backward: (spec, config, operands, out, lse2, dout, dlse2 or None) ->
      `spec.Operands` of cotangents (None for non-differentiable operands).
      It takes the probabilities' normalizer from `lse2` and delta =
      rowsum(dout * out) from `out`, never recomputing them: ring attention
      passes the residuals of whole rows with one key shard's operands.
    differentiable: whether its passes are plain JAX that can be
      differentiated again (higher-order derivatives); kernels are not.
    direct: for a backend written in plain differentiable JAX, (spec,
      config, operands) -> out or (out, natural lse), used as is (JAX's
      autodiff, any order, forward mode too) when it runs both passes.
    block_sizes_type: the class of the `block_sizes` it takes (its tiles),
      or None: a call with tiles of another class never runs here.
    tuning: what `jflash.autotune` searches for it, or None (no search).
  """

  name: str
  capabilities: Capabilities
  configure: Callable[..., Any]
  forward: Callable[..., Any] | None
  backward: Callable[..., Any] | None
  differentiable: bool = False
  direct: Callable[..., Any] | None = None
  block_sizes_type: type | None = None
  tuning: TuningSpace | None = None

  @property
  def option_names(self) -> frozenset[str]:
    """The backend keyword arguments of `flash_attention` it takes."""
    return frozenset(
        name for name, taken in (
            ("block_sizes", self.block_sizes_type is not None),
            ("interpret", self.capabilities.interpretable)) if taken)

  def takes(self, options: BackendOptions) -> bool:
    """Whether every option set is one of its own: tiles of its
    `block_sizes_type`, `interpret` where it can be interpreted."""
    tiles = options.block_sizes
    return ((tiles is None or (self.block_sizes_type is not None
                               and isinstance(tiles, self.block_sizes_type)))
            and (not options.interpret or self.capabilities.interpretable))


_REGISTRY: dict[str, Backend] = {}
_PRIORITY: list[str] = []


def register(backend: Backend, *, priority: int | None = None) -> None:
  """Adds a backend; `priority`: its place in the order (default: last)."""
  _REGISTRY[backend.name] = backend
  if backend.name in _PRIORITY:
    _PRIORITY.remove(backend.name)
  _PRIORITY.insert(len(_PRIORITY) if priority is None else priority,
                   backend.name)


def get(name: str) -> Backend:
  return _REGISTRY[name]


def names() -> tuple[str, ...]:
  """Registered backends, in priority order."""
  return tuple(_PRIORITY)


def current_platform() -> str:
  """"cuda" on an NVIDIA GPU, else JAX's default backend ("cpu", ...)."""
  return "cuda" if platform.cuda_gpu_available() else jax.default_backend()


def unsupported_reason(backend: Backend, spec: CallSpec, pass_: str,
                       options: dict[str, Any]) -> str | None:
  """Why `backend` cannot run `pass_` of the call, in one sentence, or None.

  Args:
    backend: the candidate.
    spec: the call.
    pass_: "forward" or "backward".
    options: the user's backend options that are set (e.g. interpret).
  """
  caps, name = backend.capabilities, backend.name
  if pass_ not in caps.passes:
    return f"{name} has no {pass_} pass."
  where = current_platform()
  interpreted = caps.interpretable and options.get("interpret", False)
  if (caps.platforms is not None and where not in caps.platforms
      and not interpreted):
    needs = " or ".join(_PLATFORM_NAMES.get(p, p) for p in
                        sorted(caps.platforms))
    hint = ("; pass interpret=True to run its kernels through the Pallas "
            "interpreter" if caps.interpretable else "")
    return (f"{name} needs {needs}, and JAX's default backend is "
            f"{jax.default_backend()!r}{hint}.")
  capability = platform.cuda_compute_capability()
  if (caps.compute_capabilities is not None and not interpreted
      and capability not in caps.compute_capabilities):
    return (f"{name} needs a GPU of compute capability "
            f"{' or '.join(sorted(caps.compute_capabilities))}; this one "
            f"is {capability}.")
  if spec.dtype not in caps.dtypes:
    return (f"{name} supports dtypes {', '.join(caps.dtypes)}; got "
            f"{spec.dtype}.")
  if caps.max_head_dim is not None and spec.head_dim > caps.max_head_dim:
    return (f"{name} supports head_dim <= {caps.max_head_dim}; got "
            f"head_dim={spec.head_dim}.")
  if caps.head_dims is not None and spec.head_dim not in caps.head_dims:
    return (f"{name} supports head_dim in "
            f"{{{', '.join(map(str, sorted(caps.head_dims)))}}}; got "
            f"head_dim={spec.head_dim}.")
  if caps.max_q_len is not None and spec.q_len > caps.max_q_len:
    return (f"{name} takes at most {caps.max_q_len} query rows per "
            f"sequence; got q_len={spec.q_len}.")
  rows = spec.q_len * spec.group
  if (caps.max_rows_per_kv_head is not None
      and rows > caps.max_rows_per_kv_head):
    return (f"{name} takes at most {caps.max_rows_per_kv_head} query rows "
            f"per kv head (q_len x group); got {spec.q_len} x "
            f"{spec.group} = {rows}.")
  masks, opts = call_features(spec)
  missing = sorted((masks - caps.mask_features) | (opts - caps.options))
  if missing:
    return f"{name} does not support {', '.join(missing)}."
  for combo_pass, combo, reason in caps.unsupported_together:
    if combo_pass == pass_ and combo <= masks | opts:
      return f"{name}'s {pass_} pass does not support {reason}."
  return None


def _is_default_here(backend: Backend, spec: CallSpec | None = None) -> bool:
  caps = backend.capabilities
  if (spec is not None and caps.default_min_kv_len is not None
      and spec.kv_len < caps.default_min_kv_len):
    return False
  return not caps.named_only and current_platform() not in caps.fallback_on


def _is_fallback_here(backend: Backend) -> bool:
  caps = backend.capabilities
  return not caps.named_only and current_platform() in caps.fallback_on


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which backend runs each pass, with its configuration (hashable).

  `backward` is None when the named implementation cannot run the backward
  pass of the call: differentiating it raises `backward_error`.
  """

  forward: str
  forward_config: Any
  backward: str | None
  backward_config: Any
  backward_error: str | None = None


def plan(spec: CallSpec, implementation: str | None,
         options: BackendOptions) -> Plan:
  """Chooses the backend of each pass.

  Args:
    spec: the call.
    implementation: a backend's name, or None to choose.
    options: the user's backend options.

  Raises:
    ValueError: for an unknown implementation, or options the named backend
      does not take.
    NotImplementedError: when no backend (or not the named one) can run a
      pass, with the reason in one sentence per candidate.
  """
  # `unsupported_reason` reads the options set by name ("interpret").
  given = options.given()
  if implementation is not None:
    if implementation not in _REGISTRY:
      raise ValueError(f"implementation must be one of {names()} or None; "
                       f"got {implementation!r}.")
    backend = _REGISTRY[implementation]
    for option, value in given.items():
      alone = BackendOptions(**{option: value})
      if not backend.takes(alone):
        owners = [n for n in names() if get(n).takes(alone)]
        raise ValueError(
            f"{option} ({type(value).__name__}) configures the "
            f"{'/'.join(owners) or 'no'} backend; it cannot be combined with "
            f"implementation={implementation!r}.")
    candidates = [backend]
  else:
    candidates = [get(n) for n in names() if get(n).takes(options)]
  chosen = {}
  backward_error = None
  for pass_ in PASSES:
    if implementation is not None:
      reason = unsupported_reason(candidates[0], spec, pass_, given)
      error = reason and (
          f"jflash.flash_attention: implementation={implementation!r} "
          f"cannot run the {pass_} pass of this call: {reason}")
      if error and pass_ == FORWARD:
        raise NotImplementedError(error)
      if error:
        # The forward runs; differentiating the call raises this (a named
        # forward-only backend serves calls that are never differentiated).
        backward_error = error
        chosen[pass_] = None
        continue
      chosen[pass_] = candidates[0]
      continue
    chosen[pass_], reasons = _first_supporting(
        [b for b in candidates if _is_default_here(b, spec)], spec, pass_,
        given)
    if chosen[pass_] is None:
      chosen[pass_], more = _first_supporting(
          [b for b in candidates if _is_fallback_here(b)], spec, pass_,
          given)
      if chosen[pass_] is None:
        raise NotImplementedError(
            f"jflash.flash_attention: no implementation can run the {pass_} "
            f"pass of this call: {' '.join(reasons + more)}")
      warnings.warn(
          f"jflash.flash_attention: running the {pass_} pass on the "
          f"{chosen[pass_].name!r} fallback: {' '.join(reasons)}",
          stacklevel=4)
  configs = {None: None}
  for backend in chosen.values():
    if backend is not None:
      # Every option set is the backend's own (`takes`).
      configs[backend.name] = backend.configure(spec, **given)
  backward = chosen[BACKWARD] and chosen[BACKWARD].name
  return Plan(forward=chosen[FORWARD].name,
              forward_config=configs[chosen[FORWARD].name],
              backward=backward, backward_config=configs[backward],
              backward_error=backward_error)


def _first_supporting(backends, spec, pass_, options):
  """(first backend that can run the pass or None, reasons of the rest)."""
  reasons = []
  for backend in backends:
    reason = unsupported_reason(backend, spec, pass_, options)
    if reason is None:
      return backend, reasons
    reasons.append(reason)
  return None, reasons


def implementations() -> list[dict[str, Any]]:
  """The registered backends, in priority order, and what each supports.

  Returns:
    One dict per backend: "name"; "available": whether it can run on this
    machine (without `interpret`); "default_here": whether
    `implementation=None` may choose it on this machine; "arguments": the
    backend-specific keyword arguments of `flash_attention` it takes; and
    its capabilities (`Capabilities.describe`).
  """
  result = []
  for name in names():
    backend = get(name)
    caps = backend.capabilities
    available = (caps.platforms is None
                 or current_platform() in caps.platforms) and (
                     caps.compute_capabilities is None
                     or platform.cuda_compute_capability()
                     in caps.compute_capabilities)
    result.append(dict(
        name=name, available=available,
        default_here=available and _is_default_here(backend),
        arguments=sorted(backend.option_names), **caps.describe()))
  return result
