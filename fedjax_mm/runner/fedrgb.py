r"""FedRGB against FedAvg and Local on the embedded world (issue 19, scaled).

  python -m experiments.main --config=experiments/fedrgb.py

Data (App. C, scaled): the world's image-caption pairs (caption 0 of each image).
The paper's clients hold chest X-rays labelled with five diseases and split by a
Dirichlet / LDA draw (concentration 1) over the 2^5 disease combinations; here the
five "diseases" are the presence of the world's first five shapes, so a pair's
category is the 5-bit code of which of them its scene contains (32 categories),
and each client draws its category proportions from Dirichlet(``dirichlet_alpha``)
(:func:`fedjax_mm.data.partition.dirichlet_partition` with fixed client sizes).
Each client's samples split into ``train_per_client`` training pairs and
``test_per_client`` held-out pairs.

Evaluation (Sec. 5 / App. C.2), on each client's held-out pairs, with the global
model (Local: the client's own model):

* ``i2t_R@K`` / ``t2i_R@K`` (K = 1, 5): both directions over the client's whole
  held-out set (:func:`fedjax_mm.metrics.image_text_recall`);
* ``gallery_t2i_R@K``: text-to-image with the gallery being a batch of
  ``gallery`` pairs, as the authors' code scores top-1 / top-5 within each
  validation batch (its ``precision_at_k``; the paper says "top-1 recall
  accuracy" and no gallery), i.e. the held-out set cut into consecutive folds of
  ``gallery`` pairs, averaged;
* average and worst client of each (the paper's main table);
* out-of-distribution retrieval, both directions, on ``ood_test`` pairs of the
  world's public distribution (``shift = PUBLIC_SHIFT``; the paper's unseen
  domain, Table 5), for Local the mean over the clients' models.

Chance levels are printed beside them: ``R@K = K / n`` for a gallery of ``n``.
Rows (:data:`ROWS`): ``fedrgb``, ``fedavg``, ``local``, ``centralised`` (one model on
the union of the clients' training pairs, FedAvg's steps summed over clients: the paper's
"Centralized" upper bound; no traffic), ``fedema`` (FedEMA's divergence-aware EMA of the
global and each client's last model at the start of a round, local loss ``L_task``, as the
paper adapts its self-supervised baselines; :mod:`fedjax_mm.server.fedema`),
``fedema_code`` (the same with the authors' code's divergence), ``fedx`` (FedX's local and
global contrastive and relational distillation from the frozen received global model, with
``L_task`` as the local contrastive term; FedAvg) and ``fedmae`` (``L_task`` plus MAE's
masked-patch reconstruction through a small decoder that is averaged but never evaluated;
FedAvg), both as the paper adapts its self-supervised baselines (their adaptations in
:mod:`fedjax_mm.algorithms.fedrgb`), ``fedmae_masked`` (FedMAE with ``L_task`` on the
masked images; ours), and the ablations of Table 4,
``fedrgb_avg_alig`` ("->avg.alig."), ``fedrgb_cl`` ("->CL") and ``fedrgb_uniform``
(``rho = 0``: uniform DRO weights; ours), and ``fedavg_matched``, FedAvg with
``stage1_steps + stage2_steps`` aligner steps a round, as many as FedRGB's two stages
take (ours: a compute-matched control).

After the last round, for the global models (FedRGB's and FedAvg's rows; Local has
none), :mod:`fedjax_mm.algorithms.fedrgb_eval` adds

* the distortion matrix of Tables 6 / 11 (``config.distortion``): the final model
  retrained for ``steps`` steps on each client ``i`` by the method's own client update
  (``"own"``) and by ``L_task`` alone (``"task"``, a control; for FedAvg the two are the
  same retraining), entry ``(i, j)`` the drop in mean paired cosine on client ``j``'s
  held-out pairs; summarised by the mean off-diagonal entry, the diagonal's mean and
  the mean of all (the paper's "Avg" row averaged), beside "no retraining" (0) and the
  model's mean paired and unpaired cosine;
* downstream fine-tuning (``config.downstream``, the paper's RSNA / COVIDx): the image
  tower + a linear layer fine-tuned on 1% and 10% of ``train`` fresh labelled scenes,
  accuracy on ``test`` more, for :data:`DOWNSTREAM`'s tasks, beside the majority class of
  the test set and the initial model (World-CLIP encoders, untrained aligners);
* downstream segmentation (``config.segmentation``, the paper's RSNA Dice): on the same
  labelled scenes and fractions, a U-Net-style decoder trained on the frozen image tower
  (:func:`fedjax_mm.algorithms.fedrgb_eval.segmentation_dice`) to segment
  ``segmentation.target`` (``"objects"``: every object's pixels, the analogue of RSNA's
  opacity masks; or one shape's name), Dice on the test scenes' pixels, beside the
  all-positive Dice and the initial model.

The paper's sweeps (rho, alpha, rounds, clients) are command-line overrides of this config
(``--config.fedrgb.rho``, ``--config.fedrgb.alpha``, ``--config.rounds``,
``--config.num_clients``); the README gives the loops and the measured tables.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mm import core, losses, models
from fedjax_mm.algorithms import fedrgb as alg
from fedjax_mm.algorithms import fedrgb_eval
from fedjax_mm.core import processes
from fedjax_mm.core.sharding import replicated, traced_in
from fedjax_mm.data import partition, world
from fedjax_mm.runner import fedrgb_report, loop, validation
from fedjax_mm.runner.errors import ConfigError
from fedjax_mm.runner.fedrgb_report import DOWNSTREAM, fraction_label
from fedjax_mm.runner.report import format_table

KS = (1, 5)
# Pairs embedded at once when scoring a test or OOD set (core.client.apply_in_batches), as
# the other runners do. Embedding a whole set at once held every layer's activations of it:
# the smoke config with ood_test=20000 peaked at 13.2 GB resident, 2.7 GB in minibatches.
EVAL_BATCH = 256
#: Row name -> (algorithm method, RgbConfig overrides; a callable override is a function of
#: the experiment config): the paper's rows and ablations.
ROWS = {
  "fedrgb": ("fedrgb", {}),
  "fedavg": ("fedavg", {}),
  "local": ("local", {}),
  "centralised": ("centralised", {}),  # the paper's "Centralized" / "Global" upper bound
  "fedema": ("fedema", {}),  # FedEMA (Zhuang et al. 2022) on L_task, as the paper adapts it
  # FedEMA with the authors' code's divergence (the drift of the client's last training).
  "fedema_code": ("fedema", {"ema_divergence": "code"}),
  "fedx": ("fedx", {}),  # FedX (Han et al. 2022) with L_task, as the paper adapts it
  "fedmae": ("fedmae", {}),  # FedMAE (Yan et al. 2023) with L_task, as the paper adapts it
  # FedMAE with L_task on the masked images (ours: the paper's "masking strategies might hurt
  # the alignment" read as masking entering it).
  "fedmae_masked": ("fedmae", {"mae_contrast": "masked"}),
  "fedrgb_avg_alig": ("fedrgb", {"teacher": "average"}),  # Table 4 "->avg.alig."
  "fedrgb_cl": ("fedrgb", {"guide": "cl"}),  # Table 4 "->CL"
  "fedrgb_uniform": ("fedrgb", {"rho": 0.0}),  # uniform DRO weights (ours)
  # FedAvg with as many aligner steps a round as FedRGB's two stages (ours): a control for
  # FedRGB's extra stage-2 training.
  "fedavg_matched": ("fedavg", {"stage1_steps": lambda c: c.stage1_steps + c.stage2_steps}),
}

#: The five attributes whose presence makes a pair's category (the paper's five diseases).
NUM_ATTRIBUTES = 5


def validate(config) -> None:
  """One-line :class:`ConfigError` naming the key; before any work.

  Ranges of every number are :data:`fedjax_mm.runner.validation.FEDRGB`; the checks
  here are names and relations between fields.
  """
  validation.check_common(config, validation.FEDRGB, config.methods, ROWS)
  f = config.fedrgb
  if f.dro_form not in losses.fedrgb.DRO_FORMS:
    raise ConfigError(f"fedrgb.dro_form must be one of {list(losses.fedrgb.DRO_FORMS)}.")
  if f.dro_source not in alg.DRO_SOURCES:
    raise ConfigError(f"fedrgb.dro_source must be one of {list(alg.DRO_SOURCES)}.")
  if config.image_size % 4:
    raise ConfigError(
      f"image_size must be a multiple of 4 (the ViTs' 4x4 patches; the segmentation "
      f"decoder upsamples the quarter-size feature map), "
      f"got {config.image_size}."
    )
  size, named = validation.mesh_size(config)
  if int(config.num_clients) % size:
    raise ConfigError(
      f"{named} must divide num_clients ({config.num_clients}): each device "
      "trains an equal share of the clients."
    )
  for key, modality in (("image_encoder", "image"), ("text_encoder", "text")):
    name = config[key]
    if models.ENCODERS.get(name, ("",))[0] != modality:
      known = [n for n, (m, _) in models.ENCODERS.items() if m == modality]
      raise ConfigError(f"{key}: unknown {modality} encoder {name!r}; known: {', '.join(known)}.")
  if config.pretrained:
    for encoder, key, field in (
      (config.image_encoder, "image_size", "image_size"),
      (config.text_encoder, "max_len", "max_caption_len"),
    ):
      validation.check_pretrained(
        f"world-clip/{encoder}", key, config[field], field=field, instead="pretrained=False"
      )
  d = config.distortion
  if not isinstance(d.enabled, bool):
    raise ConfigError(f"distortion.enabled must be a bool, got {d.enabled!r}.")
  retrain = tuple(d.retrain)
  bad = [r for r in retrain if r not in fedrgb_eval.RETRAIN]
  if bad or not retrain or len(set(retrain)) != len(retrain):
    raise ConfigError(
      f"distortion.retrain: each of {list(fedrgb_eval.RETRAIN)} at most once, got {list(retrain)}."
    )
  ds = config.downstream
  if not isinstance(ds.enabled, bool) or not isinstance(ds.train_encoder, bool):
    raise ConfigError("downstream.enabled and downstream.train_encoder must be bools.")
  if not tuple(ds.fractions):
    raise ConfigError("downstream.fractions is empty: name at least one share in (0, 1].")
  sg = config.segmentation
  if not isinstance(sg.enabled, bool):
    raise ConfigError("segmentation.enabled must be a bool.")
  if sg.target != "objects" and sg.target not in world.SHAPE_NAMES:
    raise ConfigError(
      f"segmentation.target must be 'objects' or a shape of {list(world.SHAPE_NAMES)}, "
      f"got {sg.target!r}."
    )
  if int(sg.width) % 4:
    raise ConfigError(f"segmentation.width must be a positive multiple of 4, got {sg.width}.")
  for key in ("test_per_client", "ood_test"):  # each is scored in galleries too
    if int(config[key]) < int(config.gallery):
      raise ConfigError(f"{key} ({config[key]}) must be >= gallery ({config.gallery}).")


def segmentation_target(mask: np.ndarray, target: str) -> np.ndarray:
  """``bool [n, S, S]`` foreground of the world's ``mask``: every object, or one shape."""
  mask = np.asarray(mask)
  if target == "objects":
    return mask > 0
  return mask == 1 + world.SHAPE_NAMES.index(target)


def categories(multilabel: np.ndarray) -> np.ndarray:
  """``[n]`` category in ``[0, 32)``: the 5-bit code of the first five shapes' presence."""
  bits = (np.asarray(multilabel)[:, :NUM_ATTRIBUTES] > 0).astype(np.int64)
  return bits @ (1 << np.arange(NUM_ATTRIBUTES))


def build(config) -> dict[str, Any]:
  """Validated config -> client data, OOD pairs, one algorithm per method, initial states."""
  validate(config)
  k = int(config.num_clients)
  per_client = int(config.train_per_client) + int(config.test_per_client)
  wcfg = world.WorldConfig(
    image_size=config.image_size, captions_per_image=1, max_caption_len=config.max_caption_len
  )
  pool = world.generate(config.seed, 2 * k * per_client, config=wcfg)
  labels = categories(pool["multilabel"])
  parts = partition.dirichlet_partition(
    labels, k, alpha=config.dirichlet_alpha, seed=config.seed, samples_per_client=per_client
  )
  rng = np.random.default_rng(config.seed + 1)
  idx = np.stack([np.asarray(p)[rng.permutation(len(p))] for p in parts])
  tr, te = idx[:, : config.train_per_client], idx[:, config.train_per_client :]
  pairs = lambda i: {"images": pool["image"][i], "captions": pool["caption"][i, 0]}
  ood = world.generate(config.seed + 7, config.ood_test, config=wcfg, shift=world.PUBLIC_SHIFT)
  # The labelled downstream set: fresh scenes of the clients' (unshifted) distribution.
  ds = config.downstream
  n_down, n_test_down = int(ds.train), int(ds.test)
  down = world.generate(config.seed + 13, n_down + n_test_down, config=wcfg)
  downstream = {
    "images": jnp.asarray(down["image"][:n_down]),
    "test_images": jnp.asarray(down["image"][n_down:]),
    "masks": jnp.asarray(fedrgb_eval.subset_masks(n_down, ds.fractions)),
    "labels": {name: label(down)[:n_down] for name, (_, label) in DOWNSTREAM.items()},
    "test_labels": {name: label(down)[n_down:] for name, (_, label) in DOWNSTREAM.items()},
  }
  target = segmentation_target(down["mask"], config.segmentation.target)
  downstream["seg_targets"] = jnp.asarray(target[:n_down])
  downstream["seg_test_targets"] = jnp.asarray(target[n_down:])
  f = config.fedrgb
  settings = dict(
    alpha=f.alpha,
    beta=f.beta,
    gamma=f.gamma,
    rho=f.rho,
    dro_form=f.dro_form,
    dro_source=f.dro_source,
    train_encoders=f.train_encoders,
    stage1_steps=config.stage1_steps,
    stage2_steps=config.stage2_steps,
    batch_size=config.batch_size,
    learning_rate=config.learning_rate,
    weight_decay=config.weight_decay,
    client_map=config.client_map,
    ema_tau=config.fedema_tau,
    fedx_tau=config.fedx.tau,
    fedx_target_tau=config.fedx.target_tau,
    fedx_weight=config.fedx.weight,
    mae_ratio=config.fedmae.mask_ratio,
    mae_weight=config.fedmae.weight,
  )
  # The model is built (and its World-CLIP weights read) once: every row starts from the
  # same encoders, aligners and key, hence the same client draws.
  base, base_state = alg.build(
    alg.RgbConfig(method="fedavg", **settings),
    image_encoder=config.image_encoder,
    text_encoder=config.text_encoder,
    image_size=config.image_size,
    vocab_size=len(world.VOCAB),
    max_len=config.max_caption_len,
    dim=config.dim,
    pretrained=config.pretrained,
    key=jax.random.key(config.seed + 2),
    num_clients=k,
  )
  faults = validation.check_faults(config)
  algorithms, states = {}, {}
  for m in config.methods:
    method, overrides = ROWS[m]
    overrides = {key: v(config) if callable(v) else v for key, v in overrides.items()}
    dec_def = dec_params = None
    if method == "fedmae":  # its decoder, from a key of its own (the other rows' draws stay)
      dec_def, dec_params = alg.build_decoder(
        base.encoder_def, base_state.encoder, config.image_size, jax.random.key(config.seed + 23)
      )
    a = alg.FedRGB(
      alg.RgbConfig(**(settings | {"method": method} | overrides)),
      base.encoder_def,
      base.aligner_def,
      dec_def,
      faults=faults,
    )
    algorithms[m] = a
    states[m] = a.algorithm.init(
      base_state.rng, base_state.encoder, base_state.aligner, k, dec_params
    )
  return {
    "base": base,
    "base_state": base_state,
    "algorithms": algorithms,
    "states": states,
    "train": jax.tree.map(jnp.asarray, pairs(tr)),
    "mask": jnp.ones(tr.shape, bool),
    "test": jax.tree.map(jnp.asarray, pairs(te)),
    "ood": {"images": jnp.asarray(ood["image"]), "captions": jnp.asarray(ood["caption"][:, 0])},
    "categories": labels[idx],
    "downstream": downstream,
  }


def experiment(config) -> loop.Experiment:
  setup = build(config)
  algorithms, states0 = setup["algorithms"], setup["states"]
  methods = tuple(config.methods)
  k = int(config.num_clients)
  gallery = int(config.gallery)
  train, mask, test, ood = setup["train"], setup["mask"], setup["test"], setup["ood"]

  # The rounds are traced with the job's mesh in context (traced_in), so core.map_clients
  # runs one loop over clients per device of it. config.devices > 1: the states replicated
  # over that many devices, each trains its share of the clients; the rest of a round (the
  # server, the DRO teacher) is replicated.
  mesh = core.job_mesh(validation.check_devices(config))
  devices = mesh.size  # Every process's devices, in a job of several.
  # The rounds and the evaluation take the data as arguments: closed over, every set would be
  # a constant of the compiled program (a copy of it, and XLA folding its padding at compile
  # time, 1.5 s for one pad of 20,000 OOD pairs).
  data = {"train": train, "mask": mask, "test": test, "ood": ood}
  if devices > 1:
    states0 = {m: core.replicate(s, mesh) for m, s in states0.items()}
    data = core.replicate(data, mesh)

  # Each method's loop state is {"rgb": RgbState, "row": its index in ``methods``}: the row
  # tells evaluate which algorithm's client update retrains it (distortion).
  def round_and_check(a, s, train, mask):
    rgb, out = a.algorithm.round(s["rgb"], train, mask)
    finite = core.all_finite((rgb.encoder, rgb.aligner, rgb.teacher, rgb.weights))
    return {"rgb": rgb, "row": s["row"]}, out | {"finite": finite}

  def jitted_round(m):
    # In the mesh's context on one device too: map_clients' "auto" is then the loop that
    # one device runs (in a process with more devices than the mesh it would vmap).
    fn = traced_in(mesh, functools.partial(round_and_check, algorithms[m]))
    if devices == 1:
      return jax.jit(fn, donate_argnums=0)
    # On several devices the state stays replicated from round to round.
    return jax.jit(fn, donate_argnums=0, out_shardings=(replicated(mesh), None))

  rounds = {m: jitted_round(m) for m in methods}

  # The loop hands evaluate a state alone; a Local state holds the K models stacked (one more
  # axis), and FedRGB's and FedAvg's are evaluated alike, so the shape tells which it is.
  embedder = setup["base"]
  unstacked_ndim = jax.tree.leaves(setup["base_state"].aligner)[0].ndim

  evaluate_jit = jax.jit(
    functools.partial(
      fedrgb_eval.evaluate, embedder, gallery=gallery, batch_size=EVAL_BATCH, ks=KS
    ),
    static_argnums=0,
  )

  # After the last round: distortion (Tables 6 / 11), downstream fine-tuning, segmentation.
  dist_cfg, down_cfg, seg_cfg = config.distortion, config.downstream, config.segmentation
  down = setup["downstream"]
  fractions = [float(f) for f in down_cfg.fractions]
  final = fedrgb_eval.FinalEvaluation(
    embedder,
    mesh,
    data,
    down,
    DOWNSTREAM,
    seed=int(config.seed),
    distortion_steps=int(dist_cfg.steps),
    fractions=fractions,
    downstream={k: down_cfg[k] for k in ("steps", "batch_size", "learning_rate", "train_encoder")},
    segmentation={k: seg_cfg[k] for k in ("steps", "batch_size", "learning_rate", "width")},
    name_fraction=fraction_label,
  )
  dist_steps = int(dist_cfg.steps)

  def distortion(m, s) -> dict[str, Any]:
    return final.distortion(algorithms[m], s, dist_cfg.retrain)

  downstream, segmentation = final.downstream, final.segmentation

  def evaluate(loop_state) -> dict[str, Any]:
    s, m = loop_state["rgb"], methods[int(loop_state["row"])]
    local = jax.tree.leaves(s.aligner)[0].ndim > unstacked_ndim
    # Run on the state's mesh, read whole here (gathered, in a job of several processes).
    own, shifted = processes.gather(
      evaluate_jit(local, s.encoder, s.aligner, data["test"], data["ood"])
    )
    own = {name: np.asarray(v, np.float64) for name, v in own.items()}
    out = {
      "mean": {name: float(v.mean()) for name, v in own.items()},
      "worst": {name: float(v.min()) for name, v in own.items()},
      "own": {name: v.tolist() for name, v in own.items()},
      "ood": {name: float(v) for name, v in shifted.items()},
      "weights": np.asarray(s.weights).tolist(),
    }
    # The state's own round count says whether this is the final model, so a rerun of a
    # finished run (the loop evaluates it anew) gets these too. Local has no global model.
    if int(s.round) == int(config.rounds) and not local:
      if dist_cfg.enabled:
        out["distortion"] = distortion(m, s)
      if down_cfg.enabled:
        out["downstream"] = downstream(s.encoder, s.aligner)
      if seg_cfg.enabled:
        out["segmentation"] = segmentation(s.encoder, s.aligner)
    return out

  def scalars(r, outs, evals):
    rows = []
    for m in methods:
      out = outs[m]
      values = {"stage1_loss": float(np.mean(np.asarray(out["stage1_loss"])))}
      for name in ("stage2_loss", "dro_loss_start", "dro_loss_next", "ema_mu"):
        if name in out:
          values[name] = float(np.mean(np.asarray(out[name])))
      values["max_weight"] = float(np.max(np.asarray(out["weights"])))
      values |= loop.fault_scalars(out)
      if m in evals:
        e = evals[m]
        values |= {f"mean/{n}": v for n, v in e["mean"].items()}
        values |= {f"worst/{n}": v for n, v in e["worst"].items()}
        values |= {f"ood/{n}": v for n, v in e["ood"].items()}
      rows.append((m, values))
    return rows

  traffic_bytes = {m: alg.stage_traffic(algorithms[m], states0[m]) for m in methods}

  def traffic(m, out):
    del out
    t = traffic_bytes[m]
    if ROWS[m][0] in ("local", "centralised"):  # nothing is sent
      return None
    up = np.full(k, t["stage1"] + t["stage2"], np.int64)
    down = np.full(k, t["stage1"], np.int64)  # the new global aligners (and encoders if trained)
    return up, down

  n_test, n_ood = int(config.test_per_client), int(config.ood_test)
  chance = {
    **{f"R@{k_}": 100 * min(1.0, k_ / n_test) for k_ in KS},
    **{f"gallery_R@{k_}": 100 * min(1.0, k_ / gallery) for k_ in KS},
    **{f"ood_R@{k_}": 100 * min(1.0, k_ / n_ood) for k_ in KS},
  }

  def report(outcome: loop.Outcome) -> loop.Report:
    traffic_rows = [
      [m, f"{t['stage1'] / 1e6:.3f}", f"{t['stage2'] / 1e6:.3f}", f"{t['full_model'] / 1e6:.3f}"]
      for m, t in traffic_bytes.items()
    ]
    traffic_table = format_table(
      ["Method", "stage 1 MB/client/round", "stage 2 MB", "full model MB"], traffic_rows
    )
    majority = {t: fedrgb_eval.majority_accuracy(v) for t, v in down["test_labels"].items()}
    base = setup["base_state"]
    initial = None
    if down_cfg.enabled and any("downstream" in outcome.final[m] for m in methods):
      initial = downstream(base.encoder, base.aligner)
    seg_trivial = fedrgb_eval.all_positive_dice(np.asarray(down["seg_test_targets"])) * 100
    seg_initial = None
    if seg_cfg.enabled and any("segmentation" in outcome.final[m] for m in methods):
      seg_initial = segmentation(base.encoder, base.aligner)
    text = (
      f"FedRGB on the world: {k} clients, Dirichlet {config.dirichlet_alpha} over the 32 "
      f"categories, {config.rounds} rounds, {config.image_encoder} + {config.text_encoder}"
      f"{' (World-CLIP)' if config.pretrained else ' (from scratch)'}, seed {config.seed}\n"
      f"Sent per client and round (float32):\n{traffic_table}\n"
      f"wall time {outcome.wall_time_s:.0f} s"
      + (f" (resumed at round {outcome.resumed_at})" if outcome.resumed_at else "")
    )
    results = {
      "methods": {m: outcome.final[m] for m in methods},
      "chance": chance,
      "traffic_bytes": traffic_bytes,
      "client_categories": np.bincount(setup["categories"].ravel(), minlength=32).tolist(),
      "distortion_steps": dist_steps,
      "downstream_majority": majority,
      "downstream_initial": initial,
      "segmentation_all_positive": seg_trivial,
      "segmentation_initial": seg_initial,
    }
    return loop.Report(
      title="FedRGB",
      sections=[],
      plots={},
      results=results,
      text=text,
      final=results["methods"],
      baselines=fedrgb_report.baselines(
        chance, initial, majority, seg_initial, seg_trivial, fractions
      ),
      tail=[("Traffic", traffic_table)],
    )

  def init():
    states = {
      m: {"rgb": states0[m], "row": jnp.asarray(i, jnp.int32)} for i, m in enumerate(methods)
    }
    if devices > 1:  # the row too: the round returns every leaf replicated, so a state
      states = core.replicate(states, mesh)  # placed otherwise would compile it again
    return jax.tree.map(jnp.copy, states)

  return loop.Experiment(
    init=init,
    methods={m: (lambda s, m=m: rounds[m](s, data["train"], data["mask"])) for m in methods},
    evaluate=evaluate,
    nonfinite=lambda out: [] if bool(out["finite"]) else ["the global model"],
    scalars=scalars,
    runs=methods,
    report=report,
    traffic=traffic,
    eval_every=int(config.eval_every),
  )


#: FedRGB as the loop runs it (:class:`fedjax_mm.runner.loop.System`).
SYSTEM = loop.System(
  name="fedrgb",
  methods=tuple(ROWS),
  validate=validate,
  experiment=experiment,
  tables=fedrgb_report.tables,
  sections=fedrgb_report.sections,
)
run = SYSTEM.run

__all__ = [
  "SYSTEM",
  "build",
  "categories",
  "experiment",
  "run",
  "segmentation_target",
  "validate",
]
