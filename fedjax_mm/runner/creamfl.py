"""The CreamFL experiment: clients, server, data, each round's metrics, the report.

``run(config, workdir)`` is what ``python -m experiments.main
--config=experiments/creamfl.py`` calls: :func:`fedjax_mm.runner.loop.run` of
:func:`experiment`, which trains every method of ``config.methods`` side by
side from the same initial server and clients, on the same data and seeds:
``local`` (the server alone on the public set), the ``reamFL`` variants,
``CreamFL`` and ``CreamFL+Muscle`` (:data:`fedjax_mm.algorithms.creamfl.VARIANTS`).
All federated methods share one compiled round (the variant is a runtime
argument); ``local`` has its own. After every ``eval_every`` rounds (and the
last) the server is evaluated on a held-out test set of the embedded world
(i2t / t2i Recall@1/5/10, several captions per image); the bytes of the
selected clients go to each method's ledger. Workdir, checkpoints, resume,
NaN guard and the files written are the loop's. At the end it prints and
writes a table like CreamFL's Table 1 / FedMuscle's Table 3, plus bytes per
round; :func:`summarize` gives the same table over seeds.

Everything is validated before anything is compiled: a bad config raises
:class:`ConfigError` with a one-line message (``experiments/main.py`` prints it
and exits with status 2).
"""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fedjax_mm import core, data, metrics, models
from fedjax_mm.algorithms import creamfl
from fedjax_mm.core import ledger as ledger_lib
from fedjax_mm.core.client import apply_in_batches
from fedjax_mm.runner import loop, validation
from fedjax_mm.runner import report as report_lib
from fedjax_mm.runner.errors import ConfigError

LOCAL = "local"
METHODS = (LOCAL, *creamfl.VARIANTS)
#: Client group -> (modalities, private task: kind, input key, target key, outputs, head).
GROUPS = {
  "image": (("image",), ("classification", "image", "label10", 10, "mlp")),
  "text": (("text",), ("classification", "caption", "caption_label", data.NUM_COLORS, "linear")),
  "multimodal": (("image", "text"), None),
}
RECALL_KEYS = ("i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10")


def _cream_config(config) -> creamfl.CreamConfig:
  return creamfl.CreamConfig(**config.creamfl.to_dict())


def _check_encoder(where: str, name: str, modality: str) -> None:
  if name not in models.ENCODERS:
    raise ConfigError(f"{where}: unknown encoder {name!r}; known: {', '.join(models.ENCODERS)}.")
  if models.ENCODERS[name][0] != modality:
    raise ConfigError(f"{where}: {name!r} encodes {models.ENCODERS[name][0]}, not {modality}.")


def validate(config) -> None:
  """Checks a config. Raises :class:`ConfigError` with a one-line message."""
  validation.check_numbers(config, validation.CREAMFL)
  validation.check_faults(config)
  unknown = [m for m in config.methods if m not in METHODS]
  if unknown or not config.methods:
    raise ConfigError(f"methods: unknown {unknown or 'empty list'}; known: {', '.join(METHODS)}.")
  if len(set(config.methods)) != len(config.methods):
    raise ConfigError("methods: a method is listed twice.")
  if config.rounds < 1:
    raise ConfigError(f"rounds must be >= 1, got {config.rounds}.")
  if config.eval_every < 1:
    raise ConfigError(f"eval_every must be >= 1, got {config.eval_every}.")
  if config.image_size < 16 or config.image_size % 4:
    raise ConfigError(f"image_size must be a multiple of 4 and >= 16, got {config.image_size}.")
  if config.pretrained:
    c = config.clients
    names = [c.image.encoder, c.text.encoder, c.multimodal.image_encoder]
    names += [c.multimodal.text_encoder, config.server.image_encoder, config.server.text_encoder]
    for name in names:
      try:
        cfg = models.pretrained.read_config(f"{config.pretrained}/{name}")
      except models.pretrained.PretrainedError as e:
        raise ConfigError(str(e)) from None
      if cfg["modality"] == "image" and cfg["image_size"] != config.image_size:
        raise ConfigError(
          f"{config.pretrained}/{name} was pretrained on {cfg['image_size']}x{cfg['image_size']} "
          f"images; set image_size={cfg['image_size']} or pretrained=''."
        )
  if config.rep_dim < 1:
    raise ConfigError(f"rep_dim must be positive, got {config.rep_dim}.")
  if not config.alpha > 0:
    raise ConfigError(f"alpha (Dirichlet concentration) must be > 0, got {config.alpha}.")
  for key in ("learning_rate", "server_learning_rate"):
    if not config[key] > 0:
      raise ConfigError(f"{key} must be > 0, got {config[key]}.")
  total = 0
  for name in GROUPS:
    spec = config.clients[name]
    if spec.num < 1 or spec.train_size < 1:
      raise ConfigError(f"clients.{name}: num and train_size must be >= 1.")
    total += spec.num
    if name == "multimodal":
      _check_encoder("clients.multimodal.image_encoder", spec.image_encoder, "image")
      _check_encoder("clients.multimodal.text_encoder", spec.text_encoder, "text")
    else:
      _check_encoder(f"clients.{name}.encoder", spec.encoder, name)
  _check_encoder("server.image_encoder", config.server.image_encoder, "image")
  _check_encoder("server.text_encoder", config.server.text_encoder, "text")
  c = config.creamfl
  if not 1 <= c.num_selected <= total:
    raise ConfigError(
      f"creamfl.num_selected ({c.num_selected}) must be between 1 and the number of clients ({total})."
    )
  if c.batch_size < 2:
    raise ConfigError(f"creamfl.batch_size (B={c.batch_size}) must be at least 2.")
  if config.public.size < c.batch_size or config.public.size % c.batch_size:
    raise ConfigError(
      f"public.size ({config.public.size}) must be a positive multiple of creamfl.batch_size ({c.batch_size})."
    )
  if not 0.0 <= config.public.shift <= 1.0 or not 0.0 <= config.test.shift <= 1.0:
    raise ConfigError("public.shift and test.shift must lie in [0, 1].")
  if c.lcr_weight < 0 or c.distill_weight < 0 or c.iot_weight < 0:
    raise ConfigError("creamfl.lcr_weight, distill_weight and iot_weight must be >= 0.")
  for key in ("server_temperature", "inter_temperature", "intra_temperature", "gca_temperature"):
    if not c[key] > 0:
      raise ConfigError(f"creamfl.{key} must be > 0, got {c[key]}.")
  if c.gca_chunk_size is not None and c.gca_chunk_size < 1:
    raise ConfigError(f"creamfl.gca_chunk_size must be positive, got {c.gca_chunk_size}.")
  if "CreamFL+Muscle" in config.methods:
    if not 1 <= c.muscle_partners <= c.num_selected:
      raise ConfigError(
        f"creamfl.muscle_partners (M={c.muscle_partners}) must be between 1 and creamfl.num_selected ({c.num_selected})."
      )
    if not 0 < c.muscle_tau_reduced < c.muscle_tau_full:
      raise ConfigError(
        f"creamfl.muscle_tau_reduced ({c.muscle_tau_reduced}) must be in (0, muscle_tau_full = {c.muscle_tau_full}) so that gamma > 0."
      )
  if config.test.size < 2:
    raise ConfigError(f"test.size must be >= 2, got {config.test.size}.")
  folds = config.test.folds
  if folds is not None and (folds < 1 or config.test.size % folds):
    raise ConfigError(f"test.folds ({folds}) must divide test.size ({config.test.size}).")


# ----------------------------------------------------------------------------
# Building clients, server and data


def _world(config) -> data.WorldConfig:
  return data.WorldConfig(image_size=config.image_size)


def _client_data(config, name: str, group_index: int):
  """The group's private sets: a Dirichlet(alpha) split of one pool, per client."""
  spec = config.clients[name]
  modalities, task = GROUPS[name]
  label_key = task[2] if task else "label10"
  pool = data.generate(
    config.seed * 1000 + 10 + group_index, 4 * spec.num * spec.train_size, config=_world(config)
  )
  parts = data.dirichlet_partition(
    pool[label_key],
    spec.num,
    alpha=config.alpha,
    seed=config.seed * 1000 + group_index,
    samples_per_client=spec.train_size,
  )
  keys = [k for m in modalities for k in (("image",) if m == "image" else ("caption",))]
  if task:
    keys.append(task[2])
  clients = [{k: v for k, v in c.items() if k in keys} for c in data.split_clients(pool, parts)]
  stacked, mask = data.stack_clients(clients)
  return core.make_client_data(stacked, mask, user_ids=np.arange(spec.num))


def build(config):
  """Validated client groups, server, initial states, private data, public and test sets."""
  validate(config)
  world = _world(config)
  root = jax.random.key(config.seed)
  text_sizes = {"vocab_size": data.VOCAB_SIZE, "max_len": world.max_caption_len}
  clients, states, train_data, names = [], [], [], []
  for g, name in enumerate(GROUPS):
    spec = config.clients[name]
    modalities, task = GROUPS[name]
    tx = optax.adamw(config.learning_rate, weight_decay=config.weight_decay)
    if task:
      kind, input_key, target_key, outputs, head = task
      model_config = {
        "encoder": spec.encoder,
        "head": head,
        "num_outputs": outputs,
        "rep_dim": config.rep_dim,
      }
      model_config |= text_sizes if name == "text" else {"image_size": config.image_size}
      if config.pretrained:
        model_config["pretrained"] = f"{config.pretrained}/{spec.encoder}"
      make = lambda rngs, c=model_config: models.build(c, rngs=rngs)
      group_task = core.Task(kind, input_key, target_key, outputs)
      encoder = spec.encoder
    else:
      make = lambda rngs, spec=spec: creamfl.DualEncoder(
        spec.image_encoder,
        spec.text_encoder,
        rep_dim=config.rep_dim,
        image_size=config.image_size,
        rngs=rngs,
        pretrained=config.pretrained or None,
        **text_sizes,
      )
      group_task = creamfl.RetrievalTask(temperature=config.creamfl.server_temperature)
      encoder = f"{spec.image_encoder}+{spec.text_encoder}"
    group, state = core.init_group(
      make,
      name=f"{name} ({encoder})",
      tx=tx,
      task=group_task,
      key=jax.random.fold_in(root, g),
      num_clients=spec.num,
      local_epochs=config.local_epochs,
      batch_size=config.local_batch_size,
    )
    clients.append(creamfl.ClientGroup(group, modalities))
    states.append(state)
    train_data.append(_client_data(config, name, g))
    names += [f"{name} client {k + 1}" for k in range(spec.num)]

  server_model = creamfl.DualEncoder(
    config.server.image_encoder,
    config.server.text_encoder,
    rep_dim=config.rep_dim,
    image_size=config.image_size,
    rngs=nnx.Rngs(jax.random.fold_in(root, 100)),
    pretrained=config.pretrained or None,
    **text_sizes,
  )
  graphdef, server_params = nnx.split(server_model)
  server = creamfl.ServerDef(
    graphdef, optax.adamw(config.server_learning_rate, weight_decay=config.weight_decay)
  )

  public = data.generate(
    config.seed * 1000 + 1, config.public.size, config=world, shift=config.public.shift
  )
  public = {"image": jnp.asarray(public["image"]), "caption": jnp.asarray(public["caption"])}
  test = data.generate(
    config.seed * 1000 + 2, config.test.size, config=world, shift=config.test.shift
  )
  captions = test["caption"]  # [N, C, L]: every caption is a query and a candidate
  test = {
    "image": jnp.asarray(test["image"]),
    "caption": jnp.asarray(captions.reshape(-1, captions.shape[-1])),
    "ids": jnp.asarray(np.repeat(np.arange(captions.shape[0]), captions.shape[1])),
  }
  return (
    tuple(clients),
    tuple(states),
    tuple(train_data),
    server,
    server_params,
    public,
    test,
    names,
  )


# ----------------------------------------------------------------------------
# The experiment


def _bytes_per_client(config, clients) -> tuple[np.ndarray, np.ndarray]:
  """Bytes one selected client sends and receives per round (``[num_clients]`` each)."""
  matrix = jax.ShapeDtypeStruct((config.public.size, config.rep_dim), jnp.float32)
  down = ledger_lib.tree_bytes({m: matrix for m in creamfl.MODALITIES})  # I_glob, T_glob
  up, downs = [], []
  for client, spec_name in zip(clients, GROUPS, strict=True):
    sent = ledger_lib.tree_bytes({m: matrix for m in client.modalities})
    up += [sent] * config.clients[spec_name].num
    downs += [down] * config.clients[spec_name].num
  return np.asarray(up, np.int64), np.asarray(downs, np.int64)


def _r1_sum(recall: Mapping[str, float]) -> float:
  return recall["i2t_R@1"] + recall["t2i_R@1"]


def experiment(config) -> loop.Experiment:
  """Every method of ``config.methods`` side by side, as :func:`fedjax_mm.runner.loop.run` drives them.

  Every method starts from a copy of the same initial server and clients.
  The federated methods share one compiled round (the variant is a runtime
  argument), ``local`` has its own; the server is evaluated every
  ``eval_every`` rounds and after the last, and selected clients' bytes go to
  each method's ledger.
  """
  clients, states, train_data, server, server_params, public, test, names = build(config)
  methods = tuple(config.methods)
  cc = _cream_config(config)
  mesh = core.client_mesh(1)
  fed = creamfl.creamfl(clients, server, cc, faults=validation.check_faults(config))
  local = creamfl.server_only(server, cc)
  init_key = jax.random.fold_in(jax.random.key(config.seed), 10_000)
  fed_step = jax.jit(lambda s, v: fed.round(s, train_data, public, v), donate_argnums=0)
  local_step = jax.jit(lambda s: local.round(s, public), donate_argnums=0)
  variants = {m: creamfl.variant(**creamfl.VARIANTS[m]) for m in methods if m != LOCAL}
  rounds = {
    m: local_step if m == LOCAL else functools.partial(fed_step, v=variants[m]) for m in methods
  }

  @jax.jit
  def embed(params):
    model = server.merge(params)
    images = apply_in_batches(lambda x: model.represent(x, "image"), test["image"], 256)
    texts = apply_in_batches(lambda x: model.represent(x, "text"), test["caption"], 256)
    return images, texts

  def evaluate(s) -> dict[str, float]:
    images, texts = embed(s.server_params)
    recall = metrics.image_text_recall(images, texts, test["ids"], folds=config.test.folds)
    return {k: float(recall[k]) for k in RECALL_KEYS}

  def nonfinite(out) -> list[str]:
    bad = [] if bool(out["server_finite"]) else ["the server"]
    if "client_finite" in out:
      flags = np.concatenate([np.asarray(f) for f in out["client_finite"]])
      bad += [names[i] for i in np.flatnonzero(~flags)]
    return bad

  up_bytes, down_bytes = _bytes_per_client(config, clients)

  def traffic(m, out):
    if m == LOCAL:
      return None
    active = np.concatenate([np.asarray(a) for a in out["active"]])
    sent = active
    if "dropped" in out:  # Dropped clients received I_glob, T_glob but sent nothing.
      sent = active & ~np.concatenate([np.asarray(a) for a in out["dropped"]])
    return np.where(sent, up_bytes, 0), np.where(active, down_bytes, 0)

  def scalars(r, outs, evals):
    values = {}
    for m in methods:
      values[f"{m}/server_loss"] = float(outs[m]["server_loss"])
      if m != LOCAL:
        values[f"{m}/kd_loss"] = float(outs[m]["kd_loss"])
        counts = outs[m].get("fault_counts") or {}
        values |= {f"{m}/faults/{k}": float(v) for k, v in counts.items()}
      if m in evals:
        values |= {f"{m}/{k}": v for k, v in evals[m].items()}
    return [("creamfl", values)]

  def postfix(evals):
    if not evals:
      return {}
    best = max(evals, key=lambda m: _r1_sum(evals[m]))
    return {"best": f"{best} {_r1_sum(evals[best]):.1f}"}

  return loop.Experiment(
    init=lambda: {
      m: jax.tree.map(jnp.copy, fed.init(server_params, states, init_key)).place(mesh)
      for m in methods
    },
    methods=rounds,
    evaluate=evaluate,
    nonfinite=nonfinite,
    scalars=scalars,
    runs=("creamfl",),
    report=lambda outcome: _report(config, methods, outcome),
    traffic=traffic,
    eval_every=config.eval_every,
    postfix=postfix,
  )


def run(
  config, workdir: str | pathlib.Path, *, overwrite: bool = False, progress: bool = True
) -> dict[str, Any]:
  """Trains every method of ``config.methods`` in ``workdir``; resumes a run killed there.

  Returns:
    the final results (also written to ``results.json``).
  """
  return loop.run(experiment, config, workdir, overwrite=overwrite, progress=progress)


def _report(config, methods, outcome: loop.Outcome) -> loop.Report:
  """The Recall@K table of CreamFL's Table 1 / FedMuscle's Table 3, plus bytes per round."""
  results, rounds = outcome.final, config.rounds
  fmt = report_lib.format_table
  local_sum = _r1_sum(results[LOCAL]) if LOCAL in results else None
  rows = []
  traffic = {}
  for m in methods:
    rec = results[m]
    ledger = outcome.ledgers.get(m)  # None: the method sent nothing.
    up, down = (ledger.total_up, ledger.total_down) if ledger else (0, 0)
    traffic[m] = {"up_per_round": up / rounds, "down_per_round": down / rounds}
    gain = "" if local_sum is None else f"{_r1_sum(rec) - local_sum:+.2f}"
    rows.append(
      [m]
      + [rec[k] for k in RECALL_KEYS]
      + [
        _r1_sum(rec),
        sum(rec[k] for k in RECALL_KEYS),
        gain,
        ledger_lib.format_bytes((up + down) / rounds),
      ]
    )
  headers = ["method", *RECALL_KEYS, "R@1_sum", "RSUM", "vs local", "bytes/round"]
  table = fmt(headers, rows)
  protocol = "full set" if config.test.folds is None else f"{config.test.folds} folds"
  wall, start_round = outcome.wall_time_s, outcome.resumed_at
  summary = (
    f"Server ({config.server.image_encoder} + {config.server.text_encoder}) after {rounds} rounds; "
    f"Recall@K (%) on {config.test.size} held-out test images x {data.WorldConfig().captions_per_image} "
    f"captions ({protocol}); {sum(config.clients[g].num for g in GROUPS)} clients, "
    f"{config.creamfl.num_selected} per round, P={config.public.size}, d={config.rep_dim}, "
    f"seed {config.seed}; wall time {wall:.0f} s"
    + (f" (resumed at round {start_round})" if start_round else "")
  )
  history = {
    m: [
      (record["round"], record[f"{m}/i2t_R@1"] + record[f"{m}/t2i_R@1"])
      for record in outcome.history
      if f"{m}/i2t_R@1" in record
    ]
    for m in methods
  }
  result = {
    "recall": results,
    "r1_sum": {m: _r1_sum(results[m]) for m in methods},
    "rsum": {m: sum(results[m][k] for k in RECALL_KEYS) for m in methods},
    "traffic": traffic,
    "rounds": rounds,
    "seed": config.seed,
    "wall_time_s": wall,
  }
  return loop.Report(
    title="CreamFL and its variants: server image-text retrieval",
    sections=[("Result", summary), ("Recall@K (%)", table), ("Curves", "![R@1 sum](curves.png)")],
    plots={
      "curves.png": loop.Curves(
        {"server R@1_sum (i2t + t2i)": history},
        "Server retrieval on the test set",
        "R@1 sum (%)",
      )
    },
    results=result,
    text=table + "\n\n" + summary,
  )


def summarize(workdirs) -> str:
  """Mean ± sample std over runs (seeds) of the final table, from their ``results.json``."""
  runs = [json.loads((pathlib.Path(w) / "results.json").read_text()) for w in workdirs]
  methods = [m for m in runs[0]["recall"] if all(m in r["recall"] for r in runs)]

  def cell(values):
    values = np.asarray(values, np.float64)
    std = values.std(ddof=1) if len(values) > 1 else 0.0
    return f"{values.mean():.2f} ± {std:.2f}"

  rows = []
  local = [r["r1_sum"][LOCAL] for r in runs] if LOCAL in methods else None
  for m in methods:
    row = [m] + [cell([r["recall"][m][k] for r in runs]) for k in RECALL_KEYS]
    row += [cell([r["r1_sum"][m] for r in runs]), cell([r["rsum"][m] for r in runs])]
    if local is not None:
      row.append(cell([r["r1_sum"][m] - lo for r, lo in zip(runs, local, strict=True)]))
    rows.append(row)
  headers = ["method", *RECALL_KEYS, "R@1_sum", "RSUM"] + (["vs local"] if local else [])
  seeds = ", ".join(str(r["seed"]) for r in runs)
  return (
    report_lib.format_table(headers, rows)
    + f"\n\nmean ± std (sample, ddof=1) over {len(runs)} runs (seeds {seeds}), Recall@K in %."
  )
