"""The CreamFL experiment: clients, server, data, the loop, the report.

``run(config, workdir)`` is what ``python -m experiments.main
--config=experiments/creamfl.py`` calls. It trains every method of
``config.methods`` side by side from the same initial server and clients, on
the same data and seeds: ``local`` (the server alone on the public set), the
``reamFL`` variants, ``CreamFL`` and ``CreamFL+Muscle``
(:data:`fedjax_mm.algorithms.creamfl.VARIANTS`). All federated methods share one
compiled round (the variant is a runtime argument); ``local`` has its own.
After every ``eval_every`` rounds (and the last) the server is evaluated on a
held-out test set of the embedded world (i2t / t2i Recall@1/5/10, several
captions per image); metrics go to JSONL + TensorBoard, every method's state is
checkpointed (Orbax) after every round with the per-method communication
ledgers in the metadata, and a rerun resumes. At the end it prints and writes a
table like CreamFL's Table 1 / FedMuscle's Table 3, plus bytes per round.

Everything is validated before anything is compiled: a bad config raises
:class:`ConfigError` with a one-line message (``experiments/main.py`` prints it
and exits with status 2).
"""

from __future__ import annotations

import json
import pathlib
import time
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
from fedjax_mm.core.checkpoint import Checkpointer
from fedjax_mm.core.client import apply_in_batches
from fedjax_mm.runner import report as report_lib
from fedjax_mm.runner import validation
from fedjax_mm.runner.errors import ConfigError, NonFiniteError, checkpoint_note
from fedjax_mm.runner.workdir import lock_workdir, prepare_workdir
from fedjax_mm.runner.writers import MetricWriter, read_metrics

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
# The loop


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


def _pack(tree: Any) -> dict[str, jax.Array]:
  """The leaves of ``tree`` as one flat array per dtype (typed keys as their key data).

  Orbax spends milliseconds per leaf; a run holds one state per method with
  hundreds of leaves each, so the checkpoint stores these few long vectors
  instead (bit-exact, see :func:`_unpack`).
  """
  groups: dict[str, list[jax.Array]] = {}
  for leaf in jax.tree.leaves(tree):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    groups.setdefault(str(leaf.dtype), []).append(jnp.ravel(leaf))
  return {dtype: jnp.concatenate(parts) for dtype, parts in groups.items()}


def _unpack(packed: Mapping[str, Any], template: Any) -> Any:
  """Inverse of :func:`_pack`: the arrays of ``packed`` in the structure of ``template``."""
  leaves, treedef = jax.tree.flatten(template)
  offsets = dict.fromkeys(packed, 0)
  out = []
  for leaf in leaves:
    is_key = jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    shape = jax.random.key_data(leaf).shape if is_key else leaf.shape
    dtype = str(jax.random.key_data(leaf).dtype if is_key else leaf.dtype)
    size = int(np.prod(shape))
    value = jnp.asarray(packed[dtype][offsets[dtype] : offsets[dtype] + size]).reshape(shape)
    offsets[dtype] += size
    out.append(jax.random.wrap_key_data(value, impl=jax.random.key_impl(leaf)) if is_key else value)
  return jax.tree.unflatten(treedef, out)


def _progress(iterable, start, total, enabled):
  if not enabled:
    return iterable
  from tqdm.auto import tqdm

  return tqdm(iterable, initial=start, total=total, desc="rounds", unit="round", dynamic_ncols=True)


def _r1_sum(recall: Mapping[str, float]) -> float:
  return recall["i2t_R@1"] + recall["t2i_R@1"]


def run(
  config, workdir: str | pathlib.Path, *, overwrite: bool = False, progress: bool = True
) -> dict[str, Any]:
  """Trains every method of ``config.methods``; writes metrics, checkpoints and the report.

  Returns:
    the final results (also written to ``results.json``).
  """
  clients, states, train_data, server, server_params, public, test, names = build(config)
  workdir = pathlib.Path(workdir)
  with lock_workdir(workdir):  # One run per workdir; before anything is written.
    resumed = prepare_workdir(workdir, config.to_dict(), overwrite=overwrite)
    started = time.time()
    methods = tuple(config.methods)
    cc = _cream_config(config)

    mesh = core.client_mesh(1)
    fed = creamfl.creamfl(clients, server, cc)
    local = creamfl.server_only(server, cc)
    init_key = jax.random.fold_in(jax.random.key(config.seed), 10_000)
    variants = {m: creamfl.variant(**creamfl.VARIANTS[m]) for m in methods if m != LOCAL}
    # Each method owns a copy of the same initial state: rounds donate their input.
    make_states = lambda: {
      m: jax.tree.map(jnp.copy, fed.init(server_params, states, init_key)) for m in methods
    }
    state = {m: s.place(mesh) for m, s in make_states().items()}

    fed_step = jax.jit(lambda s, v: fed.round(s, train_data, public, v), donate_argnums=0)
    local_step = jax.jit(lambda s: local.round(s, public), donate_argnums=0)

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

    pack = jax.jit(lambda states: {m: _pack(s) for m, s in states.items()})
    checkpointer = Checkpointer(
      workdir / "checkpoints", max_to_keep=2, save_interval_steps=config.checkpoint_every
    )
    start_round = 0
    ledgers = {m: ledger_lib.Ledger.zeros(len(names)) for m in methods}
    if resumed and checkpointer.latest_step() is not None:
      target = jax.eval_shape(lambda: {m: _pack(s) for m, s in state.items()})
      start_round, packed = checkpointer.restore_latest_good(target)
      state = {m: _unpack(packed[m], state[m]).place(mesh) for m in methods}
      stored = checkpointer.restore_metadata(start_round)["ledgers"]
      ledgers = {m: ledger_lib.Ledger.from_dict(stored[m]) for m in methods}
    writer = MetricWriter(workdir, "creamfl", resume_round=start_round if resumed else None)
    history = _load_history(workdir, methods, start_round)
    up_bytes, down_bytes = _bytes_per_client(config, clients)

    bar = _progress(range(start_round, config.rounds), start_round, config.rounds, progress)
    results: dict[str, dict[str, float]] = {}
    for r in bar:
      evaluate_now = (r + 1) % config.eval_every == 0 or r + 1 == config.rounds
      scalars = {}
      for m in methods:
        if m == LOCAL:
          state[m], out = local_step(state[m])
        else:
          state[m], out = fed_step(state[m], variants[m])
        _check_finite(m, r, out, names, checkpointer)
        scalars[f"{m}/server_loss"] = float(out["server_loss"])
        if m != LOCAL:
          active = np.concatenate([np.asarray(a) for a in out["active"]])
          ledgers[m] = ledgers[m].add(
            up=np.where(active, up_bytes, 0), down=np.where(active, down_bytes, 0), round=r + 1
          )
          scalars[f"{m}/kd_loss"] = float(out["kd_loss"])
        if evaluate_now:
          results[m] = evaluate(state[m])
          scalars |= {f"{m}/{k}": v for k, v in results[m].items()}
          history[m].append((r + 1, _r1_sum(results[m])))
      writer.write(r + 1, scalars)
      checkpointer.save(r + 1, pack(state), metadata={"round": r + 1, "ledgers": ledgers})
      if evaluate_now and hasattr(bar, "set_postfix"):
        best = max(results, key=lambda m: _r1_sum(results[m]))
        bar.set_postfix(best=f"{best} {_r1_sum(results[best]):.1f}")
    checkpointer.wait()
    checkpointer.close()
    writer.close()

    if not results:  # A run resumed after its last round evaluates anew.
      results = {m: evaluate(state[m]) for m in methods}
    wall = time.time() - started
    return _report(config, workdir, methods, results, history, ledgers, wall, start_round)


def _check_finite(method, r, out, names, checkpointer):
  bad = [] if bool(out["server_finite"]) else ["the server"]
  if "client_finite" in out:
    flags = np.concatenate([np.asarray(f) for f in out["client_finite"]])
    bad += [names[i] for i in np.flatnonzero(~flags)]
  if bad:
    raise NonFiniteError(
      f"{method} round {r + 1}: an update produced NaN/Inf for {', '.join(bad)}; "
      f"{checkpoint_note(checkpointer.latest_step())}."
    )


def _load_history(workdir, methods, start_round):
  """R@1 sums of the rounds before a resume, read back from metrics.jsonl."""
  history = {m: [] for m in methods}
  if not start_round:
    return history
  for record in read_metrics(workdir):
    if record["round"] > start_round:
      continue
    for m in methods:
      if f"{m}/i2t_R@1" in record:
        history[m].append((record["round"], record[f"{m}/i2t_R@1"] + record[f"{m}/t2i_R@1"]))
  return history


def _report(config, workdir, methods, results, history, ledgers, wall, start_round):
  fmt = report_lib.format_table
  rounds = config.rounds
  local_sum = _r1_sum(results[LOCAL]) if LOCAL in results else None
  rows = []
  traffic = {}
  for m in methods:
    rec = results[m]
    traffic[m] = {
      "up_per_round": ledgers[m].total_up / rounds,
      "down_per_round": ledgers[m].total_down / rounds,
    }
    per_round = (ledgers[m].total_up + ledgers[m].total_down) / rounds
    gain = "" if local_sum is None else f"{_r1_sum(rec) - local_sum:+.2f}"
    rows.append(
      [m]
      + [rec[k] for k in RECALL_KEYS]
      + [_r1_sum(rec), sum(rec[k] for k in RECALL_KEYS), gain, ledger_lib.format_bytes(per_round)]
    )
  headers = ["method", *RECALL_KEYS, "R@1_sum", "RSUM", "vs local", "bytes/round"]
  table = fmt(headers, rows)
  protocol = "full set" if config.test.folds is None else f"{config.test.folds} folds"
  summary = (
    f"Server ({config.server.image_encoder} + {config.server.text_encoder}) after {rounds} rounds; "
    f"Recall@K (%) on {config.test.size} held-out test images x {data.WorldConfig().captions_per_image} "
    f"captions ({protocol}); {sum(config.clients[g].num for g in GROUPS)} clients, "
    f"{config.creamfl.num_selected} per round, P={config.public.size}, d={config.rep_dim}, "
    f"seed {config.seed}; wall time {wall:.0f} s"
    + (f" (resumed at round {start_round})" if start_round else "")
  )
  report_lib.write_report(
    workdir / "report.md",
    title="CreamFL and its variants: server image-text retrieval",
    sections=[("Result", summary), ("Recall@K (%)", table), ("Curves", "![R@1 sum](curves.png)")],
  )
  report_lib.plot_curves(
    workdir / "curves.png",
    {"server R@1_sum (i2t + t2i)": {m: history[m] for m in methods}},
    title="Server retrieval on the test set",
    ylabel="R@1 sum (%)",
  )
  result = {
    "recall": results,
    "r1_sum": {m: _r1_sum(results[m]) for m in methods},
    "rsum": {m: sum(results[m][k] for k in RECALL_KEYS) for m in methods},
    "traffic": traffic,
    "rounds": rounds,
    "seed": config.seed,
    "wall_time_s": wall,
  }
  (workdir / "results.json").write_text(json.dumps(result, indent=2))
  print("\n" + table + "\n\n" + summary)
  return result


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
