"""Every number of a config is finite and in its range, checked before anything is built.

A NaN learning rate compiles, trains and fails only when the first round's
NaN guard trips (after minutes of compilation), and a negative weight decay or
a temperature of 0 may not fail at all, only train nonsense. The runners
therefore call :func:`check_numbers` first thing in their ``validate``: it
walks every numeric leaf of the config and raises
:class:`~fedjax_mm.runner.errors.ConfigError` naming the first bad key, in one
line, which ``experiments/main.py`` prints with exit status 2.

A *spec* maps a key pattern to a :class:`Range`. Patterns are dotted keys of
the config, with ``[]`` standing for any list element (``users[].train_size``
covers ``users[0].train_size``, ``users[1].train_size``, ...). A numeric leaf
that no pattern names must still be finite, so a field added to a config later
cannot carry a NaN in unnoticed; ``tests/test_runner_validation.py`` checks
that every numeric field of the shipped configs has its own rule. A pattern
whose key the config lacks is skipped (optional keys, e.g. a user's own
``batch_size``), as are ``None`` (an unset optional field such as
``chunk_size``), booleans and strings: the runners' own checks cover presence,
names and relations between fields (``public.size`` a multiple of the batch
size, ``tau_reduced < tau_full``, ...). Only ranges live here.

Typical use::

  def validate(config):
    check_numbers(config, FEDMUSCLE)
    ...  # checks of names and relations
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from fedjax_mm.core.faults import Faults
from fedjax_mm.data import tfds as tfds_data
from fedjax_mm.runner.errors import ConfigError

__all__ = [
  "COUNT",
  "CREAMFL",
  "DATA",
  "FEDMUSCLE",
  "FAULTS",
  "FEDRGB",
  "FEDSCMR",
  "FINITE",
  "FRACTION",
  "NON_NEGATIVE",
  "NON_NEGATIVE_INT",
  "POSITIVE",
  "PRETRAIN",
  "RCSR",
  "Range",
  "WORLD_CAPTION_LEN",
  "WORLD_IMAGE_SIZE",
  "check_client_map",
  "check_data",
  "check_faults",
  "check_methods",
  "check_numbers",
  "check_pretrained",
  "data_source",
  "numeric_fields",
  "read_disjoint",
  "reader",
]


@dataclasses.dataclass(frozen=True)
class Range:
  """The values a numeric field may take: finite, within bounds, maybe integral.

  Attributes:
    low: lower bound (``-inf`` for none).
    high: upper bound (``inf`` for none).
    low_open: exclude ``low`` itself (``> 0`` rather than ``>= 0``).
    integer: the value must be an ``int``.
    high_open: exclude ``high`` itself (``in [0, 1)``: a share that may not be all).
  """

  low: float = -math.inf
  high: float = math.inf
  low_open: bool = False
  integer: bool = False
  high_open: bool = False

  def describe(self) -> str:
    """The bounds as a message says them: ``> 0``, ``>= 1``, ``in [0, 1]``, ``in [0, 1)``."""
    if self.low > -math.inf and self.high < math.inf:
      return (
        f"in {'(' if self.low_open else '['}{_number(self.low)}, "
        f"{_number(self.high)}{')' if self.high_open else ']'}"
      )
    if self.low > -math.inf:
      return f"{'>' if self.low_open else '>='} {_number(self.low)}"
    if self.high < math.inf:
      return f"{'<' if self.high_open else '<='} {_number(self.high)}"
    return "finite"

  def admits(self, value: Any) -> bool:
    """Whether ``value`` is a finite number of this range."""
    if self.integer and not isinstance(value, numbers.Integral):
      return False
    if not math.isfinite(value):
      return False
    above = value > self.low if self.low_open else value >= self.low
    below = value < self.high if self.high_open else value <= self.high
    return above and below


def _number(x: float) -> str:
  return str(int(x)) if float(x).is_integer() else str(x)


#: ``>= 1``, an integer: rounds, epochs, sizes, counts.
COUNT = Range(1, integer=True)
#: ``>= 0``, an integer: seeds, LoRA ranks.
NON_NEGATIVE_INT = Range(0, integer=True)
#: ``> 0``: learning rates, temperatures, concentrations.
POSITIVE = Range(0, low_open=True)
#: ``>= 0``: weight decays, loss weights, noise scales.
NON_NEGATIVE = Range(0)
#: ``in [0, 1]``: shifts, shares.
FRACTION = Range(0, 1)

# ml_collections turns a dotted override into a float or int according to the
# field's type, so ``--config.learning_rate=nan`` arrives as float("nan").
_FINITE = Range()
#: Any finite number: factors that may be negative (a Byzantine scale).
FINITE = _FINITE

#: The embedded world's smallest image and caption (:class:`fedjax_mm.data.world.WorldConfig`
#: refuses less; ``tests/test_runner_validation.py`` holds the two together).
WORLD_IMAGE_SIZE = Range(16, integer=True)
WORLD_CAPTION_LEN = Range(8, integer=True)

#: The ``faults`` block of every system's config (:mod:`fedjax_mm.core.faults`).
FAULTS: dict[str, Range] = {
  "faults.dropout": FRACTION,
  "faults.stragglers": FRACTION,
  "faults.byzantine": FRACTION,
  "faults.byzantine_count": NON_NEGATIVE_INT,
  "faults.byzantine_scale": FINITE,
}

#: The ``data`` block of a config that may read real datasets
#: (:mod:`fedjax_mm.data.tfds`; ``data.limit = 0``: no limit).
DATA: dict[str, Range] = {
  "data.limit": NON_NEGATIVE_INT,
  "data.image_size": COUNT,
  "data.captions_per_image": COUNT,
}

#: The numbers of ``experiments/fedmuscle.py``.
FEDMUSCLE: dict[str, Range] = {
  "seed": NON_NEGATIVE_INT,
  "rounds": COUNT,
  "local_epochs": COUNT,
  "local_batch_size": COUNT,
  "learning_rate": POSITIVE,
  "weight_decay": NON_NEGATIVE,
  "rep_dim": COUNT,
  "test_size": COUNT,
  **{f"test_sizes.{task}": COUNT for task in ("mlc", "ic10", "ic100", "ss", "tc")},
  "checkpoint_every": COUNT,
  "lora_rank": NON_NEGATIVE_INT,
  "users[].train_size": COUNT,
  "users[].batch_size": COUNT,
  "users[].lora_rank": NON_NEGATIVE_INT,
  "public.size": COUNT,
  "public.shift": FRACTION,
  "public.max_objects": Range(1, 9, integer=True),
  "public.min_visible": Range(0, 1, low_open=True, high_open=True),
  "probe.users[]": COUNT,
  "probe.train": Range(2, integer=True),
  "probe.test": COUNT,
  "muscle.num_partners": COUNT,
  "muscle.batch_size": COUNT,
  "muscle.cl_epochs": COUNT,
  "muscle.tau_full": POSITIVE,
  "muscle.tau_reduced": POSITIVE,
  "muscle.chunk_size": COUNT,
  "baselines.sage.threshold": FRACTION,
  "baselines.sage.half_gap": POSITIVE,
  "baselines.sage.weight": NON_NEGATIVE,
  "baselines.sage.temperature": POSITIVE,
  "baselines.sage.min_crop": Range(0, 1, low_open=True),
  "baselines.sage.noise": NON_NEGATIVE,
  "baselines.cofed.margin": FRACTION,
  "baselines.cofed.threshold": FRACTION,
  "baselines.cofed.label_batch_size": COUNT,
  "baselines.feddf.distill_epochs": COUNT,
  "baselines.feddf.temperature": POSITIVE,
  "baselines.fedhenn.eta": NON_NEGATIVE,
  "baselines.fedhenn.rad_size": Range(2, integer=True),
  "baselines.fedrcl.tau": POSITIVE,
  "baselines.fedrcl.threshold": Range(-1, 1),
  "baselines.fedrcl.beta": NON_NEGATIVE,
  "baselines.fedrcl.weight": NON_NEGATIVE,
  "baselines.fedrcl.min_jaccard": FRACTION,
  "baselines.simclr.tau": POSITIVE,
  "baselines.simclr.min_crop": Range(0, 1, low_open=True),
  "baselines.simclr.noise": NON_NEGATIVE,
  "baselines.pseudo_label.step": Range(0, 1, low_open=True),
  "baselines.pseudo_label.label_batch_size": COUNT,
  **DATA,
  **FAULTS,
}

#: The numbers of ``experiments/creamfl.py``.
CREAMFL: dict[str, Range] = {
  "seed": NON_NEGATIVE_INT,
  "rounds": COUNT,
  "eval_every": COUNT,
  "image_size": COUNT,
  "rep_dim": COUNT,
  "alpha": POSITIVE,
  "local_epochs": COUNT,
  "local_batch_size": COUNT,
  "learning_rate": POSITIVE,
  "server_learning_rate": POSITIVE,
  "weight_decay": NON_NEGATIVE,
  "server_weight_decay": NON_NEGATIVE,
  "checkpoint_every": COUNT,
  "devices": COUNT,  # at most this process's devices: check_devices
  "clients.image.num": COUNT,
  "clients.image.train_size": COUNT,
  "clients.text.num": COUNT,
  "clients.text.train_size": COUNT,
  "clients.multimodal.num": COUNT,
  "clients.multimodal.train_size": COUNT,
  "public.size": COUNT,
  "public.shift": FRACTION,
  "test.sizes[]": COUNT,
  "test.shift": FRACTION,
  "test.private_size": NON_NEGATIVE_INT,
  "creamfl.num_selected": COUNT,
  "creamfl.batch_size": COUNT,
  "creamfl.server_temperature": POSITIVE,
  "creamfl.lcr_weight": NON_NEGATIVE,
  "creamfl.inter_temperature": POSITIVE,
  "creamfl.intra_temperature": POSITIVE,
  "creamfl.gca_temperature": POSITIVE,
  "creamfl.distill_weight": NON_NEGATIVE,
  "creamfl.iot_weight": NON_NEGATIVE,
  "creamfl.muscle_partners": COUNT,
  "creamfl.muscle_tau_full": POSITIVE,
  "creamfl.muscle_tau_reduced": POSITIVE,
  "creamfl.gca_chunk_size": COUNT,
  "creamfl.public_batch_size": COUNT,
  "creamfl.fedet_diversity_weight": NON_NEGATIVE,
  "vqa.train_images": COUNT,
  "vqa.test_images": COUNT,
  "vqa.steps": COUNT,
  "vqa.batch_size": COUNT,
  "vqa.learning_rate": POSITIVE,
  "vqa.hidden": COUNT,
  "data.limit": NON_NEGATIVE_INT,
  **FAULTS,
}

#: The numbers of ``experiments/fedscmr.py``.
FEDSCMR: dict[str, Range] = {
  "seed": NON_NEGATIVE_INT,
  "rounds": COUNT,
  "local_epochs": COUNT,
  "batch_size": COUNT,
  "learning_rate": POSITIVE,
  "test_size": COUNT,
  "val_size": COUNT,
  "global_test_size": COUNT,
  "checkpoint_every": COUNT,
  "devices": COUNT,  # at most this process's devices: check_devices
  "clients[].classes": COUNT,
  "clients[].train_size": COUNT,
  "features.image_dim": COUNT,
  "features.image_noise": NON_NEGATIVE,
  "model.hidden": COUNT,
  "model.dim": COUNT,
  "fedscmr.alpha": NON_NEGATIVE,
  "fedscmr.beta": NON_NEGATIVE,
  "fedscmr.gamma": NON_NEGATIVE,  # 0 is the "-Phi" ablation.
  "fedscmr.map_n": COUNT,
  "dscmr.alpha": NON_NEGATIVE,
  "dscmr.beta": NON_NEGATIVE,
  "fedprox_mu": NON_NEGATIVE,
  "fedcmr.split": Range(0, 1, low_open=True),  # before aggregation; the rest after
  "fedcmr.correction": NON_NEGATIVE,
  "ns[]": COUNT,
  **FAULTS,
}


def numeric_fields(config: Any) -> Iterator[tuple[str, str, Any]]:
  """``(key, pattern, value)`` for every numeric leaf of ``config``, in config order.

  ``key`` names the leaf (``users[1].train_size``), ``pattern`` the same with
  list indices replaced by ``[]`` (``users[].train_size``). Booleans are not
  numbers here.

  Args:
    config: an ``ml_collections.ConfigDict`` (or anything with ``to_dict()``)
      or a plain nest of mappings, lists and tuples.
  """
  if callable(getattr(config, "to_dict", None)):
    config = config.to_dict()

  def walk(node: Any, key: str) -> Iterator[tuple[str, str, Any]]:
    if isinstance(node, Mapping):
      for name, child in node.items():
        yield from walk(child, f"{key}.{name}" if key else str(name))
    elif isinstance(node, list | tuple):
      for i, child in enumerate(node):
        yield from walk(child, f"{key}[{i}]")
    elif isinstance(node, numbers.Real) and not isinstance(node, bool):
      yield key, re.sub(r"\[\d+\]", "[]", key), node

  yield from walk(config, "")


def check_numbers(config: Any, spec: Mapping[str, Range]) -> None:
  """Raises :class:`ConfigError` for the first numeric field outside its range.

  Every numeric leaf must be finite; one whose pattern is in ``spec`` must also
  satisfy that :class:`Range`. See the module docstring for patterns and what
  is skipped.

  Example:
    >>> check_numbers({"learning_rate": float("nan")}, {"learning_rate": POSITIVE})
    Traceback (most recent call last):
    ...
    fedjax_mm.runner.errors.ConfigError: learning_rate must be finite and > 0, got nan.

  Args:
    config: the run's config (``ConfigDict`` or nested mappings).
    spec: key pattern -> :class:`Range`, e.g. :data:`FEDMUSCLE`.

  Raises:
    ConfigError: one line naming the key, the rule and the value.
  """
  for key, pattern, value in numeric_fields(config):
    rule = spec.get(pattern, _FINITE)
    if rule.admits(value):
      continue
    bounds = rule.describe()
    if not math.isfinite(value):
      described = "finite" if rule == _FINITE else f"finite and {bounds}"
    elif rule.integer and not isinstance(value, numbers.Integral):
      described = f"an integer {bounds}"
    else:
      described = bounds
    raise ConfigError(f"{key} must be {described}, got {value!r}.")


def check_methods(methods: Iterable[str], known: Iterable[str]) -> tuple[str, ...]:
  """``methods`` (``config.methods``) checked against ``known``, every system's one check.

  Returns them as given. Raises :class:`ConfigError` in one line when the list is
  empty, names a method not in ``known``, or names one twice; a system's own rules
  (FedMuscle's ``local``, CreamFL's parameter rows under faults) come after.

  Example:
    >>> check_methods(("a", "b"), ("a", "b", "c"))
    ('a', 'b')
  """
  methods, known = tuple(methods), tuple(known)
  if not methods:
    raise ConfigError(f"methods is empty; name at least one of {', '.join(known)}.")
  unknown = [m for m in methods if m not in known]
  if unknown:
    raise ConfigError(f"methods: unknown {unknown}; known: {', '.join(known)}.")
  if len(set(methods)) != len(methods):
    raise ConfigError(f"methods: each at most once, got {list(methods)}.")
  return methods


def check_common(
  config: Any, ranges: Mapping[str, Range], methods: Iterable[str], known: Iterable[str]
) -> Faults:
  """What every system's ``validate`` starts with; returns the run's :class:`Faults`.

  In order: every number in its range (:func:`check_numbers` with the system's
  ``ranges``), ``client_map`` (:func:`check_client_map`), the ``faults`` block
  (:func:`check_faults`), and the methods (:func:`check_methods` against
  ``known``, the system's :attr:`~fedjax_mm.runner.loop.System.methods`). A
  system's own checks, between fields, come after.
  """
  check_numbers(config, ranges)
  check_client_map(config)
  faults = check_faults(config)
  check_methods(methods, known)
  return faults


def check_client_map(config: Any) -> str:
  """``config.client_map`` (default ``"auto"``), checked: how the engine batches clients.

  See :func:`fedjax_mm.core.map_clients`; a bad value raises :class:`ConfigError`.
  """
  from fedjax_mm.core.client import parse_client_map  # jax, only when validating

  spec = config.get("client_map", "auto") if callable(getattr(config, "get", None)) else "auto"
  try:
    parse_client_map(spec)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return spec


def check_devices(config: Any) -> int:
  """``config.devices`` (default 1), checked: how many of each process's devices run the clients.

  The runner spreads each group's clients over a mesh of that many devices of
  every process (:func:`fedjax_mm.core.job_mesh`; :func:`mesh_size` in all),
  padding the group to a multiple. It must be an int from 1 to the devices this
  process has, else :class:`ConfigError`.
  """
  import jax  # only when validating

  value = config.get("devices", 1) if callable(getattr(config, "get", None)) else 1
  available = len(jax.local_devices())
  if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= available:
    platform = jax.local_devices()[0].platform
    hint = " (experiments.main --cpu_devices=N makes N of a CPU)" if platform == "cpu" else ""
    raise ConfigError(
      f"devices must be an int in [1, {available}], the {platform} devices of this "
      f"process{hint}, got {value!r}."
    )
  return value


def mesh_size(config: Any) -> tuple[int, str]:
  """The devices the clients spread over, and how to name them in an error.

  ``config.devices`` (checked by :func:`check_devices`) times the processes of
  the job: ``(4, "devices (2) x processes (2) = 4")``, or ``(2, "devices (2)")``
  in a job of one process.
  """
  import jax  # only when validating

  devices, processes = check_devices(config), jax.process_count()
  if processes == 1:
    return devices, f"devices ({devices})"
  size = devices * processes
  return size, f"devices ({devices}) x processes ({processes}) = {size}"


def check_faults(config: Any) -> Faults:
  """The run's :class:`~fedjax_mm.core.faults.Faults` from ``config.faults``, checked.

  A config without a ``faults`` block (one written before faults existed)
  simulates none. The ranges are :data:`FAULTS` (checked by
  :func:`check_numbers` first); this adds the names: unknown keys and an
  unknown ``byzantine_mode`` raise :class:`ConfigError`.
  """
  block = config.get("faults") if callable(getattr(config, "get", None)) else None
  try:
    faults = Faults.from_config(block)
    faults.validate()
  except TypeError as e:
    raise ConfigError(f"faults: {e}.") from None
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return faults


def check_encoder(where: str, name: str, modality: str) -> None:
  """``name`` is a zoo encoder or an ``hf:`` checkpoint that reads ``modality``.

  Raises :class:`ConfigError` naming ``where``: an unknown name, a missing or
  unsupported checkpoint folder, or an encoder of the other modality.
  """
  from fedjax_mm import models  # jax, only when validating

  hf = models.hf.is_hf(name)
  if not hf and name not in models.ENCODERS:
    raise ConfigError(
      f"{where}: unknown encoder {name!r}; known: {', '.join(models.ENCODERS)} or hf:<folder>."
    )
  try:  # a CLIP folder holds both towers: ``modality`` picks one
    found = models.encoder_modality(name, modality if hf else None)
  except ValueError as e:  # HfError
    raise ConfigError(f"{where}: {e}") from None
  if found != modality:
    raise ConfigError(f"{where}: {name!r} encodes {found}, not {modality}.")


def check_pretrained(name: str, key: str, value: Any, *, field: str, instead: str) -> None:
  """The shipped checkpoint ``name`` was pretrained with ``key == value``.

  ``field`` is the config key that sets ``value`` and ``instead`` the other way
  out, for the message: a World-CLIP ``vit_t`` pretrained on 32x32 images does
  not fit a run on 16x16 ones, and its position table would say so only as a
  shape mismatch, after the data is built.

  Raises:
    ConfigError: the checkpoint cannot be read, or records another ``key``.
  """
  from fedjax_mm.models import pretrained  # jax, only when validating

  try:
    found = pretrained.read_config(name).get(key)
  except pretrained.PretrainedError as e:
    raise ConfigError(str(e)) from None
  if found != value:
    raise ConfigError(
      f"{name} was pretrained with {key}={found!r}; set {field}={found!r} or {instead}, "
      f"got {field}={value!r}."
    )


def check_data(config: Any, reads: Iterable[tuple[str, str]] | None = None) -> tuple[str, ...]:
  """The datasets ``config.data`` names, each found prepared where it says; ``()`` for the world.

  A config without a ``data`` block, or with ``data.source = "world"``, trains
  on the embedded world (:mod:`fedjax_mm.data.world`). ``data.source = "tfds"``
  reads TFDS datasets (keys of :data:`fedjax_mm.data.tfds.READERS`) from
  ``data.data_dir`` (``None`` or ``""``: TFDS's default folder). Each split is
  opened (its metadata only, nothing is decoded or downloaded), so a dataset not
  prepared here fails before anything is built.

  Args:
    config: the run's config.
    reads: the ``(dataset, split)`` pairs the runner will read (FedMuscle's come
      from its tasks and public set); None: each of ``data.datasets`` at
      ``data.split`` (default ``"train"``).

  Raises:
    ConfigError: an unknown source or dataset, a dataset not prepared (the
      message names the ``tfds build`` command), tensorflow-datasets missing.
  """
  block = config.get("data") if callable(getattr(config, "get", None)) else None
  if block is None:
    return ()
  source = block.get("source", "world")
  if source == "world":
    return ()
  if source != "tfds":
    raise ConfigError(f"data.source must be 'world' or 'tfds', got {source!r}.")
  if reads is None:
    reads = [(name, block.get("split", "train")) for name in block.get("datasets", ())]
  reads = tuple(dict.fromkeys(reads))
  if not reads:
    raise ConfigError("data.source is 'tfds' but data.datasets names no dataset.")
  for name, split in reads:
    try:
      tfds_data.data_source(name, split=split, data_dir=block.get("data_dir") or None)
    except tfds_data.DatasetError as e:
      raise ConfigError(f"data: {e}") from None
  return tuple(dict.fromkeys(name for name, _ in reads))


#: What FedRGB's and RCSR's configs share: the run's schedule and its clients.
_WORLD_RUN: dict[str, Range] = {
  "seed": NON_NEGATIVE_INT,
  "devices": COUNT,  # at most this process's devices: check_devices
  "rounds": COUNT,
  "eval_every": COUNT,
  "checkpoint_every": COUNT,
  "num_clients": Range(2, integer=True),
  "image_size": WORLD_IMAGE_SIZE,  # a multiple of 4 (the ViTs' patch): the runners' check
  "max_caption_len": WORLD_CAPTION_LEN,
}

#: The numbers of ``experiments/fedrgb.py``.
FEDRGB: dict[str, Range] = {
  **_WORLD_RUN,
  **FAULTS,
  "dirichlet_alpha": POSITIVE,
  "train_per_client": COUNT,
  "test_per_client": COUNT,  # >= gallery: the runner's check
  "gallery": COUNT,
  "ood_test": COUNT,
  "dim": COUNT,
  "batch_size": COUNT,
  "stage1_steps": COUNT,
  "stage2_steps": COUNT,
  "learning_rate": POSITIVE,
  "weight_decay": NON_NEGATIVE,
  "fedrgb.alpha": NON_NEGATIVE,
  "fedrgb.beta": NON_NEGATIVE,
  "fedrgb.gamma": NON_NEGATIVE,
  "fedrgb.rho": NON_NEGATIVE,
  "fedema_tau": POSITIVE,
  "fedx.tau": POSITIVE,
  "fedx.target_tau": POSITIVE,
  "fedx.weight": NON_NEGATIVE,
  "fedmae.mask_ratio": Range(0, 1, low_open=True, high_open=True),
  "fedmae.weight": NON_NEGATIVE,
  "distortion.steps": NON_NEGATIVE_INT,
  "downstream.train": COUNT,
  "downstream.test": COUNT,
  "downstream.fractions[]": Range(0, 1, low_open=True),
  "downstream.steps": NON_NEGATIVE_INT,
  "downstream.batch_size": COUNT,
  "downstream.learning_rate": POSITIVE,
  "segmentation.steps": NON_NEGATIVE_INT,
  "segmentation.batch_size": COUNT,
  "segmentation.learning_rate": POSITIVE,
  "segmentation.width": Range(4, integer=True),  # a multiple of 4: the runner's check
}

#: The numbers of ``experiments/rcsr.py``.
RCSR: dict[str, Range] = {
  **_WORLD_RUN,
  **FAULTS,
  "participation": Range(0, 1, low_open=True),  # C
  "missing_rate": Range(0, 1, high_open=True),  # MR: a client with both modalities stays
  "alpha": POSITIVE,
  "kmeans_k": COUNT,  # at most the pool: the runner's check
  "train_per_client": COUNT,
  "test_per_client": COUNT,
  "global_test": COUNT,
  "public_size": COUNT,
  "adapter_dim": COUNT,
  "head_hidden": COUNT,
  "dim": COUNT,
  "personal_hidden": COUNT,
  "local_epochs": COUNT,
  "batch_size": COUNT,
  "learning_rate": POSITIVE,
  "lr_warmup": NON_NEGATIVE_INT,
  "rcsr.lambda_align": NON_NEGATIVE,
  "rcsr.lambda_s": NON_NEGATIVE,
  "rcsr.router_width": COUNT,  # a multiple of router_heads: the runner's check
  "rcsr.router_layers": NON_NEGATIVE_INT,  # 0: the tokeniser MLP and read-out alone
  "rcsr.router_heads": COUNT,
  "rcsr.warmup_rounds": NON_NEGATIVE_INT,  # T_w
  "rcsr.lambda_p": FRACTION,  # eq. (13): s_k, a share of the personal model
  "rcsr.personal_start": NON_NEGATIVE_INT,  # T_p
  "rcsr.personal_lr_ratio": POSITIVE,
  "rcsr.mfcpl_weight": NON_NEGATIVE,
  "rcsr.mekt_weight": NON_NEGATIVE,
  "rcsr.mekt_temperature": POSITIVE,
  "rcsr.creamfl_weight": NON_NEGATIVE,
  "rcsr.creamfl_ema": Range(0, 1, high_open=True),
}

#: The numbers of ``experiments/pretrain.py`` (its ``epochs.<image encoder>`` are counts
#: too: :func:`fedjax_mm.zoo.pretrain.validate` adds them).
PRETRAIN: dict[str, Range] = {
  "seed": NON_NEGATIVE_INT,
  "web.size": COUNT,  # >= batch_size: the runner's check
  "web.shift": FRACTION,
  "default_epochs": COUNT,
  "distill.weight": NON_NEGATIVE,
  "precondition.public_size": Range(2, integer=True),
  "precondition.public_shift": FRACTION,
  "precondition.k": COUNT,
  "batch_size": COUNT,
  "embed_dim": COUNT,
  "learning_rate": POSITIVE,
  "weight_decay": NON_NEGATIVE,
  "warmup_fraction": Range(0, 1, high_open=True),
  "probe.train": Range(10, integer=True),
  "probe.test": Range(10, integer=True),
  "eval_pairs": Range(10, integer=True),
  "stats_size": Range(2, integer=True),  # <= web.size: the runner's check
}


def data_source(config) -> str:
  """``config.data.source``: ``"world"`` (also for a config without a ``data`` block) or ``"tfds"``."""
  block = config.get("data") if hasattr(config, "get") else None
  return "world" if block is None else block.get("source", "world")


def reader(where: str, name: str) -> tfds_data.Reader:
  """The :class:`~fedjax_mm.data.tfds.Reader` of ``name``; ``where`` names the config key in errors."""
  if name not in tfds_data.READERS:
    raise ConfigError(
      f"{where}: unknown TFDS dataset {name!r}; known: {', '.join(tfds_data.READERS)}."
    )
  return tfds_data.READERS[name]


def read_disjoint(wants, **kwargs) -> dict:
  """:func:`fedjax_mm.data.tfds.read_disjoint`, its refusals (a pool too small to give every
  set an example, a split that cannot be read) as :class:`ConfigError`."""
  try:
    return tfds_data.read_disjoint(wants, **kwargs)
  except tfds_data.DatasetError as e:
    raise ConfigError(str(e)) from None
