"""The FedMuscle experiment: users, data, each round's metrics, the report.

``run(config, workdir)`` is what ``python -m experiments.main
--config=experiments/fedmuscle.py`` calls: :func:`fedjax_mm.runner.loop.run`
of :func:`experiment`, which trains FedMuscle and local training side by side,
from the same initial models and the same data and seeds, for
``config.rounds`` rounds (workdir, checkpoints, resume, NaN guard, ledger and
the files written are the loop's). Each round is one jitted call per
algorithm (compiled once); after every round every user is evaluated on its
own test set. At the end it prints and writes the paper-style table (Table 1):
per user its model, task, metric, FedMuscle, local training and the relative
gain beside the trivial baseline, the overall Delta, the bytes each user sends
and receives per round under both downlink protocols, and the wall time.

Everything is validated before anything is compiled: a bad config raises
:class:`ConfigError` with a one-line message (``experiments/main.py`` prints
it and exits with status 2).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_mm import core, data, metrics, models
from fedjax_mm.algorithms import fedmuscle, local_training
from fedjax_mm.core import ledger as ledger_lib
from fedjax_mm.runner import loop, validation
from fedjax_mm.runner import report as report_lib
from fedjax_mm.runner import text as text_lib
from fedjax_mm.runner.errors import ConfigError
from fedjax_mm.runner.writers import metric_series

#: Task name -> (kind, input key, target key, outputs, head).
TASKS: dict[str, tuple[str, str, str, int, str]] = {
  "mlc": ("multilabel", "image", "multilabel", data.NUM_SHAPES, "mlp"),
  "ic10": ("classification", "image", "label10", 10, "mlp"),
  "ic100": ("classification", "image", "label100", 100, "mlp"),
  "ss": ("segmentation", "image", "mask", data.NUM_SEG_CLASSES, "segmentation"),
  "tc": ("classification", "caption", "caption_label", data.NUM_COLORS, "linear"),
}
METHODS = ("fedmuscle", "local")
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


def validate(config) -> tuple[User, ...]:
  """Checks a config; returns its users. Raises :class:`ConfigError`."""
  validation.check_numbers(config, validation.FEDMUSCLE)
  validation.check_client_map(config)
  validation.check_faults(config)
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
  text_tokenizer(users)  # one token space for every text user
  try:
    _muscle_config(config).validate(len(users))
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if config.public.size < config.muscle.batch_size:
    raise ConfigError(
      f"public.size ({config.public.size}) is smaller than one batch (muscle.batch_size={config.muscle.batch_size})."
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
    checkpoint = _pretrained(config, config.users[u.index], u.encoder)
    if checkpoint:
      try:
        models.pretrained.resolve(checkpoint)
      except models.pretrained.PretrainedError as e:
        raise ConfigError(f"{u.name}: {e}") from None
  return users


def text_tokenizer(users: Sequence[User]) -> str | None:
  """The ``hf:`` checkpoint whose tokenizer every caption goes through, or None (the world's ids)."""
  return text_lib.shared_tokenizer(u.encoder for u in users if TASKS[u.task][1] == "caption")


def _muscle_config(config) -> fedmuscle.MuscleConfig:
  return fedmuscle.MuscleConfig(**config.muscle.to_dict())


def _user_data(config, users: Sequence[User]):
  """Per-user train/test sets (disjoint, uniform split per task) and the public set."""
  seed = config.seed
  train, test = [], []
  by_task: dict[str, list[User]] = {}
  for u in users:
    by_task.setdefault(u.task, []).append(u)
  for t, (_, members) in enumerate(sorted(by_task.items())):
    sizes = [config.users[u.index]["train_size"] for u in members]
    pool = data.generate(seed * 1000 + 10 + t, sum(sizes) + config.test_size * len(members))
    start = 0
    for u, n in zip(members, sizes, strict=True):
      train.append((u.index, data.take(pool, np.arange(start, start + n))))
      start += n
    for u in members:
      test.append((u.index, data.take(pool, np.arange(start, start + config.test_size))))
      start += config.test_size
  public = data.generate(seed * 1000 + 1, config.public.size, shift=config.public.shift)
  checkpoint = text_tokenizer(users)
  if checkpoint is not None:  # every caption in the checkpoint's token space
    for _, d in (*train, *test):
      d["caption"] = text_lib.retokenize(d["caption"], checkpoint)
    public["caption"] = text_lib.retokenize(public["caption"], checkpoint)
  keys = {"image": ("image",), "text": ("caption",)}
  public = {k: jnp.asarray(public[k]) for m in config.public.modalities for k in keys[m]}
  return dict(sorted(train)), dict(sorted(test)), public


def build(config):
  """Validated users, groups, initial states, data and the public set."""
  users = validate(config)
  train, test, public = _user_data(config, users)
  root = jax.random.key(config.seed)
  groups, states, train_data, test_data = [], [], [], []
  for u in users:
    kind, input_key, target_key, outputs, head = TASKS[u.task]
    spec = config.users[u.index]
    model_config = {
      "encoder": u.encoder,
      "head": head,
      "num_outputs": outputs,
      "rep_dim": config.rep_dim,
    }
    if input_key == "caption":
      model_config |= {"vocab_size": data.VOCAB_SIZE, "max_len": data.WorldConfig().max_caption_len}
    checkpoint = _pretrained(config, spec, u.encoder)
    hf = models.hf.is_hf(u.encoder)  # weights from its folder, fine-tuned with LoRA
    lora_ok = hf or u.encoder in models.LORA_ENCODERS
    lora_rank = spec.get("lora_rank", config.lora_rank) if lora_ok else 0
    # A pretrained base is frozen under "adapters" (LoRA where the encoder has
    # dense layers; a CNN has none, so its projector and head train alone).
    frozen_base = bool(checkpoint or hf) and _fine_tune(config, spec) == "adapters"
    model_config |= {
      "pretrained": None if hf else checkpoint,
      "lora_rank": lora_rank if frozen_base else 0,
    }
    if hf:
      model_config["modality"] = "text" if input_key == "caption" else "image"
    tx = optax.adamw(config.learning_rate, weight_decay=config.weight_decay)
    group, state = core.init_group(
      lambda rngs, c=model_config: models.build(c, rngs=rngs),
      name=f"{u.name} ({u.encoder}/{u.task})",
      tx=tx,
      task=core.Task(kind, input_key, target_key, outputs),
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


def experiment(config) -> loop.Experiment:
  """FedMuscle and local training side by side, as :func:`fedjax_mm.runner.loop.run` drives them.

  Both start from identical initial states (each owns a copy: rounds donate
  their input); each round is one jitted call per algorithm. After every round
  every user is evaluated on its own test set; only FedMuscle's users send
  (the ledger counts the downlink that ran).
  """
  users, groups, states, train_data, test_data, public, trivial = build(config)  # Validates.
  mc = _muscle_config(config)
  mesh = core.local_mesh()
  faults = validation.check_faults(config)
  algs = {
    "fedmuscle": fedmuscle.fedmuscle(groups, mc, faults=faults),
    "local": local_training(groups),
  }
  init_key = jax.random.fold_in(jax.random.key(config.seed), 10_000)

  def step(name):
    inputs = (train_data, public) if name == "fedmuscle" else (train_data,)

    def fn(s):
      s, stats = algs[name].round(s, *inputs)
      out = {"finite": _finite_per_user(s), "cl_loss": stats.get("cl_loss")}
      if "fault_counts" in stats:
        out["fault_counts"] = stats["fault_counts"]
      return s, out

    return jax.jit(fn, donate_argnums=0)

  evaluate_groups = jax.jit(
    lambda s: [
      core.evaluate_group(g, gs, d) for g, gs, d in zip(groups, s.groups, test_data, strict=True)
    ]
  )

  def evaluate(s) -> list[float]:
    """Each user's test metric (its group holds it alone)."""
    per_group = evaluate_groups(s)
    return [
      float(np.asarray(m[g.task.metric_name])[0]) for m, g in zip(per_group, groups, strict=True)
    ]

  traffic = _bytes_per_round(config, config.public.size // mc.batch_size)
  sent = (np.full(len(users), traffic["up"]), np.full(len(users), traffic[f"down_{mc.downlink}"]))

  def scalars(r, outs, evals):
    rows = []
    for name in METHODS:
      values = {
        f"{users[i].name}/{groups[i].task.metric_name}": v for i, v in enumerate(evals[name])
      }
      if outs[name]["cl_loss"] is not None:
        losses = np.asarray(outs[name]["cl_loss"])
        values |= {f"{users[i].name}/cl_loss": float(v) for i, v in enumerate(losses)}
      values |= _fault_scalars(outs[name])
      rows.append((name, values))
    return rows + [("fedmuscle", {"delta": _delta(evals["fedmuscle"], evals["local"])[0]})]

  return loop.Experiment(
    init=lambda: {
      name: jax.tree.map(jnp.copy, alg.init(states, init_key)).place(mesh)
      for name, alg in algs.items()
    },
    methods={name: step(name) for name in METHODS},
    evaluate=evaluate,
    nonfinite=lambda out: [users[i].name for i in np.flatnonzero(~np.asarray(out["finite"]))],
    scalars=scalars,
    runs=METHODS,
    report=lambda outcome: _report(config, users, groups, traffic, trivial, outcome),
    traffic=lambda name, out: sent if name == "fedmuscle" else None,
    postfix=lambda evals: {"delta": f"{100 * _delta(evals['fedmuscle'], evals['local'])[0]:+.1f}%"},
  )


def _fault_scalars(out) -> dict[str, float]:
  """``faults/dropped``, ``faults/stragglers``, ``faults/byzantine`` of a round (if simulated)."""
  counts = out.get("fault_counts") or {}
  return {f"faults/{k}": float(v) for k, v in counts.items()}


def run(
  config, workdir: str | pathlib.Path, *, overwrite: bool = False, progress: bool = True
) -> dict[str, Any]:
  """Trains FedMuscle and local training in ``workdir``; resumes a run killed there.

  Returns:
    the final results (also written to ``results.json``).
  """
  return loop.run(experiment, config, workdir, overwrite=overwrite, progress=progress)


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


def _report(config, users, groups, traffic, trivial, outcome: loop.Outcome) -> loop.Report:
  """Table 1 of the paper for this run: per user, FedMuscle vs local training, Delta, bytes."""
  final, history = outcome.final, outcome.history
  fmt = report_lib.format_table
  rows = []
  for u, g in zip(users, groups, strict=True):
    alg, loc = final["fedmuscle"][u.index], final["local"][u.index]
    gain = (alg - loc) / loc if loc else math.nan
    rows.append(
      [
        u.name,
        u.encoder,
        u.task,
        g.task.metric_name,
        100 * alg,
        100 * loc,
        report_lib.percent(gain) if loc else "n/a (local 0)",
        100 * trivial[u.index],
      ]
    )
  delta, excluded = _delta(final["fedmuscle"], final["local"])
  table = fmt(
    [
      "user",
      "model",
      "task",
      "metric",
      f"FedMuscle ({config.muscle.loss})",
      "local",
      "gain",
      "trivial",
    ],
    rows,
  )
  ledger = outcome.ledgers["fedmuscle"]
  totals = {"up": int(ledger.total_up), "down": int(ledger.total_down)}
  mb = lambda n: ledger_lib.format_bytes(n)
  traffic_table = fmt(
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
  summary = (
    f"Delta = {report_lib.percent(delta)} over {len(users) - len(excluded)} of {len(users)} users "
    f"after {config.rounds} rounds "
    f"(M={config.muscle.num_partners}, B={config.muscle.batch_size}, T={config.muscle.cl_epochs}, "
    f"E={config.local_epochs}, d={config.rep_dim}, loss={config.muscle.loss}, downlink={config.muscle.downlink}); "
    f"wall time {wall:.0f} s" + (f" (resumed at round {start_round})" if start_round else "")
  )
  if excluded:
    names = ", ".join(users[i].name for i in excluded)
    summary += f". Left out of Delta: {names}, which scored 0 under local training"
  curve = lambda run, u: metric_series(
    history, f"{u.name}/{groups[u.index].task.metric_name}", run=run
  )
  series = {
    f"{u.name} ({u.encoder}/{u.task})": {
      "FedMuscle": curve("fedmuscle", u),
      "local": curve("local", u),
    }
    for u in users
  }
  result = {
    "delta": delta,
    "delta_excluded_users": [users[i].name for i in excluded],
    "fedmuscle": final["fedmuscle"],
    "local": final["local"],
    "trivial": list(trivial),
    "traffic_per_round": traffic,
    "traffic_total": totals,
    "rounds": config.rounds,
    "wall_time_s": wall,
  }
  return loop.Report(
    title="FedMuscle vs local training",
    sections=[
      ("Result", summary),
      ("Per user (metric in %; trivial: majority class / every label present)", table),
      ("Communication", traffic_table + "\n\n" + _downlink_note(config.muscle.downlink)),
    ],
    plots={
      "metrics.png": loop.Curves(series, "Test metric per round", "metric"),
      "delta.png": loop.Curves(
        {"Delta": {"FedMuscle vs local": metric_series(history, "delta", run="fedmuscle")}},
        "Delta per round",
        "Delta",
      ),
    },
    results=result,
    text=table + "\n\n" + traffic_table + "\n\n" + summary,
  )
