"""The FedMuscle experiment: its methods built on the users, each round's metrics.

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
protocols, and the wall time (:func:`fedjax_mm.runner.fedmuscle_report.report`;
the users, their data and models: :mod:`fedjax_mm.runner.fedmuscle_data`).

The users' sets and the public set come from ``config.data.source``: the
embedded world (``"world"``, the default: one seeded pool per task, cut in
disjoint slices) or the papers' datasets through TFDS (``"tfds"``:
:func:`fedjax_mm.runner.fedmuscle_data._tfds_sets`; each task's dataset in
``data.tasks``, the public set's in ``data.public``, at most ``data.limit`` examples read of any split). A TFDS run
also writes what each set got (``results.json`` ``"data"``, a report section).

Everything is validated before anything is compiled: a bad config raises
:class:`ConfigError` with a one-line message (``experiments/main.py`` prints
it and exits with status 2).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from fedjax_mm import core, data, models
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
from fedjax_mm.algorithms import cost as cost_lib
from fedjax_mm.algorithms import probe as probe_lib
from fedjax_mm.core import features as core_features
from fedjax_mm.core import ledger as ledger_lib
from fedjax_mm.core.client import apply_in_batches
from fedjax_mm.runner import fedmuscle_report, loop, validation
from fedjax_mm.runner.errors import ConfigError
from fedjax_mm.runner.fedmuscle_data import (
  _MODALITY_KEY,
  FINE_TUNE,
  METHODS,
  TASKS,
  User,
  _architecture,
  _baseline_config,
  _fine_tune,
  _frozen_base,
  _model_config,
  _pretrained,
  _public_scenes,
  _standardize,
  _task,
  _tfds_reads,
  _user_data,
  methods_of,
  test_sizes,
  unaligned_users,
)
from fedjax_mm.runner.fedmuscle_report import _delta
from fedjax_mm.runner.validation import data_source

#: The metrics.jsonl keys of per-user values a method's round reports (``<user>/<key>``):
#: losses, and the share of the public set a pseudo-labelling user trained on (SAGE: whose
#: pseudo-label counted).
USER_LOSSES = ("cl_loss", "distill_loss", "cka_distance", "pseudo_loss", "kept")


def validate(config) -> tuple[User, ...]:
  """Checks a config; returns its users. Raises :class:`ConfigError`."""
  methods = methods_of(config)
  faults = validation.check_common(config, validation.FEDMUSCLE, methods, METHODS)
  test_sizes(config)
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
  if not isinstance(config.lora_rank, int) or config.lora_rank < 0:
    raise ConfigError(f"lora_rank must be an int >= 0, got {config.lora_rank!r}.")
  if not isinstance(config.get("cache_features", True), bool):
    raise ConfigError(f"cache_features must be True or False, got {config.cache_features!r}.")
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
  _check_probe(config, users)
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


def _probed(config) -> tuple[int, ...]:
  """The user numbers ``config.probe.users`` names (none when the config has no probe)."""
  return tuple(config.get("probe", {}).get("users", ()))


def _check_probe(config, users) -> None:
  probed = _probed(config)
  if not probed:
    return
  if len(set(probed)) != len(probed) or max(probed) > len(users):
    raise ConfigError(
      f"probe.users must name distinct users by number, 1 to {len(users)}; got {probed}."
    )
  unknown = [t for t in config.probe.targets if t not in probe_lib.WORLD_PROBES]
  if unknown or not tuple(config.probe.targets):
    raise ConfigError(
      f"probe.targets must name some of {', '.join(probe_lib.WORLD_PROBES)}; got "
      f"{tuple(config.probe.targets)}."
    )
  if data_source(config) != "world":
    raise ConfigError("probe.users: the probes read the world's scenes; set data.source='world'.")
  text = [n for n in probed if TASKS[users[n - 1].task][1] == "caption"]
  if text:
    raise ConfigError(f"probe.users: user {text[0]} reads captions; the probes show images.")


def _muscle_config(config) -> fedmuscle.MuscleConfig:
  return fedmuscle.MuscleConfig(**config.muscle.to_dict())


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


#: Methods that transform a user's raw inputs (augmented views), so they run on the raw
#: groups even where a frozen encoder's features are cached (:func:`experiment`).
RAW_INPUT_METHODS = ("sage", "simclr")


def algorithms(config, users, groups, raw_groups=None) -> dict[str, Any]:
  """Every method of ``config.methods`` built on the users' groups, in report order.

  ``raw_groups`` (default ``groups``) are the groups that read raw inputs, for the
  methods of :data:`RAW_INPUT_METHODS`; ``groups`` may read cached features.
  """
  raw = groups if raw_groups is None else raw_groups
  mc = _muscle_config(config)
  # Averaging needs the same architecture: the full model config (encoder, head, LoRA rank,
  # checkpoint) and what trains, so two users average only when their parameter trees are
  # the same.
  archs = tuple(_architecture(config, u) for u in users)
  make = {
    "fedmuscle": lambda: fedmuscle.fedmuscle(groups, mc, faults=validation.check_faults(config)),
    "sage": lambda: sage.sage(
      raw,
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
      raw,
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
  """Bytes each user sends and receives per round under each baseline: ``{m: (up, down)}``
  (:func:`fedjax_mm.algorithms.cost.method_bytes` on the run's users)."""
  rad = _baseline_config(config, "fedhenn").get("rad_size", fedhenn.FedHeNNConfig.rad_size)
  return cost_lib.method_bytes(
    methods,
    states,
    [u.task for u in users],
    [_architecture(config, u) for u in users],
    [cofed.world_statements(_task(u)) for u in users],
    rad_size=rad,
    num_public=config.public.size,
  )


class _Probes:
  """Linear probes of some users' representations (``config.probe``) on the world's
  private scenes, for the positive control (a weak user beside strong partners).

  ``self(groups)`` scores the probed users of a state's groups (each group holds one
  user), ``{"user <n>": {target: %}}``; :attr:`baselines` holds the initial models'
  scores and the trivial predictor's. A cached user is probed through its raw group,
  whose model reads the images (the parameters are the same).
  """

  def __init__(self, config, users, raw_groups, states):
    block = config.probe
    self.users = [users[int(u) - 1] for u in block.users]
    self.targets = tuple(block.targets)
    pool = data.generate(config.seed * 1000 + 20, block.train + block.test)
    self.train = data.take(pool, np.arange(block.train))
    self.test = data.take(pool, np.arange(block.train, block.train + block.test))
    self.images = jnp.asarray(pool["image"])
    self.represent = {
      u.index: jax.jit(
        lambda params, shared, x, g=raw_groups[u.index]: apply_in_batches(
          g.merge(params, shared).represent, x, 256
        )
      )
      for u in self.users
    }
    trivial = probe_lib.trivial_scores(self.train, self.test, self.targets)
    self.baselines = {
      "initial": self(states),
      "trivial": {f"user {u.index + 1}": trivial for u in self.users},
    }

  def __call__(self, groups) -> dict[str, dict[str, float]]:
    out, n = {}, self.train["image"].shape[0]
    for u in self.users:
      g = groups[u.index]
      params = jax.tree.map(lambda x: x[0], g.params)  # its group's only client
      z = self.represent[u.index](params, g.shared, self.images)
      out[f"user {u.index + 1}"] = probe_lib.probe_scores(
        z[:n], z[n:], self.train, self.test, self.targets
      )
    return out


def experiment(config) -> loop.Experiment:
  """Every method of ``config.methods`` side by side, as :func:`fedjax_mm.runner.loop.run` drives them.

  All start from identical initial states (each owns a copy: rounds donate
  their input) and the same round keys, so the methods that read the public
  set read it in the same order; each round is one jitted call per method.
  After every round every user is evaluated on its own test set and each
  method's Delta against local training is logged; each method's bytes go to
  its own ledger (FedMuscle: the downlink that ran; the baselines:
  :func:`_baseline_bytes`).

  With ``config.cache_features`` (the default) a user whose encoder trains nothing
  (a pretrained CNN under "adapters") reads its encoder's pooled features, computed
  once per set (:mod:`fedjax_mm.core.features`): the same parameters and draws, the
  same numbers up to float32 rounding, and no encoder pass per step. The methods that
  augment raw inputs (:data:`RAW_INPUT_METHODS`) keep the raw groups.
  """
  users, groups, states, train_data, test_data, public, trivial = build(config)  # Validates.
  raw_groups = groups
  costs = None
  if config.get("count_flops", False):  # compiled once here, nothing trained
    costs = cost_lib.method_costs(
      config,
      methods_of(config),
      groups,
      states,
      train_data,
      public,
      architectures=tuple(_architecture(config, u) for u in users),
    )
  if config.get("cache_features", True):
    groups, (train_data, test_data), public = core_features.cache_frozen_encoders(
      groups, states, (train_data, test_data), public
    )
  mc = _muscle_config(config)
  mesh = core.local_mesh()
  algs = algorithms(config, users, groups, raw_groups)
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

  probe_of = _Probes(config, users, raw_groups, states) if _probed(config) else None

  def evaluate(s) -> dict[str, Any]:
    """Each user's test metric (its group holds it alone); after the last round also the
    probes of ``config.probe.users``' representations (a rerun of a finished run too)."""
    per_group = evaluate_groups(s, test_data)
    users_metric = [
      float(np.asarray(m[g.task.metric_name])[0]) for m, g in zip(per_group, groups, strict=True)
    ]
    out = {"users": users_metric}
    if probe_of is not None and int(s.round) == config.rounds:
      out["probes"] = probe_of(s.groups)
    return out

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
  sent = _baseline_bytes(config, methods, users, states)
  sent["fedmuscle"] = (
    np.full(len(users), traffic["up"]),
    np.full(len(users), traffic[f"down_{mc.downlink}"]),
  )

  def scalars(r, outs, evals):
    rows = []
    for name in methods:
      values = {
        f"{users[i].name}/{groups[i].task.metric_name}": v
        for i, v in enumerate(evals[name]["users"])
      }
      for key in USER_LOSSES:
        if key in outs[name]:
          losses = np.asarray(outs[name][key])
          values |= {f"{users[i].name}/{key}": float(v) for i, v in enumerate(losses)}
      values |= loop.fault_scalars(outs[name])
      rows.append((name, values))
    delta = lambda m: _delta(evals[m]["users"], evals["local"]["users"])[0]
    return rows + [(m, {"delta": delta(m)}) for m in others]

  def postfix(evals):
    delta = lambda m: _delta(evals[m]["users"], evals["local"]["users"])[0]
    deltas = {m: f"{100 * delta(m):+.1f}%" for m in others}
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
    report=lambda outcome: fedmuscle_report.report(
      config,
      methods,
      users,
      groups,
      traffic,
      trivial,
      outcome,
      costs=costs,
      data_note=data_note,
      probes=None if probe_of is None else probe_of.baselines,
    ),
    traffic=lambda name, out: sent.get(name),
    postfix=postfix,
  )


#: FedMuscle as the loop runs it (:class:`fedjax_mm.runner.loop.System`).
SYSTEM = loop.System(
  name="fedmuscle",
  methods=METHODS,
  validate=validate,
  experiment=experiment,
  tables=fedmuscle_report.tables,
)
run = SYSTEM.run
