"""The CreamFL experiment: clients, server, data, each round's metrics, the report.

``run(config, workdir)`` is what ``python -m experiments.main
--config=experiments/creamfl.py`` calls: :func:`fedjax_mm.runner.loop.run` of
:func:`experiment`, which trains every method of ``config.methods`` side by
side from the same initial server and clients, on the same data and seeds:
``local`` (the server alone on the public set), the ``reamFL`` variants,
``CreamFL`` and ``CreamFL+Muscle`` (:data:`fedjax_mm.algorithms.creamfl.VARIANTS`),
Table 1's distillation baselines ``FedMD``, ``FedET``, ``FedGEMS``
(:data:`fedjax_mm.algorithms.creamfl_baselines.BASELINES`), and its
model-homogeneous ``FedAvg`` and ``FedIoT`` (:data:`PARAMETER_ROWS`: clients of
the server's size on the same private data, the public set given to the
multimodal clients, towers averaged per modality;
:mod:`fedjax_mm.algorithms.creamfl_fedavg`), which send parameters (their
ledger counts the towers, both ways).
All federated methods share one compiled round (the variant is a runtime
argument); ``local`` has its own. The bytes of the selected clients go to each
method's ledger. Workdir, checkpoints, resume, NaN guard and the files written
are the loop's.

**Evaluation, as CreamFL's Table 1.** The paper tests the server on MS-COCO,
the distribution of its public set, on the "1K" and "5K" test sets of Karpathy
& Fei-Fei, and its ``R@1_sum`` adds four numbers: i2t and t2i R@1 on the 1K
and on the 5K test (CreamFL: 49.66 + 38.94 + 5K's two = 132.88). The
reference code computes exactly that (``MMFL.train``: ``n_fold`` i2t/t2i R@1
with ``n_crossfolds=5`` plus the full-set i2t/t2i R@1). Here the test set is
``N = max(test.sizes)`` held-out images of the embedded world drawn at
``test.shift`` (default 1.0, the public set's distribution), with 5 captions
each; for every size ``s`` of ``test.sizes`` (default ``(1000, 5000)``) the
"``s`` test" averages i2t / t2i Recall@1/5/10 over the ``N / s`` consecutive
folds of ``s`` images (:func:`fedjax_mm.metrics.image_text_recall`), so
``s = N`` is the full set, and ``R@1_sum``
(:func:`~fedjax_mm.runner.creamfl_report.r1_sum`) adds i2t and t2i R@1 over the
sizes. Beside every table stands chance
(:func:`~fedjax_mm.metrics.retrieval.chance_recall`, ``~K/s``). ``test.private_size`` images of the clients' private distribution
(shift 0) give a smaller, separately labelled table (0 turns it off); they are
not in ``R@1_sum``. After every ``eval_every`` rounds (and the last) every
method's server is evaluated.

**Data.** ``config.data.source`` picks where the sets come from: the embedded
world (``"world"``, the default: seeded draws, ``public.shift`` and ``test.shift``
apply) or the papers' datasets through TFDS (``"tfds"``: :func:`_tfds_sets`).
Then each client group's pool is ``num x train_size`` examples of the train split of
``data.clients.<group>`` (image: CIFAR-100, text: AG News, multimodal: COCO's
image-caption pairs, as TFDS has no Flickr30K), split among its clients by
Dirichlet(alpha) over its class label (multimodal: each image's first object class);
the public set is the next ``public.size`` examples of ``data.public``'s train split
(disjoint from the multimodal clients' when both read ``coco_captions``), and the
server's test set the first ``max(test.sizes)`` images of its test split (Karpathy's
5K test), scaled down with ``data.limit`` (:func:`num_test_images`). A TFDS run writes
what each set got (``results.json`` ``"data"``, a report section). The VQA analogue
and the private test are the world's and refuse ``"tfds"`` at validation.

**Token spaces.** Each text tower reads the captions of its own token space
(:mod:`fedjax_mm.core.text`; :func:`token_space`, :func:`text_spaces`): an ``hf:``
tower its checkpoint's tokens (``caption:<checkpoint>``), a zoo tower (``gru``,
``transformer_t``, ...) the world's ids (``caption``) on the world, and on TFDS,
whose English it cannot read, the ids of ``data.text_tokenizer`` (:func:`zoo_tokenizer`,
under that checkpoint's key, shared with an ``hf:`` tower of the same checkpoint; its
embedding sized to that tokenizer, :func:`text_sizes`). The public set holds the
same captions once per space, each group's private data its own space's (and the
server's, for the FedAvg / FedIoT rows' server-sized clients), the test sets the
server's; the server and each group read their key (``ServerDef.text_key``,
``ClientGroup.text_key``). So ``:paper``'s GRU clients run beside its BERT server.
A run of one space computes exactly what it did before.

**VQA, as CreamFL's Table 2** (``config.vqa``; :mod:`fedjax_mm.algorithms.vqa`,
:mod:`fedjax_mm.data.vqa`). After the last round every method's server is frozen
and, for each, a small fusion head learns to answer template questions ("what
colour is the circle ?", "how many objects are there ?", ...) about
``vqa.train_images`` fresh scenes at ``test.shift``, from the server's image
feature and its text tower's feature of the question's argument phrase; its
accuracy on the questions about ``vqa.test_images`` other scenes, overall and
per question type, is the row's Table 2 entry. Beside it: the same head
trained blind (question only) and each type's majority answer. Every row gets
the same questions, head initialisation and minibatches, so rows differ only
by their servers' features. How this differs from the paper's VQA v2 protocol
(template questions, exact match over 38 answers, a server frozen throughout):
:mod:`fedjax_mm.algorithms.vqa`.

At the end it prints and writes tables like CreamFL's Table 1 / FedMuscle's
Table 3 and Table 2's analogue, plus bytes per round
(:func:`fedjax_mm.runner.creamfl_report.report`);
:func:`fedjax_mm.runner.creamfl_report.summarize` gives the same tables over seeds.

Everything is validated before anything is compiled: a bad config raises
:class:`ConfigError` with a one-line message (``experiments/main.py`` prints it
and exits with status 2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fedjax_mm import core, data, metrics, models
from fedjax_mm.algorithms import creamfl, creamfl_fedavg
from fedjax_mm.core import ledger as ledger_lib
from fedjax_mm.core import optim, processes
from fedjax_mm.core import text as text_lib
from fedjax_mm.core.client import apply_in_batches
from fedjax_mm.runner import creamfl_report, loop, validation
from fedjax_mm.runner.creamfl_data import (
  METHODS,
  PARAMETER_ROWS,
  ROWS,
  VQA_FEATURES,
  _client_groups,
  _cream_config,
  _test_set,
  _tfds_reads,
  _tfds_sets,
  _world,
  text_key,
  text_sizes,
  text_spaces,
  token_space,
  vqa_accuracy,
  vqa_data,
)
from fedjax_mm.runner.creamfl_report import GROUPS, LOCAL, RECALL_KEYS, r1_sum, size_label
from fedjax_mm.runner.errors import ConfigError
from fedjax_mm.runner.validation import data_source


def validate(config) -> None:
  """Checks a config. Raises :class:`ConfigError` with a one-line message."""
  faults = validation.check_common(config, validation.CREAMFL, config.methods, METHODS)
  validation.check_devices(config)
  parameter_rows = [m for m in config.methods if m in PARAMETER_ROWS]
  if faults.enabled and parameter_rows:
    raise ConfigError(f"faults: {', '.join(parameter_rows)} simulate no client faults; drop them.")
  if config.image_size < 16 or config.image_size % 4:
    raise ConfigError(f"image_size must be a multiple of 4 and >= 16, got {config.image_size}.")
  if config.pretrained:
    c = config.clients
    names = [c.image.encoder, c.text.encoder, c.multimodal.image_encoder]
    names += [c.multimodal.text_encoder, config.server.image_encoder, config.server.text_encoder]
    for name in names:
      if models.hf.is_hf(name):  # its own checkpoint
        continue
      try:
        cfg = models.pretrained.read_config(f"{config.pretrained}/{name}")
      except models.pretrained.PretrainedError as e:
        raise ConfigError(str(e)) from None
      if cfg["modality"] == "image" and cfg["image_size"] != config.image_size:
        raise ConfigError(
          f"{config.pretrained}/{name} was pretrained on {cfg['image_size']}x{cfg['image_size']} "
          f"images; set image_size={cfg['image_size']} or pretrained=''."
        )
  for key, choices in (
    ("server_optimizer", SERVER_OPTIMIZERS),
    ("server_lr_schedule", SERVER_LR_SCHEDULES),
  ):
    if config[key] not in choices:
      raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {config[key]!r}.")
  total = 0
  for name in GROUPS:
    spec = config.clients[name]
    total += spec.num
    if name == "multimodal":
      validation.check_encoder("clients.multimodal.image_encoder", spec.image_encoder, "image")
      validation.check_encoder("clients.multimodal.text_encoder", spec.text_encoder, "text")
    else:
      validation.check_encoder(f"clients.{name}.encoder", spec.encoder, name)
  validation.check_encoder("server.image_encoder", config.server.image_encoder, "image")
  validation.check_encoder("server.text_encoder", config.server.text_encoder, "text")
  c = config.creamfl
  if c.num_selected > total:
    raise ConfigError(
      f"creamfl.num_selected ({c.num_selected}) must be between 1 and the number of clients ({total})."
    )
  if c.batch_size < 2:
    raise ConfigError(f"creamfl.batch_size (B={c.batch_size}) must be at least 2.")
  if config.public.size < c.batch_size or config.public.size % c.batch_size:
    raise ConfigError(
      f"public.size ({config.public.size}) must be a positive multiple of creamfl.batch_size ({c.batch_size})."
    )
  if c.public_batch_size is not None and c.public_batch_size > config.public.size:
    raise ConfigError(
      f"creamfl.public_batch_size ({c.public_batch_size}) must be between 1 and public.size ({config.public.size})."
    )
  if "CreamFL+Muscle" in config.methods:
    if c.muscle_partners > c.num_selected:
      raise ConfigError(
        f"creamfl.muscle_partners (M={c.muscle_partners}) must be between 1 and creamfl.num_selected ({c.num_selected})."
      )
    if not 0 < c.muscle_tau_reduced < c.muscle_tau_full:
      raise ConfigError(
        f"creamfl.muscle_tau_reduced ({c.muscle_tau_reduced}) must be in (0, muscle_tau_full = {c.muscle_tau_full}) so that gamma > 0."
      )
  sizes = tuple(config.test.sizes)
  if not sizes or len(set(sizes)) != len(sizes) or min(sizes) < 2:
    raise ConfigError(f"test.sizes must be distinct sizes >= 2, got {sizes}.")
  if any(max(sizes) % n for n in sizes):
    raise ConfigError(
      f"test.sizes {sizes}: every size must divide the largest ({max(sizes)}), the test set's "
      "size, so that a smaller test is a mean over folds of it."
    )
  if config.test.private_size == 1:
    raise ConfigError("test.private_size must be 0 (no private test) or >= 2, got 1.")
  if config.vqa.features not in VQA_FEATURES:
    raise ConfigError(
      f"vqa.features must be one of {', '.join(VQA_FEATURES)}, got {config.vqa.features!r}."
    )
  # Last, so a missing checkpoint is named first; still before anything is built.
  tfds = data_source(config) == "tfds"
  validation.check_data(config, _tfds_reads(config) if tfds else None)


# ----------------------------------------------------------------------------
# Building clients, server and data


def build(config):
  """Validated client groups, server, initial states, private data, public and test sets.

  The public set holds ``image [P, S, S, 3]`` and the captions ``[P, C, L]`` of every
  token space of the run (:func:`text_spaces`), each under its key. The test sets
  are ``{"public": ..., "private": ...}`` (the latter only with
  ``test.private_size``), each ``image [N, S, S, 3]``, the server's captions
  ``[N C, L]`` (under its text key) and ``ids [N C]``. With ``data.source = "tfds"``
  the data are read by :func:`_tfds_sets` (no private test).
  """
  validate(config)
  world = _world(config)
  root = jax.random.key(config.seed)
  sets = _tfds_sets(config) if data_source(config) == "tfds" else None
  clients, states, train_data, names = _client_groups(config, root, pools=sets)

  server_model = creamfl.DualEncoder(
    config.server.image_encoder,
    config.server.text_encoder,
    rep_dim=config.rep_dim,
    image_size=config.image_size,
    rngs=nnx.Rngs(jax.random.fold_in(root, 100)),
    pretrained=config.pretrained or None,
    **text_sizes(config),
  )
  graphdef, server_params = nnx.split(server_model)
  server = creamfl.ServerDef(
    graphdef,
    server_optimizer(config),
    text_key=text_key(config, config.server.text_encoder),
    lr_factor=server_lr_factor(config),
  )

  spaces = text_spaces(config)
  keys = ("image", *(text_lib.caption_key(s) for s in spaces))
  if sets is not None:
    public = {k: jnp.asarray(sets["public"][k]) for k in keys}
    return clients, states, train_data, server, server_params, public, sets["test"], names
  public = data.generate(
    config.seed * 1000 + 1, config.public.size, config=world, shift=config.public.shift
  )
  public = text_lib.in_spaces(public, spaces)  # the same captions, once per token space
  public = {k: jnp.asarray(public[k]) for k in keys}
  # The test set of CreamFL's Table 1: the public distribution, N = max(test.sizes) images.
  server_space = token_space(config, config.server.text_encoder)
  test = {
    "public": _test_set(
      config.seed * 1000 + 2, max(config.test.sizes), world, config.test.shift, server_space
    )
  }
  if config.test.private_size:
    test["private"] = _test_set(
      config.seed * 1000 + 3, config.test.private_size, world, 0.0, server_space
    )
  return (
    clients,
    states,
    train_data,
    server,
    server_params,
    public,
    test,
    names,
  )


# ----------------------------------------------------------------------------
# The experiment


def _bytes_per_client(config, clients, num_public: int) -> tuple[np.ndarray, np.ndarray]:
  """Bytes one selected client sends and receives per round (``[num_clients]`` each), for a
  public set of ``num_public`` pairs (``public.size``, or fewer read through TFDS)."""
  matrix = jax.ShapeDtypeStruct((num_public, config.rep_dim), jnp.float32)
  down = ledger_lib.tree_bytes({m: matrix for m in creamfl.MODALITIES})  # I_glob, T_glob
  up, downs = [], []
  for client, spec_name in zip(clients, GROUPS, strict=True):
    sent = ledger_lib.tree_bytes({m: matrix for m in client.modalities})
    up += [sent] * config.clients[spec_name].num
    downs += [down] * config.clients[spec_name].num
  return np.asarray(up, np.int64), np.asarray(downs, np.int64)


def _tower_bytes(server_params, clients, config) -> np.ndarray:
  """Bytes of the server-sized towers each client holds (FedAvg / FedIoT send them both ways)."""
  out = []
  for client, name in zip(clients, GROUPS, strict=True):
    towers = creamfl_fedavg.client_towers(client)
    size = sum(ledger_lib.tree_bytes(server_params[a]) for pairs in towers.values() for a in pairs)
    out += [size] * config.clients[name].num
  return np.asarray(out, np.int64)


#: ``server_optimizer``'s choices: the default AdamW, or the paper's AdamP (Sec. 4.1).
SERVER_OPTIMIZERS = ("adamw", "adamp")
#: ``server_lr_schedule``'s: constant, or cosine annealing over the run's rounds (Sec. 4.1).
SERVER_LR_SCHEDULES = ("constant", "cosine")


def server_optimizer(config) -> optax.GradientTransformation:
  """The server's optimizer (steps 1 and 7): AdamW, or AdamP as the authors' code runs it.

  Both at ``server_learning_rate`` with decoupled weight decay ``server_weight_decay``;
  AdamP (:func:`fedjax_mm.core.optim.adamp`) with the ``adamp`` package's defaults
  (``delta = 0.1``, ``wd_ratio = 0.1``), as the code's ``optimizers.py`` builds it.
  """
  lr, wd = config.server_learning_rate, config.server_weight_decay
  if config.server_optimizer == "adamp":
    return optim.adamp(lr, weight_decay=wd)
  return optax.adamw(lr, weight_decay=wd)


def server_lr_factor(config):
  """``round -> factor`` of the server's rate: ``None`` (constant) or cosine annealing.

  ``cosine``: PyTorch's ``CosineAnnealingLR(T_max=rounds)`` stepped after every round,
  as the authors' code steps it (``T_max = 30``, its default number of rounds); here
  ``T_max`` is the run's ``rounds``.
  """
  if config.server_lr_schedule == "constant":
    return None
  rounds = int(config.rounds)
  return lambda r: optim.cosine_annealing(r, rounds)


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
  # Each group's clients, padded to a multiple of the mesh's devices: padding clients
  # hold no samples, are never selected (draws by rank among the real clients) and are
  # sliced off every per-client output (real()).
  mesh = core.job_mesh(validation.check_devices(config))
  nums = [config.clients[name].num for name in GROUPS]
  padded = [core.padded_size(n, mesh) for n in nums]

  def pad(groups, place=False):
    out = tuple(g.pad(k) for g, k in zip(groups, padded, strict=True))
    return tuple(g.place(mesh) for g in out) if place else out

  def real(per_group) -> np.ndarray:
    """Per-group ``[K'_g]`` outputs -> ``[sum_g K_g]``, the real clients in order."""
    return np.concatenate([np.asarray(a)[:n] for a, n in zip(per_group, nums, strict=True)])

  fed_data, states = pad(train_data, place=True), pad(states)
  fed = creamfl.creamfl(clients, server, cc, faults=validation.check_faults(config))
  local = creamfl.server_only(server, cc)
  init_key = jax.random.fold_in(jax.random.key(config.seed), 10_000)
  # Traced with the mesh in context: a compiled loop over clients runs per device. The
  # clients' data are an argument: no jitted function may close over an array split over
  # several processes (job_mesh). So is the public set (replicated): closed over, it would
  # be a constant of the compiled round, copied into it and into every cache entry.
  fed_step = core.jit_round(lambda s, d, v, p: fed.round(s, d, p, v))
  local_step = core.jit_round(lambda s, p: local.round(s, p))
  on_mesh = core.replicate(public, mesh)
  variants = {m: creamfl.variant(**ROWS[m]) for m in methods if m in ROWS}
  rounds = {m: functools.partial(fed_step, d=fed_data, v=variants[m], p=on_mesh) for m in variants}
  if LOCAL in methods:
    rounds[LOCAL] = functools.partial(local_step, p=on_mesh)
  inits = {m: lambda: fed.init(server_params, states, init_key) for m in methods}
  if any(m in PARAMETER_ROWS for m in methods):
    # Clients of the server's size on the same private data; the public set goes to the
    # multimodal clients (CreamFL, Sec. 4.1).
    avg_clients, avg_states, avg_data, _ = _client_groups(
      config, jax.random.key(config.seed), server_size=True, train_data=train_data
    )
    avg_data = pad(
      tuple(
        creamfl_fedavg.with_public(d, public) if c.multimodal else d
        for c, d in zip(avg_clients, avg_data, strict=True)
      ),
      place=True,
    )
    avg_states = pad(avg_states)
    avg = creamfl_fedavg.fedavg_towers(avg_clients, cc)
    avg_step = core.jit_round(lambda s, d, f: avg.round(s, d, f))
    for m, iot in PARAMETER_ROWS.items():
      if m in methods:
        weight = jnp.float32(cc.iot_weight if iot else 1.0)
        rounds[m] = functools.partial(avg_step, d=avg_data, f=weight)
        inits[m] = lambda: avg.init(server_params, avg_states, init_key)
    avg_up = _tower_bytes(server_params, avg_clients, config)
  rounds = {m: rounds[m] for m in methods}

  sizes = tuple(config.test.sizes)
  # Each size is a mean over max(sizes) / size folds of the test set (of N <= max(sizes)
  # images when data.limit cut a TFDS one: num_test_images).
  folds = [max(sizes) // n for n in sizes]
  data_note = None
  if data_source(config) == "tfds":  # what was read, beside what the config asked
    data_note = creamfl_report.tfds_note(config, train_data, public, test)

  @jax.jit
  def embed(params, images, captions):  # The test set is an argument, not a baked constant.
    model = server.merge(params)
    images = apply_in_batches(lambda x: model.represent(x, "image"), images, 256)
    texts = apply_in_batches(lambda x: model.represent(x, "text"), captions, 256)
    return images, texts

  def recall_of(params, test_set, folds):
    images, texts = embed(params, test_set["image"], test_set[server.text_key])
    return [
      {k: float(r[k]) for k in RECALL_KEYS}
      for r in (metrics.image_text_recall(images, texts, test_set["ids"], folds=f) for f in folds)
    ]

  qa = vqa_data(config) if config.vqa.enabled else None

  def evaluate(s) -> dict[str, dict[str, float]]:
    """``{size label: recall, ...}`` on the public-distribution test, ``"private"`` too if any;
    after the last round also ``"vqa"`` (:func:`vqa_accuracy`), when ``vqa.enabled``."""
    params = processes.gather(s.server_params)  # This process's copy, in a job of several.
    public = recall_of(params, test["public"], folds)
    out = {size_label(n): r for n, r in zip(sizes, public, strict=True)}
    if "private" in test:
      out["private"] = recall_of(params, test["private"], [None])[0]
    # The state's own round count says whether this is the final server, so a rerun of a
    # finished run (the loop evaluates it anew) gets its VQA entry too.
    if qa is not None and int(s.round) == config.rounds:
      out["vqa"] = vqa_accuracy(config, server.graphdef, params, qa)
    return out

  def nonfinite(out) -> list[str]:
    bad = [] if bool(out["server_finite"]) else ["the server"]
    if "client_finite" in out:
      bad += [names[i] for i in np.flatnonzero(~real(out["client_finite"]))]
    return bad

  up_bytes, down_bytes = _bytes_per_client(config, clients, public["image"].shape[0])

  def traffic(m, out):
    if m == LOCAL:
      return None
    active = real(out["active"])
    if m in PARAMETER_ROWS:  # Towers down and up, the same bytes each way.
      return np.where(active, avg_up, 0), np.where(active, avg_up, 0)
    sent = active
    if "dropped" in out:  # Dropped clients received I_glob, T_glob but sent nothing.
      sent = active & ~real(out["dropped"])
    return np.where(sent, up_bytes, 0), np.where(active, down_bytes, 0)

  def scalars(r, outs, evals):
    values = {}
    for m in methods:
      if m in PARAMETER_ROWS:
        client_loss = real(outs[m]["client_loss"])
        active = real(outs[m]["active"])
        values[f"{m}/client_loss"] = float(client_loss[active].mean())
      else:
        values[f"{m}/server_loss"] = float(outs[m]["server_loss"])
      if m in ROWS:
        values[f"{m}/kd_loss"] = float(outs[m]["kd_loss"])
        values |= loop.fault_scalars(outs[m], prefix=f"{m}/")
      if m in evals:
        values[f"{m}/R@1_sum"] = r1_sum(evals[m], sizes)
        for test_name, recall in evals[m].items():
          if test_name != "vqa":
            values |= {f"{m}/{test_name}/{k}": v for k, v in recall.items()}
        if "vqa" in evals[m]:
          values[f"{m}/vqa/accuracy"] = evals[m]["vqa"]["accuracy"]
          values[f"{m}/vqa/blind_accuracy"] = evals[m]["vqa"]["blind_accuracy"]
    return [("creamfl", values)]

  def postfix(evals):
    if not evals:
      return {}
    best = max(evals, key=lambda m: r1_sum(evals[m], sizes))
    return {"best": f"{best} {r1_sum(evals[best], sizes):.1f}"}

  return loop.Experiment(
    init=lambda: {m: jax.tree.map(jnp.copy, inits[m]()).place(mesh) for m in methods},
    methods=rounds,
    evaluate=evaluate,
    nonfinite=nonfinite,
    scalars=scalars,
    runs=("creamfl",),
    report=lambda outcome: creamfl_report.report(
      config,
      methods,
      outcome,
      None if qa is None else creamfl_report.vqa_protocol(config, qa),
      data_note,
    ),
    traffic=traffic,
    eval_every=config.eval_every,
    postfix=postfix,
  )


#: CreamFL as the loop runs it (:class:`fedjax_mm.runner.loop.System`).
SYSTEM = loop.System(
  name="creamfl",
  methods=METHODS,
  validate=validate,
  experiment=experiment,
  tables=creamfl_report.tables,
)
run = SYSTEM.run
