"""The FedMuscle experiment: users, data, each round's metrics, the report.

``run(config, workdir)`` is what ``python -m experiments.main
--config=experiments/fedmuscle.py`` calls: :func:`fedjax_mm.runner.loop.run`
of :func:`experiment`, which trains every method of ``config.methods``
(default FedMuscle and local training; also the Table 1 baselines SAGE,
CoFED, FedDF, FedHeNN, FedRCL, SimCLR and Curriculum Labeling, :data:`METHODS`) side by side, from the same initial
models and the same data and seeds, for ``config.rounds`` rounds (workdir,
checkpoints, resume, NaN guard, ledger and the files written are the loop's).
Each round is one jitted call per method (compiled once); after every round
every user is evaluated on its own test set. At the end it prints and writes
the paper-style table (Table 1): per user its model, task, metric, one column
per method (and the relative gain when a single method faces local training)
beside the trivial baseline, each method's Delta against local training, the
bytes each FedMuscle user sends and receives per round under both downlink
protocols, and the wall time.

The users' sets and the public set come from ``config.data.source``: the
embedded world (``"world"``, the default: one seeded pool per task, cut in
disjoint slices) or the papers' datasets through TFDS (``"tfds"``:
:func:`_tfds_sets`; each task's dataset in ``data.tasks``, the public set's in
``data.public``, at most ``data.limit`` examples read of any split). A TFDS run
also writes what each set got (``results.json`` ``"data"``, a report section).

Everything is validated before anything is compiled: a bad config raises
:class:`ConfigError` with a one-line message (``experiments/main.py`` prints
it and exits with status 2).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from fedjax_mm import core, data, metrics, models
from fedjax_mm.algorithms import (
  cofed,
  feddf,
  fedhenn,
  fedmuscle,
  fedrcl,
  local_training,
  pseudo_label,
  sage,
  simclr,
)
from fedjax_mm.core import ledger as ledger_lib
from fedjax_mm.data import tfds as tfds_data
from fedjax_mm.runner import cost as cost_lib
from fedjax_mm.runner import loop, validation
from fedjax_mm.runner import report as report_lib
from fedjax_mm.runner import text as text_lib
from fedjax_mm.runner.errors import ConfigError
from fedjax_mm.runner.tfds_sets import data_source, read_disjoint
from fedjax_mm.runner.tfds_sets import reader as _reader
from fedjax_mm.runner.writers import metric_series

#: Task name -> (kind, input key, target key, outputs on the world, head). With
#: ``data.source = "tfds"`` the outputs are the classes of the task's dataset
#: (:func:`_outputs`).
TASKS: dict[str, tuple[str, str, str, int, str]] = {
  "mlc": ("multilabel", "image", "multilabel", data.NUM_SHAPES, "mlp"),
  "ic10": ("classification", "image", "label10", 10, "mlp"),
  "ic100": ("classification", "image", "label100", 100, "mlp"),
  "ss": ("segmentation", "image", "mask", data.NUM_SEG_CLASSES, "segmentation"),
  "tc": ("classification", "caption", "caption_label", data.NUM_COLORS, "linear"),
}
#: Every method ``config.methods`` may name, in the report's column order.
METHODS = (
  "fedmuscle",
  "sage",
  "cofed",
  "feddf",
  "fedhenn",
  "fedrcl",
  "simclr",
  "pseudo_label",
  "local",
)
#: The report's names of the methods (FedMuscle's adds its loss).
LABELS = {
  "sage": "SAGE",
  "cofed": "CoFED",
  "feddf": "FedDF",
  "fedhenn": "FedHeNN",
  "fedrcl": "FedRCL",
  "simclr": "SimCLR (alone)",
  "pseudo_label": "Curriculum Labeling (alone)",
  "local": "local",
}
#: How the report's per-method ledger counts (see :func:`_baseline_bytes`).
BYTES_NOTE = (
  "FedMuscle: representations up, the partners' terms down (per CL batch). SAGE: the "
  "parameters a user averages within its task (its head; everything trained with an "
  "architecture partner) up and their average down, for users with a partner in their task. "
  "CoFED: int32 votes on the public set up (a class per head, -1 if not confident) and "
  "int32 pseudo-labels down. FedDF / FedRCL: "
  "trained parameters up and the fused ones down, for users that have a partner to average "
  "or distil with (the others send nothing). FedHeNN: one R x R kernel each way. SimCLR and "
  "Curriculum Labeling train each user alone: nothing."
)
#: What ``config.methods`` runs when the config has no such key.
DEFAULT_METHODS = ("fedmuscle", "local")
#: The metrics.jsonl keys of per-user values a method's round reports (``<user>/<key>``):
#: losses, and the share of the public set a pseudo-labelling user trained on (SAGE: whose
#: pseudo-label counted).
USER_LOSSES = ("cl_loss", "distill_loss", "cka_distance", "pseudo_loss", "kept")
#: The public set's key of each modality.
_MODALITY_KEY = {"image": "image", "text": "caption"}
#: How a user with a pretrained encoder fine-tunes (``config.fine_tune``, or a
#: user's own ``fine_tune``): "adapters" freezes the encoder's base and trains
#: LoRA adapters where it has dense layers (none in a CNN) plus the projector and
#: head; "full" trains every parameter. From scratch, every parameter trains.
FINE_TUNE = ("adapters", "full")


@dataclasses.dataclass(frozen=True)
class User:
  """One user as the report names it."""

  index: int
  encoder: str
  task: str

  @property
  def name(self) -> str:
    return f"user {self.index + 1}"


def methods_of(config) -> tuple[str, ...]:
  """``config.methods`` (a comma-separated string or a tuple) in report order, checked.

  Raises :class:`ConfigError` for an unknown or repeated name, or a list
  without ``local`` (every Delta is measured against it).
  """
  spec = config.get("methods", DEFAULT_METHODS) if hasattr(config, "get") else DEFAULT_METHODS
  if isinstance(spec, str):  # "a,b" or a tuple's repr, "('a', 'b')"
    spec = spec.strip("()[] ").split(",")
  names = [str(m).strip().strip("'\"") for m in spec]
  names = validation.check_methods([m for m in names if m], METHODS)
  if "local" not in names or len(names) < 2:
    raise ConfigError(
      "methods must include local and at least one other method (Delta is measured against local)."
    )
  return tuple(m for m in METHODS if m in names)


def validate(config) -> tuple[User, ...]:
  """Checks a config; returns its users. Raises :class:`ConfigError`."""
  validation.check_numbers(config, validation.FEDMUSCLE)
  validation.check_client_map(config)
  test_sizes(config)
  faults = validation.check_faults(config)
  methods = methods_of(config)
  if faults.enabled and set(methods) - {"fedmuscle", "local"}:
    raise ConfigError("faults are simulated for fedmuscle (and local) only; drop the baselines.")
  public = tuple(config.public.modalities)
  unknown = [m for m in public if m not in _MODALITY_KEY]
  if unknown or not public or len(set(public)) != len(public):
    raise ConfigError(
      f"public.modalities must name one or both of {', '.join(_MODALITY_KEY)}, each once, got "
      f"{public}."
    )
  users = tuple(User(i, u["encoder"], u["task"]) for i, u in enumerate(config.users))
  if len(users) < 2:
    raise ConfigError(f"FedMuscle needs at least 2 users, the config has {len(users)}.")
  for u in users:
    if u.task not in TASKS:
      raise ConfigError(f"{u.name}: unknown task {u.task!r}; known: {', '.join(TASKS)}.")
    modality = "text" if TASKS[u.task][1] == "caption" else "image"
    validation.check_encoder(f"{u.name} (task {u.task!r})", u.encoder, modality)
    if modality not in config.public.modalities:
      raise ConfigError(
        f"{u.name} needs {modality} in the public set, which has only {tuple(config.public.modalities)}."
      )
  try:
    _muscle_config(config).validate(len(users))
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if config.public.size < config.muscle.batch_size:
    raise ConfigError(
      f"public.size ({config.public.size}) is smaller than one batch (muscle.batch_size={config.muscle.batch_size})."
    )
  rad_size = _baseline_config(config, "fedhenn").get("rad_size", fedhenn.FedHeNNConfig.rad_size)
  if "fedhenn" in methods and config.public.size < rad_size:
    raise ConfigError(
      f"public.size ({config.public.size}) is smaller than FedHeNN's alignment set "
      f"(baselines.fedhenn.rad_size={rad_size})."
    )
  if (
    data_source(config) != "world"
    and data.WorldConfig(**_public_scenes(config)) != data.WorldConfig()
  ):
    raise ConfigError(
      "public.max_objects and public.min_visible apply to the world's public set only "
      f"(data.source='world'); data.source is {data_source(config)!r}."
    )
  if config.rounds < 1:
    raise ConfigError(f"rounds must be >= 1, got {config.rounds}.")
  if not isinstance(config.lora_rank, int) or config.lora_rank < 0:
    raise ConfigError(f"lora_rank must be an int >= 0, got {config.lora_rank!r}.")
  for u in users:
    if _fine_tune(config, config.users[u.index]) not in FINE_TUNE:
      raise ConfigError(
        f"{u.name}: fine_tune must be one of {', '.join(FINE_TUNE)}, "
        f"got {_fine_tune(config, config.users[u.index])!r}."
      )
  for u in users:
    spec = config.users[u.index]
    checkpoint = _pretrained(config, spec, u.encoder)
    if not isinstance(spec.get("standardize", config.get("standardize", False)), bool):
      raise ConfigError(f"{u.name}: standardize must be True or False.")
    if checkpoint:
      try:
        models.pretrained.resolve(checkpoint)
        if _standardize(config, spec, u.encoder):
          models.pretrained.read_feature_stats(checkpoint)
      except models.pretrained.PretrainedError as e:
        raise ConfigError(f"{u.name}: {e}") from None
  # Last, so a missing checkpoint is named first; still before anything is built.
  tfds = data_source(config) == "tfds"
  validation.check_data(config, _tfds_reads(config, users, methods) if tfds else None)
  for u in unaligned_users(config, users):
    logging.warning(
      "%s (%s/%s): its segmentation head reads the frozen %s's feature map, which has no "
      "LoRA adapters, so FedMuscle cannot change its predictions; use an encoder with "
      "adapters (vit_*, hf:) or fine_tune='full' for it.",
      u.name,
      u.encoder,
      u.task,
      u.encoder,
    )
  return users


def test_sizes(config) -> dict[str, int]:
  """Each task's test set size: ``config.test_sizes.<task>``, or ``config.test_size`` where unset.

  The paper tests each task on its own number of samples; ``test_sizes`` maps a task of
  :data:`TASKS` to a positive int (None, or a config without the block: ``test_size``).
  Raises :class:`ConfigError` for an unknown task or a size that is not a positive int.
  """
  block = config.get("test_sizes") if hasattr(config, "get") else None
  given = {} if block is None else dict(block.to_dict() if hasattr(block, "to_dict") else block)
  unknown = sorted(set(given) - set(TASKS))
  if unknown:
    raise ConfigError(
      f"test_sizes: unknown task {', '.join(map(repr, unknown))}; known: {', '.join(TASKS)}."
    )
  for task, size in given.items():
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
      raise ConfigError(f"test_sizes.{task} must be an int >= 1 (or None), got {size!r}.")
  return {t: config.test_size if given.get(t) is None else given[t] for t in TASKS}


def _tfds_reads(config, users: Sequence[User], methods: Sequence[str]) -> list[tuple[str, str]]:
  """The ``(dataset, split)`` pairs a ``data.source = "tfds"`` run reads, checked.

  Each task reads ``data.tasks.<task>``'s train and test splits
  (:attr:`~fedjax_mm.data.tfds.Reader.splits`), which must hold the task's input
  and target keys; the public set reads ``data.public``'s train split, which must
  hold every modality of ``public.modalities``. Raises :class:`ConfigError`.
  """
  block = config.data
  if "cofed" in methods:  # its statements are the world's class hierarchy
    raise ConfigError(
      "cofed votes through the world's classes: it cannot run with data.source='tfds'."
    )
  reads = []
  for task in sorted({u.task for u in users}):
    _, input_key, target_key, _, _ = TASKS[task]
    name = block.get("tasks", {}).get(task) or ""
    if not name:
      raise ConfigError(f"data.tasks.{task} names no dataset for the {task} users.")
    reader = _reader(f"data.tasks.{task}", name)
    if target_key not in reader.classes or input_key not in reader.keys:
      raise ConfigError(
        f"data.tasks.{task}: {name} has no {input_key!r} and {target_key!r} for the {task} "
        f"task (it gives {', '.join(reader.keys)})."
      )
    reads += [(name, split) for split in reader.splits]
  reader = _reader("data.public", block.get("public", ""))
  for m in config.public.modalities:
    if _MODALITY_KEY[m] not in reader.keys:
      raise ConfigError(
        f"data.public: {block.public} has no {m} for the public set (it gives "
        f"{', '.join(reader.keys)})."
      )
  reads.append((block.public, reader.splits[0]))
  spaces = text_spaces(users)
  texts = bool(spaces) or "text" in config.public.modalities
  if texts and (not spaces or None in spaces):
    raise ConfigError(
      "data.source='tfds' reads English text, which needs the tokenizer of an hf: text "
      "encoder: give every text user one (or drop text from public.modalities)."
    )
  return reads


def _reads_text(u: User) -> bool:
  return TASKS[u.task][1] == "caption"


def text_spaces(users: Sequence[User]) -> tuple[str | None, ...]:
  """The token spaces the text users read (:func:`fedjax_mm.runner.text.token_spaces`).

  Each is held as its own tokenisation of the same captions, the public set's once per
  space; None is the world's ids, a checkpoint's name its tokenizer's.
  """
  return text_lib.token_spaces(u.encoder for u in users if _reads_text(u))


def _own_captions(u: User, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A text user's set with the captions of its own token space only (others' dropped)."""
  if not _reads_text(u):
    return arrays
  own = text_lib.caption_key(text_lib.token_space(u.encoder))
  return {k: v for k, v in arrays.items() if k == own or not core.tasks.is_caption_key(k)}


def _muscle_config(config) -> fedmuscle.MuscleConfig:
  return fedmuscle.MuscleConfig(**config.muscle.to_dict())


def _user_data(config, users: Sequence[User]):
  """Per-user train/test sets (disjoint, uniform split per task) and the public set.

  From the world (:func:`_world_sets`) or, with ``data.source = "tfds"``, from
  the papers' datasets (:func:`_tfds_sets`).
  """
  sets = _tfds_sets if data_source(config) == "tfds" else _world_sets
  train, test, public = sets(config, users)
  keys = []
  for m in config.public.modalities:
    if m == "text":  # once per token space the text users read (the world's if none)
      keys += [text_lib.caption_key(s) for s in text_spaces(users) or (None,)]
    else:
      keys.append(_MODALITY_KEY[m])
  public = {k: jnp.asarray(public[k]) for k in keys}
  return dict(sorted(train)), dict(sorted(test)), public


def _public_scenes(config) -> dict[str, Any]:
  """The public scenes' :class:`~fedjax_mm.data.WorldConfig` fields that the config sets.

  ``public.max_objects`` and ``public.min_visible`` (the world's defaults, 3 and 0.4,
  where a config lacks them: the users' scenes).
  """
  world = data.WorldConfig()
  return {
    "max_objects": int(config.public.get("max_objects", world.max_objects)),
    "min_visible_fraction": float(config.public.get("min_visible", world.min_visible_fraction)),
  }


def _world_sets(config, users: Sequence[User]):
  """``(train, test, public)`` drawn from the world: one pool per task, cut in disjoint slices."""
  seed = config.seed
  train, test = [], []
  by_task: dict[str, list[User]] = {}
  for u in users:
    by_task.setdefault(u.task, []).append(u)
  for t, (task, members) in enumerate(sorted(by_task.items())):
    sizes = [config.users[u.index]["train_size"] for u in members]
    test_size = test_sizes(config)[task]
    pool = data.generate(seed * 1000 + 10 + t, sum(sizes) + test_size * len(members))
    start = 0
    for u, n in zip(members, sizes, strict=True):
      train.append((u.index, data.take(pool, np.arange(start, start + n))))
      start += n
    for u in members:
      test.append((u.index, data.take(pool, np.arange(start, start + test_size))))
      start += test_size
  scenes = data.WorldConfig(**_public_scenes(config))
  try:
    public = data.generate(
      seed * 1000 + 1, config.public.size, config=scenes, shift=config.public.shift
    )
  except RuntimeError as e:  # the objects do not fit: a config error, said in one line
    raise ConfigError(f"public.max_objects / public.min_visible: {e}") from None
  # Each text user's captions in its own token space; the public set's in every one read.
  space = {u.index: (text_lib.token_space(u.encoder),) for u in users if _reads_text(u)}
  train = [(i, text_lib.in_spaces(d, space.get(i, ()))) for i, d in train]
  test = [(i, text_lib.in_spaces(d, space.get(i, ()))) for i, d in test]
  public = text_lib.in_spaces(public, text_spaces(users))
  return train, test, public


def _tfds_sets(config, users: Sequence[User]):
  """``(train, test, public)`` read through TFDS (:mod:`fedjax_mm.data.tfds`).

  Every ``(dataset, split)`` is read once. Its first ``data.limit`` examples (0:
  all) form a pool, shuffled by a key of the seed, the dataset and the split; the
  users of a task take consecutive, disjoint slices of it (their ``train_size``
  from the task's train split, its task's test size (:func:`test_sizes`) from its
  test split), and the public
  set (``public.size``) the next slice of ``data.public``'s train split, so it
  shares no example with a task that reads the same split. A pool smaller than
  what is asked of it is shared in proportion (each set at least one example:
  else :class:`ConfigError`). Images are resized to ``data.image_size``; text
  goes through the tokenizer of every hf: checkpoint the text users read, each
  under its own key (:func:`fedjax_mm.runner.text.caption_key`; a text user
  keeps its own), from one read of the dataset.
  """
  block = config.data
  data_dir, limit = block.get("data_dir") or None, block.get("limit") or None
  spaces = text_spaces(users)  # checkpoints only: _tfds_reads refuses the world's ids
  tokenizer = text_lib.joint_tokenizer(spaces) if spaces else None
  wants: dict[tuple[str, str], list[tuple[tuple[str, int], int]]] = {}
  by_task: dict[str, list[User]] = {}
  for u in users:
    by_task.setdefault(u.task, []).append(u)
  for task, members in sorted(by_task.items()):
    name = block.tasks[task]
    train_split, test_split = tfds_data.READERS[name].splits
    for u in members:
      size = config.users[u.index]["train_size"]
      wants.setdefault((name, train_split), []).append((("train", u.index), size))
    for u in members:
      size = test_sizes(config)[task]
      wants.setdefault((name, test_split), []).append((("test", u.index), size))
  public_read = (block.public, tfds_data.READERS[block.public].splits[0])
  wants.setdefault(public_read, []).append((("public", -1), config.public.size))

  def reads_text(name, split):
    texts = name in tfds_data.NEEDS_TOKENIZER or (
      (name, split) == public_read and "text" in config.public.modalities
    )
    return tokenizer if texts else None

  sets = read_disjoint(
    wants,
    seed=config.seed,
    data_dir=data_dir,
    limit=limit,
    image_size=block.image_size,
    tokenizer=reads_text,
  )
  sets = {who: text_lib.split_joint(arrays, spaces) for who, arrays in sets.items()}
  public = sets.pop(("public", -1))
  num_public = len(public["image" if "image" in public else "caption"])
  needed = {"one batch (muscle.batch_size)": config.muscle.batch_size}
  if "fedhenn" in methods_of(config):
    needed["FedHeNN's alignment set"] = _baseline_config(config, "fedhenn").get(
      "rad_size", fedhenn.FedHeNNConfig.rad_size
    )
  for what, n in needed.items():
    if num_public < n:
      raise ConfigError(
        f"the public set read has {num_public} examples (data.limit={block.limit}), fewer "
        f"than {what}: {n}."
      )
  train = [(i, _own_captions(users[i], d)) for (kind, i), d in sets.items() if kind == "train"]
  test = [(i, _own_captions(users[i], d)) for (kind, i), d in sets.items() if kind == "test"]
  return train, test, public


def build(config):
  """Validated users, groups, initial states, data and the public set."""
  users = validate(config)
  train, test, public = _user_data(config, users)
  root = jax.random.key(config.seed)
  groups, states, train_data, test_data = [], [], [], []
  for u in users:
    spec = config.users[u.index]
    model_config = _model_config(config, u)
    frozen_base = _frozen_base(config, u)
    tx = optax.adamw(config.learning_rate, weight_decay=config.weight_decay)
    group, state = core.init_group(
      lambda rngs, c=model_config: models.build(c, rngs=rngs),
      name=f"{u.name} ({u.encoder}/{u.task})",
      tx=tx,
      task=_task(u, config),
      key=jax.random.fold_in(root, u.index),
      num_clients=1,
      trainable=models.trainable_filter(lora=frozen_base),
      local_epochs=config.local_epochs,
      batch_size=spec.get("batch_size", config.local_batch_size),
      client_map=validation.check_client_map(config),
    )
    groups.append(group)
    states.append(state)
    for source, sink in ((train, train_data), (test, test_data)):
      stacked, mask = data.stack_clients([source[u.index]])
      sink.append(core.make_client_data(stacked, mask, user_ids=np.array([u.index])))
  # What each user's metric is without looking at the input (majority class,
  # every label present, majority pixel class): the floor beside every score.
  trivial = tuple(
    float(
      g.task.trivial_metric(train[u.index][g.task.target_key], test[u.index][g.task.target_key])
    )
    for u, g in zip(users, groups, strict=True)
  )
  return users, tuple(groups), tuple(states), tuple(train_data), tuple(test_data), public, trivial


def _fine_tune(config, spec) -> str:
  """How a pretrained user fine-tunes: a user's own ``fine_tune`` key wins."""
  return spec.get("fine_tune", config.get("fine_tune", "adapters"))


def _frozen_base(config, u: User) -> bool:
  """Whether a user's encoder base stays frozen: pretrained, fine-tuned with "adapters".

  LoRA adapters train where the encoder has dense layers; a CNN has none, so
  its projector and head train alone.
  """
  spec = config.users[u.index]
  pretrained = bool(_pretrained(config, spec, u.encoder)) or models.hf.is_hf(u.encoder)
  return pretrained and _fine_tune(config, spec) == "adapters"


def unaligned_users(config, users: Sequence[User]) -> tuple[User, ...]:
  """Users whose predictions the contrastive epochs cannot change.

  The Muscle loss trains what lies under the representation ``z``: LoRA adapters
  and the projector (a frozen base), or the whole encoder. A head that reads
  ``z`` (classification, multi-label) always sees that change. A segmentation
  head reads the encoder's feature map, under the projector: on a frozen base
  with no adapters (a CNN, which has no dense layers for LoRA) nothing it reads
  ever trains in the contrastive epochs, so the user's FedMuscle scores equal its
  local training's. The paper's segmentation users are SegFormers with LoRA,
  whose adapters both paths share.
  """
  out = []
  for u in users:
    spatial = models.HEADS[TASKS[u.task][4]].reads == "spatial"
    if spatial and _frozen_base(config, u) and not _model_config(config, u)["lora_rank"]:
      out.append(u)
  return tuple(out)


def _architecture(config, u: User) -> str:
  """A user's model config and frozen base as one string: equal strings, equal parameter trees."""
  return json.dumps(
    _model_config(config, u) | {"frozen_base": _frozen_base(config, u)}, sort_keys=True
  )


def _model_config(config, u: User) -> dict[str, Any]:
  """The :func:`fedjax_mm.models.build` config of a user's model (its architecture)."""
  _, input_key, _, _, head = TASKS[u.task]
  spec = config.users[u.index]
  model_config = {
    "encoder": u.encoder,
    "head": head,
    "num_outputs": _outputs(config, u.task),
    "rep_dim": config.rep_dim,
  }
  if input_key == "caption":
    model_config |= {"vocab_size": data.VOCAB_SIZE, "max_len": data.WorldConfig().max_caption_len}
  elif data_source(config) == "tfds":  # the world's images are the zoo's default 32 x 32
    model_config["image_size"] = config.data.image_size
  checkpoint = _pretrained(config, spec, u.encoder)
  hf = models.hf.is_hf(u.encoder)  # weights from its folder, fine-tuned with LoRA
  lora_ok = hf or u.encoder in models.LORA_ENCODERS
  lora_rank = spec.get("lora_rank", config.lora_rank) if lora_ok else 0
  model_config |= {
    "pretrained": None if hf else checkpoint,
    "standardize": _standardize(config, spec, u.encoder),
    "lora_rank": lora_rank if _frozen_base(config, u) else 0,
  }
  if hf:
    model_config["modality"] = "text" if input_key == "caption" else "image"
  return model_config


def _pretrained(config, spec, encoder: str) -> str | None:
  """The checkpoint a user's encoder starts from, or None (from scratch).

  A user's own ``pretrained`` key wins; otherwise ``config.pretrained`` names a
  collection of shipped checkpoints (``"world-clip"`` -> ``world-clip/<encoder>``)
  or, if empty, every user trains from scratch.
  """
  if models.hf.is_hf(encoder):  # the checkpoint is the encoder itself
    return None
  if "pretrained" in spec:
    return spec["pretrained"] or None
  return f"{config.pretrained}/{encoder}" if config.pretrained else None


def _standardize(config, spec, encoder: str) -> bool:
  """Whether a user standardises its pooled features with its checkpoint's statistics.

  ``standardize`` (a user's own key wins over the config's), for users that start
  from a World-CLIP checkpoint; never for ``hf:`` encoders or from scratch.
  """
  if not _pretrained(config, spec, encoder):
    return False
  return bool(spec.get("standardize", config.get("standardize", False)))


def _finite_per_user(state) -> jax.Array:
  """``bool [N]``: every parameter of each user is finite."""
  return jnp.concatenate([core.finite_per_client(g.params) for g in state.groups])


def _bytes_per_round(config, num_batches: int) -> dict[str, int]:
  """Bytes one user sends and receives per round, under both downlink protocols."""
  mc = _muscle_config(config)
  per_batch_up = ledger_lib.tree_bytes(
    jax.ShapeDtypeStruct((mc.batch_size, config.rep_dim), jnp.float32)
  )
  rounds = mc.cl_epochs * num_batches
  out = {"up": rounds * per_batch_up}
  for downlink in fedmuscle.DOWNLINKS:
    shapes = fedmuscle.downlink_shapes(dataclasses.replace(mc, downlink=downlink), config.rep_dim)
    out[f"down_{downlink}"] = rounds * ledger_lib.tree_bytes(shapes)
  return out


def _baseline_config(config, name: str) -> dict[str, Any]:
  """``config.baselines.<name>`` as keyword arguments (empty for configs without the block)."""
  block = config.get("baselines") if hasattr(config, "get") else None
  if block is None or name not in block:
    return {}
  return dict(block[name].to_dict() if hasattr(block[name], "to_dict") else block[name])


def label(config, method: str) -> str:
  """A method's name in the report."""
  if method == "fedmuscle":
    return f"FedMuscle ({config.muscle.loss})"
  return LABELS.get(method, method)


def algorithms(config, users, groups) -> dict[str, Any]:
  """Every method of ``config.methods`` built on the users' groups, in report order."""
  mc = _muscle_config(config)
  # Averaging needs the same architecture: the full model config (encoder, head, LoRA rank,
  # checkpoint) and what trains, so two users average only when their parameter trees are
  # the same.
  archs = tuple(_architecture(config, u) for u in users)
  make = {
    "fedmuscle": lambda: fedmuscle.fedmuscle(groups, mc, faults=validation.check_faults(config)),
    "sage": lambda: sage.sage(
      groups,
      sage.SageConfig(
        batch_size=mc.batch_size, epochs=mc.cl_epochs, **_baseline_config(config, "sage")
      ),
      architectures=archs,
    ),
    "cofed": lambda: cofed.cofed(
      groups,
      cofed.CoFEDConfig(**_baseline_config(config, "cofed")),
      statements=[cofed.world_statements(g.task) for g in groups],
      implies=cofed.world_implications(),
    ),
    "feddf": lambda: feddf.feddf(
      groups,
      feddf.FedDFConfig(batch_size=mc.batch_size, **_baseline_config(config, "feddf")),
      architectures=archs,
    ),
    "fedhenn": lambda: fedhenn.fedhenn(
      groups, fedhenn.FedHeNNConfig(**_baseline_config(config, "fedhenn"))
    ),
    "fedrcl": lambda: fedrcl.fedrcl(
      groups, fedrcl.FedRCLConfig(**_baseline_config(config, "fedrcl")), architectures=archs
    ),
    "simclr": lambda: simclr.simclr(
      groups,
      simclr.SimCLRConfig(
        batch_size=mc.batch_size, cl_epochs=mc.cl_epochs, **_baseline_config(config, "simclr")
      ),
    ),
    "pseudo_label": lambda: pseudo_label.pseudo_label(
      groups,
      pseudo_label.PseudoLabelConfig(
        num_rounds=config.rounds, **_baseline_config(config, "pseudo_label")
      ),
    ),
    "local": lambda: local_training(groups),
  }
  return {m: make[m]() for m in methods_of(config)}


def _baseline_bytes(config, methods, users, states) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Bytes each user sends and receives per round under each baseline: ``{m: (up, down)}``.

  * SAGE: a user with another user of its task uploads the parameters it
    averages (its head; every trained parameter when it also has an
    architecture partner) and downloads their average; a user alone in its
    task sends nothing.
  * CoFED: every voting user uploads ``int32 [P, H]`` votes and downloads
    ``int32 [P, H]`` pseudo-labels (``H`` = 1, or the labels of a multi-label
    user); segmentation users take no part.
  * FedDF: a user with a partner (another user of its task) uploads its trained
    parameters and downloads its prototype's distilled ones; a user alone in its
    task sends nothing.
  * FedRCL: a user with another user of its task and architecture uploads and
    downloads its parameters; a user alone in its class sends nothing (its
    average would be itself).
  * FedHeNN: every user uploads its ``[R, R]`` float32 kernel of the alignment
    set and downloads the server's ``K_bar``, of the same size.
  """
  params = np.array([ledger_lib.tree_bytes(s.params) for s in states], np.int64)  # K = 1 each
  tasks = [u.task for u in users]
  archs = [_architecture(config, u) for u in users]
  partner = np.array([tasks.count(t) > 1 for t in tasks])
  same_class = list(zip(tasks, archs, strict=True))
  classmate = np.array([same_class.count(c) > 1 for c in same_class])
  rad = _baseline_config(config, "fedhenn").get("rad_size", fedhenn.FedHeNNConfig.rad_size)
  kernel = np.full(len(users), 4 * rad * rad, np.int64)
  num_public = config.public.size
  votes = np.array(
    [
      ledger_lib.tree_bytes(cofed.messages(cofed.world_statements(_task(u)), num_public)[:1])
      for u in users
    ],
    np.int64,
  )
  shared = _sage_bytes(states, tasks, archs)
  out = {
    "sage": (shared, shared),
    "cofed": (votes, votes),
    "feddf": (params * partner, params * partner),
    "fedrcl": (params * classmate, params * classmate),
    "fedhenn": (kernel, kernel),
    # Each user alone: nothing crosses the wire (a ledger of zeros, not a missing one).
    "simclr": (np.zeros(len(users), np.int64),) * 2,
    "pseudo_label": (np.zeros(len(users), np.int64),) * 2,
  }
  return {m: v for m, v in out.items() if m in methods}


def _task(u: User, config=None) -> core.Task:
  """A user's task (what :func:`build` gives its group); ``config`` None: on the world.

  A text user reads the captions of its token space (``caption`` for the world's ids,
  ``caption:<checkpoint>`` for an hf: encoder's), in its own sets and in the public set.
  """
  kind, input_key, target_key, _, _ = TASKS[u.task]
  if input_key == "caption":
    input_key = text_lib.caption_key(text_lib.token_space(u.encoder))
  background = None
  if kind == "segmentation":  # the world's mask class 0 is background; a TFDS reader says
    tfds = config is not None and data_source(config) == "tfds"
    background = tfds_data.READERS[config.data.tasks[u.task]].background if tfds else 0
  return core.Task(kind, input_key, target_key, _outputs(config, u.task), background)


def _outputs(config, task: str) -> int:
  """A task's outputs: the world's classes, or with ``data.source = "tfds"`` its dataset's."""
  _, _, target_key, outputs, _ = TASKS[task]
  if config is None or data_source(config) != "tfds":
    return outputs
  return tfds_data.READERS[config.data.tasks[task]].classes[target_key]


def _sage_bytes(states, tasks, archs) -> np.ndarray:
  """Per user, the bytes of the parameters SAGE averages (each way); 0 for a user alone in its task."""
  partners = sage.averaged_leaves([s.params for s in states], tasks, archs)
  out = []
  for s, (arch, head) in zip(states, partners, strict=True):
    whole = len(arch) > 1  # an architecture partner: every trained parameter
    sent = jax.tree_util.tree_map_with_path(
      lambda path, x, whole=whole: x if whole or sage.is_head(path) else None, s.params
    )
    out.append(ledger_lib.tree_bytes(sent) if len(set(arch + head)) > 1 else 0)
  return np.array(out, np.int64)


def experiment(config) -> loop.Experiment:
  """Every method of ``config.methods`` side by side, as :func:`fedjax_mm.runner.loop.run` drives them.

  All start from identical initial states (each owns a copy: rounds donate
  their input) and the same round keys, so the methods that read the public
  set read it in the same order; each round is one jitted call per method.
  After every round every user is evaluated on its own test set and each
  method's Delta against local training is logged; each method's bytes go to
  its own ledger (FedMuscle: the downlink that ran; the baselines:
  :func:`_baseline_bytes`).
  """
  users, groups, states, train_data, test_data, public, trivial = build(config)  # Validates.
  mc = _muscle_config(config)
  mesh = core.local_mesh()
  algs = algorithms(config, users, groups)
  methods = tuple(algs)
  others = tuple(m for m in methods if m != "local")
  init_key = jax.random.fold_in(jax.random.key(config.seed), 10_000)

  # The rounds and the evaluation take the sets as arguments: closed over, every set would be
  # a constant of the compiled program, a copy of it that XLA folds at compile time.
  def step(name):
    inputs = (train_data,) if name == "local" else (train_data, public)

    def fn(s, *inputs):
      s, stats = algs[name].round(s, *inputs)
      out = {"finite": _finite_per_user(s)}
      out |= {k: stats[k] for k in USER_LOSSES if stats.get(k) is not None}
      if "fault_counts" in stats:
        out["fault_counts"] = stats["fault_counts"]
      return s, out

    jitted = jax.jit(fn, donate_argnums=0)
    return lambda s: jitted(s, *inputs)

  evaluate_groups = jax.jit(
    lambda s, test_data: [
      core.evaluate_group(g, gs, d) for g, gs, d in zip(groups, s.groups, test_data, strict=True)
    ]
  )

  def evaluate(s) -> list[float]:
    """Each user's test metric (its group holds it alone)."""
    per_group = evaluate_groups(s, test_data)
    return [
      float(np.asarray(m[g.task.metric_name])[0]) for m, g in zip(per_group, groups, strict=True)
    ]

  # The public set as read: data.limit may have shrunk a TFDS one below public.size.
  num_public = jax.tree.leaves(public)[0].shape[0]
  traffic = _bytes_per_round(config, num_public // mc.batch_size)
  data_note = None
  if data_source(config) == "tfds":  # what was read, beside what the config asked
    data_note = {
      "source": "tfds",
      "datasets": {t: config.data.tasks[t] for t in sorted({u.task for u in users})},
      "public": config.data.public,
      "limit": config.data.limit,
      "image_size": config.data.image_size,
      "train_sizes": [int(np.asarray(d.num_samples)[0]) for d in train_data],
      "test_sizes": [int(np.asarray(d.num_samples)[0]) for d in test_data],
      "public_size": int(num_public),
    }
  costs = None
  if config.get("count_flops", False):  # compiled once here, nothing trained
    costs = cost_lib.method_costs(
      config,
      methods,
      groups,
      states,
      train_data,
      public,
      architectures=tuple(_architecture(config, u) for u in users),
    )
  sent = _baseline_bytes(config, methods, users, states)
  sent["fedmuscle"] = (
    np.full(len(users), traffic["up"]),
    np.full(len(users), traffic[f"down_{mc.downlink}"]),
  )

  def scalars(r, outs, evals):
    rows = []
    for name in methods:
      values = {
        f"{users[i].name}/{groups[i].task.metric_name}": v for i, v in enumerate(evals[name])
      }
      for key in USER_LOSSES:
        if key in outs[name]:
          losses = np.asarray(outs[name][key])
          values |= {f"{users[i].name}/{key}": float(v) for i, v in enumerate(losses)}
      values |= loop.fault_scalars(outs[name])
      rows.append((name, values))
    return rows + [(m, {"delta": _delta(evals[m], evals["local"])[0]}) for m in others]

  def postfix(evals):
    deltas = {m: f"{100 * _delta(evals[m], evals['local'])[0]:+.1f}%" for m in others}
    return {"delta": deltas[others[0]]} if len(others) == 1 else deltas

  return loop.Experiment(
    init=lambda: {
      name: jax.tree.map(jnp.copy, alg.init(states, init_key)).place(mesh)
      for name, alg in algs.items()
    },
    methods={name: step(name) for name in methods},
    evaluate=evaluate,
    nonfinite=lambda out: [users[i].name for i in np.flatnonzero(~np.asarray(out["finite"]))],
    scalars=scalars,
    runs=methods,
    report=lambda outcome: _report(
      config, methods, users, groups, traffic, trivial, outcome, costs=costs, data_note=data_note
    ),
    traffic=lambda name, out: sent.get(name),
    postfix=postfix,
  )


def _delta(alg: Sequence[float], local: Sequence[float]) -> tuple[float, list[int]]:
  """Delta over the users whose local metric is nonzero, and the excluded users.

  A user whose locally trained model scores exactly 0 (e.g. a multi-label model
  that predicts no positive yet, micro-F1 = 0) has no relative gain; Delta is
  the mean over the others, and the report names the excluded users. With no
  user left Delta is NaN.
  """
  local = np.asarray(local, float)
  defined = local > 0
  if not defined.any():
    return math.nan, list(range(len(local)))
  value = metrics.delta(jnp.asarray(alg), jnp.asarray(local), where=jnp.asarray(defined))
  return float(value), [int(i) for i in np.flatnonzero(~defined)]


def _downlink_note(downlink: str) -> str:
  """What each user receives under the downlink that ran (the same loss either way)."""
  if downlink == "factored":
    return (
      "Downlink that ran: factored. Each user receives its M partners' own representations "
      "Z^m / tau and the pairwise terms -gamma Z^m Z^m'^T, from which its loss is computed "
      "exactly. The paper's server sends only the aggregate S^n and alpha^n (eq. 5): the "
      "factored downlink is far smaller but shows a user its partners' representations of "
      "the public batch, a privacy difference. The loss, and so training, is identical."
    )
  return (
    "Downlink that ran: paper. Each user receives the aggregated S^n (B^M x d) and alpha^n "
    "(B^M) of eq. 5, never a partner's own representations."
  )


def flops_table(config, methods, users, costs, deltas) -> str:
  """Per method: users' GFLOPs per round (sum and per user), the server's, and Delta."""
  giga = lambda x: f"{x / 1e9:.4g}"  # 4 significant digits: servers may do little
  rows = [
    [
      label(config, m),
      giga(sum(costs[m].users)),
      " / ".join(giga(x) for x in costs[m].users),
      giga(costs[m].server),
      report_lib.percent(deltas[m]) if m in deltas else "(reference)",
    ]
    for m in methods
  ]
  per_user = "per user (" + ", ".join(str(u.index + 1) for u in users) + ")"
  return report_lib.format_table(
    ["method", "users, GFLOPs/round", per_user, "server, GFLOPs/round", "Delta"], rows
  )


#: What the FLOPs table counts (fedjax_mm/runner/cost.py).
FLOPS_NOTE = (
  "XLA's cost analysis of each method's steps, compiled once at start-up on each user's "
  "model and multiplied by the steps a round runs (fedjax_mm/runner/cost.py): users' local "
  "steps, their CL steps (FedMuscle, SimCLR), unlabelled steps (SAGE) or public-set labelling "
  "(CoFED, Curriculum Labeling); the server's targets (FedMuscle), distillation (FedDF), "
  "kernel mean (FedHeNN), parameter averages (SAGE, FedDF, FedRCL), vote tally (CoFED). "
  "Transcendentals (exp, log) and evaluation are not counted."
)


def _report(
  config,
  methods,
  users,
  groups,
  traffic,
  trivial,
  outcome: loop.Outcome,
  *,
  costs=None,
  data_note=None,
) -> loop.Report:
  """Table 1 of the paper for this run: per user, every method vs local training, Delta, bytes.

  ``data_note`` (TFDS runs): the datasets and the examples each set got, in
  results.json ``"data"`` and a report section.
  """
  final, history = outcome.final, outcome.history
  fmt = report_lib.format_table
  others = [m for m in methods if m != "local"]
  single = len(others) == 1  # one method against local: a per-user gain column, as before
  rows = []
  for u, g in zip(users, groups, strict=True):
    loc = final["local"][u.index]
    row = [u.name, u.encoder, u.task, g.task.metric_name]
    row += [100 * final[m][u.index] for m in others] + [100 * loc]
    if single:
      gain = (final[others[0]][u.index] - loc) / loc if loc else math.nan
      row.append(report_lib.percent(gain) if loc else "n/a (local 0)")
    rows.append(row + [100 * trivial[u.index]])
  deltas = {m: _delta(final[m], final["local"])[0] for m in others}
  excluded = _delta(final[others[0]], final["local"])[1]  # depends on local training only
  headers = ["user", "model", "task", "metric", *(label(config, m) for m in others), "local"]
  table = fmt(headers + (["gain"] if single else []) + ["trivial"], rows)
  delta_table = fmt(
    ["method", "Delta vs local"],
    [[label(config, m), report_lib.percent(deltas[m])] for m in others],
  )
  sections_traffic, totals = None, None
  if "fedmuscle" in methods:
    ledger = outcome.ledgers["fedmuscle"]
    totals = {"up": int(ledger.total_up), "down": int(ledger.total_down)}
    mb = lambda n: ledger_lib.format_bytes(n)
    sections_traffic = fmt(
      ["per user and round", "bytes"],
      [
        ["up (Z^n)", mb(traffic["up"])],
        ["down, factored (Z^m/tau, -gamma G)", mb(traffic["down_factored"])],
        ["down, paper (S^n, alpha^n)", mb(traffic["down_paper"])],
        ["paper / factored", f"{traffic['down_paper'] / traffic['down_factored']:,.0f}x"],
        [
          f"all users, all rounds, up / down ({config.muscle.downlink})",
          f"{mb(totals['up'])} / {mb(totals['down'])}",
        ],
      ],
    )
  wall, start_round = outcome.wall_time_s, outcome.resumed_at
  counted = f"over {len(users) - len(excluded)} of {len(users)} users after {config.rounds} rounds"
  settings = f"(E={config.local_epochs}, d={config.rep_dim})"
  if "fedmuscle" in methods:
    settings = (
      f"(M={config.muscle.num_partners}, B={config.muscle.batch_size}, T={config.muscle.cl_epochs}, "
      f"E={config.local_epochs}, d={config.rep_dim}, loss={config.muscle.loss}, "
      f"downlink={config.muscle.downlink})"
    )
  if single:
    lead = f"Delta = {report_lib.percent(deltas[others[0]])}"
    if others[0] != "fedmuscle":
      lead = f"{label(config, others[0])}: {lead}"
  else:
    lead = "Delta = " + ", ".join(
      f"{report_lib.percent(deltas[m])} ({label(config, m)})" for m in others
    )
  summary = f"{lead} {counted} {settings}; wall time {wall:.0f} s" + (
    f" (resumed at round {start_round})" if start_round else ""
  )
  if excluded:
    names = ", ".join(users[i].name for i in excluded)
    summary += f". Left out of Delta: {names}, which scored 0 under local training"
  curve = lambda run, u: metric_series(
    history, f"{u.name}/{groups[u.index].task.metric_name}", run=run
  )
  series = {
    f"{u.name} ({u.encoder}/{u.task})": {
      ("FedMuscle" if m == "fedmuscle" else label(config, m)): curve(m, u) for m in methods
    }
    for u in users
  }
  result = {
    "methods": list(methods),
    "deltas": deltas,
    "delta_excluded_users": [users[i].name for i in excluded],
    **{m: final[m] for m in methods},
    "trivial": list(trivial),
    "rounds": config.rounds,
    "wall_time_s": wall,
  }
  if "fedmuscle" in methods:
    result |= {"delta": deltas["fedmuscle"], "traffic_per_round": traffic, "traffic_total": totals}
  by_method = {
    m: {"up": int(outcome.ledgers[m].total_up), "down": int(outcome.ledgers[m].total_down)}
    for m in others
    if m in outcome.ledgers
  }
  if set(by_method) - {"fedmuscle"}:
    result["traffic_total_by_method"] = by_method
    bytes_table = report_lib.format_table(
      ["method", "all users, all rounds: up / down"],
      [
        [
          label(config, m),
          f"{ledger_lib.format_bytes(t['up'])} / {ledger_lib.format_bytes(t['down'])}",
        ]
        for m, t in by_method.items()
      ],
    )
  sections = [
    ("Result", summary),
    ("Per user (metric in %; trivial: majority class / every label present)", table),
  ]
  if not single:
    sections.append(("Delta against local training", delta_table))
  if data_note is not None:
    result["data"] = data_note
    data_rows = [
      [
        u.name,
        data_note["datasets"][u.task],
        data_note["train_sizes"][i],
        data_note["test_sizes"][i],
      ]
      for i, u in enumerate(users)
    ]
    data_rows.append(["public set", data_note["public"], data_note["public_size"], ""])
    sections.append(
      (
        f"Data (TFDS, data.limit={data_note['limit']}, images {data_note['image_size']} px)",
        fmt(["set", "dataset", "train examples", "test examples"], data_rows),
      )
    )
  if sections_traffic is not None:
    sections.append(
      ("Communication", sections_traffic + "\n\n" + _downlink_note(config.muscle.downlink))
    )
  if "traffic_total_by_method" in result:
    sections.append(("Communication of every method (ledgers)", bytes_table + "\n\n" + BYTES_NOTE))
  compute_table = None
  if costs is not None:
    result["flops_per_round"] = {m: costs[m].to_dict() for m in methods}
    compute_table = flops_table(config, methods, users, costs, deltas)
    sections.append(("Computation per round (FLOPs)", compute_table + "\n\n" + FLOPS_NOTE))
  title = (
    "FedMuscle vs local training"
    if list(methods) == ["fedmuscle", "local"]
    else (", ".join(label(config, m) for m in others) + " vs local training")
  )
  text = "\n\n".join(
    [table]
    + ([] if single else [delta_table])
    + ([sections_traffic] if sections_traffic else [])
    + ([compute_table] if compute_table else [])
    + [summary]
  )
  return loop.Report(
    title=title,
    sections=sections,
    plots={
      "metrics.png": loop.Curves(series, "Test metric per round", "metric"),
      "delta.png": loop.Curves(
        {
          "Delta": {
            f"{label(config, m)} vs local": metric_series(history, "delta", run=m) for m in others
          }
        },
        "Delta per round",
        "Delta",
      ),
    },
    results=result,
    text=text,
  )


#: FedMuscle as the loop runs it (:class:`fedjax_mm.runner.loop.System`).
SYSTEM = loop.System(
  name="fedmuscle",
  methods=METHODS,
  validate=validate,
  experiment=experiment,
)
run = SYSTEM.run
