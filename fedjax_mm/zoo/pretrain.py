"""The pretraining experiment: CLIP-style world encoders, their probes and their folders.

``run(config, workdir)`` is what ``python -m experiments.main
--config=experiments/pretrain.py`` calls. It

1. generates the **web split** of the world: ``config.web.size`` image-caption
   pairs at ``shift = config.web.shift`` (between the private distribution, 0,
   and the public one, 1), from seeds ``WEB_SEED + config.seed`` (training) and
   ``WEB_SEED + config.seed + 1`` (held-out retrieval pairs). Every federated
   split and public set is generated from seeds below ``WEB_SEED`` (seed *
   1000 + small offsets), so the web split shares no stream with them;
2. pretrains each ``(image encoder, text encoder)`` pair of ``config.pairs``
   with :mod:`fedjax_mm.algorithms.clip` (AdamW, warm-up + cosine, batches of
   ``config.batch_size``), with a progress bar per pair; with
   ``config.distill.teacher`` set, that image encoder's pair trains first and
   every other image tower (or those ``config.distill.students`` names) also
   regresses its standardised pooled features
   (:func:`teacher_features`, :func:`fedjax_mm.algorithms.clip.distill_loss`,
   weight ``config.distill.weight``), which the folder's ``config.json`` records;
3. measures each pair: linear probes on the frozen image encoder's pooled
   features (``config.probe.train`` labelled private-distribution samples,
   scored on ``config.probe.test`` others) for the primary shape (10 classes),
   the primary colour (10) and the multi-label shape set (micro-F1), beside
   the trivial baselines (majority class; "every label present"), and
   zero-shot retrieval R@1/5/10 in both directions on ``config.eval_pairs``
   held-out web pairs (5 captions each);
4. writes each encoder as a Hugging Face-style folder
   ``workdir/world-clip/<encoder>`` (:mod:`fedjax_mm.models.pretrained`):
   every image encoder from its pair, every text encoder from the first pair
   that names it; ``config.json`` records the pretraining and the quality
   figures, and ``model.safetensors`` also holds each encoder's pooled-feature
   statistics (mean, std) over the first ``config.stats_size`` web inputs
   (:func:`~fedjax_mm.models.pretrained.feature_stats`), which a user model
   may standardise with (``standardize`` in :func:`fedjax_mm.models.build`).

Nothing but the epoch in progress is lost on a stop. Each unfinished pair's
state (parameters and optimiser) is checkpointed after every epoch in
``workdir/checkpoints/<image>+<text>`` (removed once its folders are written),
and a rerun resumes it from its last epoch, bit for bit; a pair whose folders
are complete is evaluated from them instead of retrained (folders written
before the statistics existed get them added, every other tensor kept). In a
job of several processes a preemption notice (SIGTERM, Ctrl-C) stops every
process after the same epoch (:func:`fedjax_mm.core.processes.preempted`, asked
once per epoch of the run, finished pairs' included), as the federated loop
stops after a round. The workdir is held like the
federated runs' (:func:`~fedjax_mm.runner.workdir.claim_workdir`: one run per
workdir; in a multi-process job process 0 writes). The shipped weights
(``fedjax_mm/weights/world-clip``) are this run's folders at the default
config; the README says how to rebuild them.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
import shutil
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fedjax_mm import data, metrics, models
from fedjax_mm.algorithms import clip, probe
from fedjax_mm.core import processes
from fedjax_mm.core.checkpoint import Checkpointer
from fedjax_mm.models import pretrained
from fedjax_mm.runner import report as report_lib
from fedjax_mm.runner import validation
from fedjax_mm.runner.errors import ConfigError, Preempted
from fedjax_mm.runner.workdir import claim_workdir
from fedjax_mm.runner.writers import MetricWriter, read_metrics
from fedjax_mm.zoo import cca as cca_lib

#: Each unfinished pair's state after every epoch: ``workdir/checkpoints/<image>+<text>``.
CHECKPOINTS = "checkpoints"
#: Seeds of the web split start here; federated splits use ``seed * 1000 + k``.
WEB_SEED = 1 << 30
#: Probe targets: name -> (data key, outputs, multilabel).
PROBES = probe.WORLD_PROBES


#: The dtypes :func:`fedjax_mm.models.pretrained.save` stores.
DTYPES = ("float16", "float32")


def validate(config) -> list[tuple[str, str]]:
  """Checks a config; returns its pairs. Raises :class:`ConfigError`.

  Ranges of every number are :data:`fedjax_mm.runner.validation.PRETRAIN` (with
  ``epochs.<image encoder>`` counts); the checks here are names and relations.
  """
  # Entries for encoders outside this run's pairs are allowed (a run may pretrain
  # a subset of the default pairs); names that are no image encoder are typos.
  for name in dict(config.epochs):
    if models.ENCODERS.get(name, ("",))[0] != "image":
      raise ConfigError(f"epochs names {name!r}, which is no image encoder of models.ENCODERS.")
  epochs = {f"epochs.{name}": validation.COUNT for name in dict(config.epochs)}
  validation.check_numbers(config, {**validation.PRETRAIN, **epochs})
  pairs = [tuple(p) for p in config.pairs]
  if not pairs:
    raise ConfigError("pairs is empty: name at least one (image encoder, text encoder) pair.")
  seen = set()
  for image_name, text_name in pairs:
    for name, modality in ((image_name, "image"), (text_name, "text")):
      if models.ENCODERS.get(name, ("",))[0] != modality:
        known = [n for n, (m, _) in models.ENCODERS.items() if m == modality]
        raise ConfigError(
          f"pair {image_name}/{text_name}: {name!r} is not an {modality} encoder; known: {known}."
        )
    if image_name in seen:
      raise ConfigError(f"image encoder {image_name!r} appears in two pairs.")
    seen.add(image_name)
  if config.dtype not in DTYPES:
    raise ConfigError(
      f"dtype must be one of {list(DTYPES)} (the stored tensors), got {config.dtype!r}."
    )
  if config.web.size < config.batch_size:
    raise ConfigError(
      f"web.size ({config.web.size}) is smaller than one batch ({config.batch_size})."
    )
  if config.stats_size > config.web.size:
    raise ConfigError(f"stats_size must be in [2, web.size], got {config.stats_size}.")
  block = config.get("precondition") if callable(getattr(config, "get", None)) else None
  for name in () if block is None else block.encoders:
    if models.ENCODERS.get(name, ("",))[0] != "image":
      raise ConfigError(f"precondition.encoders names {name!r}, which is no image encoder.")
  teacher = distill_teacher(config)
  students = tuple(block.get("students", ())) if (block := config.get("distill")) else ()
  if students and not teacher:
    raise ConfigError("distill.students is set but distill.teacher is not: whom to distil from?")
  for name in students:
    if name == teacher or models.ENCODERS.get(name, ("",))[0] != "image":
      raise ConfigError(
        f"distill.students names {name!r}, which is no image encoder other than the "
        f"teacher {teacher!r}."
      )
  images = [image for image, _ in pairs]
  # A run of a subset of the pairs may leave the teacher out if it distils nobody.
  if teacher and teacher not in images and distill_students(config, pairs):
    raise ConfigError(
      f"distill.teacher {teacher!r} is not an image encoder of this run's pairs "
      f"({', '.join(images)}): the teacher is trained first, by CLIP alone."
    )
  return pairs


def distill_teacher(config) -> str:
  """The image encoder the others are distilled from (``config.distill.teacher``), or ``""``."""
  block = config.get("distill") if callable(getattr(config, "get", None)) else None
  return str(block.teacher) if block is not None else ""


def distill_students(config, pairs: list[tuple[str, str]]) -> tuple[str, ...]:
  """The image encoders of ``pairs`` distilled from the teacher.

  Those ``distill.students`` names (entries outside this run's pairs are allowed, as
  ``epochs`` entries are), or, when it is empty, every image encoder but the teacher.
  """
  teacher = distill_teacher(config)
  if not teacher:
    return ()
  images = [image for image, _ in pairs]
  named = tuple(config.distill.get("students", ()))
  if named:  # Those of this run's pairs.
    return tuple(name for name in named if name in images)
  return tuple(image for image in images if image != teacher)


def training_order(config, pairs: list[tuple[str, str]]) -> list[int]:
  """Indices of ``pairs`` in the order they train: the distillation teacher's first."""
  teacher = distill_teacher(config)
  return sorted(range(len(pairs)), key=lambda i: pairs[i][0] != teacher)


def teacher_features(encoder, stats, images: np.ndarray, dtype: str) -> jax.Array:
  """``[n, D]`` the teacher's pooled features of ``images``, standardised by its ``stats``.

  ``stats`` pass through the stored ``dtype`` first, so a teacher trained in this run
  and one read back from its folder (a resumed run) give the same targets.
  """
  mean, std = (jnp.asarray(np.asarray(v, dtype), jnp.float32) for v in stats)
  feats = jax.jit(lambda x: (encoder(x)[0] - mean) / std)
  return _batched(feats, jnp.asarray(images))


def epochs_for(config, image_name: str) -> int:
  return int(dict(config.epochs).get(image_name, config.default_epochs))


def _optimizer(config, total_steps: int) -> optax.GradientTransformation:
  warmup = max(1, int(config.warmup_fraction * total_steps))
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, config.learning_rate, warmup, max(total_steps, warmup + 1)
  )
  # Decay matrices only (CLIP's practice): no decay on biases, norms, the logit scale.
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.adamw(schedule, weight_decay=config.weight_decay, mask=decay_mask)


def _model(
  config, image_name: str, text_name: str, key: jax.Array, distill_dim: int = 0
) -> clip.ClipModel:
  return clip.ClipModel(
    image_name,
    text_name,
    embed_dim=config.embed_dim,
    image_size=data.WorldConfig().image_size,
    vocab_size=data.VOCAB_SIZE,
    max_len=data.WorldConfig().max_caption_len,
    rngs=nnx.Rngs(key),
    distill_dim=distill_dim,
  )


def train_pair(
  config,
  image_name,
  text_name,
  web,
  key,
  *,
  progress=True,
  workdir=None,
  evaluate_fn=None,
  checkpointer: Checkpointer | None = None,
  stop: Callable[[], bool] | None = None,
  targets: jax.Array | None = None,
):
  """Pretrains one pair; returns the trained :class:`~fedjax_mm.algorithms.clip.ClipModel`.

  Args:
    config, image_name, text_name, web, key: the run's config, the pair, the web
      split and the pair's key (its initialisation and its batches).
    progress: show a bar of the pair's steps.
    workdir: where the pair's metric lines go (the run ``<image>+<text>``: the
      loss and ``evaluate_fn``'s figures per epoch); None writes none.
    evaluate_fn: ``evaluate_fn(model) -> dict``, measured after every epoch.
    checkpointer: where the state (parameters and optimiser) is saved after every
      epoch; training resumes from its newest intact epoch, bit for bit (an
      epoch's batches depend on the key and the epoch alone), and the pair's
      metric lines past that epoch are dropped.
    stop: called once per epoch, in order (first once per epoch restored, then
      after each epoch trained and saved); True raises
      :class:`~fedjax_mm.runner.errors.Preempted` there. What
      :func:`fedjax_mm.core.processes.preempted` needs, counted over the run.
    targets: ``[n, D]`` a teacher's features of every web image
      (:func:`teacher_features`): distil them into the image tower with weight
      ``config.distill.weight`` beside the CLIP loss; None: CLIP alone.
  """
  init_key, data_key = jax.random.split(key)
  distill_dim = 0 if targets is None else int(targets.shape[1])
  model = _model(config, image_name, text_name, init_key, distill_dim)
  graphdef, params = nnx.split(model, nnx.Param)
  n, b = web["image"].shape[0], config.batch_size
  steps_per_epoch = n // b
  epochs = epochs_for(config, image_name)
  weight = float(config.distill.weight) if targets is not None else 0.0
  trainer = clip.ClipTrainer(graphdef, _optimizer(config, epochs * steps_per_epoch), weight)
  opt_state = trainer.tx.init(params)
  pair = f"{image_name}+{text_name}"
  start = 0
  if checkpointer is not None:
    restored = checkpointer.restore_latest_good({"params": params, "opt_state": opt_state})
    if restored is not None:
      start, state = restored
      params, opt_state = state["params"], state["opt_state"]
  for _ in range(start):  # Catch up: the epochs restored count as passed.
    if stop is not None and stop():
      raise Preempted(start, where=f"epoch {start} of {pair}")
  images, captions = jnp.asarray(web["image"]), jnp.asarray(web["caption"])
  num_captions = captions.shape[1]

  @jax.jit
  def step(params, opt_state, key):
    perm_key, cap_key, s = key
    idx = jax.lax.dynamic_slice_in_dim(jax.random.permutation(perm_key, n), s * b, b)
    which = jax.random.randint(jax.random.fold_in(cap_key, s), (b,), 0, num_captions)
    batch_targets = None if targets is None else targets[idx]
    return trainer.step(params, opt_state, images[idx], captions[idx, which], batch_targets)

  writer = None if workdir is None else MetricWriter(workdir, pair, resume_round=start)
  bar = None
  if progress:
    from tqdm.auto import tqdm

    bar = tqdm(
      initial=start * steps_per_epoch,
      total=epochs * steps_per_epoch,
      desc=pair,
      unit="step",
      dynamic_ncols=True,
    )
  with contextlib.ExitStack() as stack:
    for resource in (writer, bar):
      if resource is not None:
        stack.enter_context(resource)
    for e in range(start, epochs):
      perm_key, cap_key = jax.random.split(jax.random.fold_in(data_key, e))
      total = 0.0
      for s in range(steps_per_epoch):
        params, opt_state, loss = step(params, opt_state, (perm_key, cap_key, s))
        if bar is not None:
          bar.update(1)
          if s % 20 == 0:
            bar.set_postfix(epoch=e + 1, loss=f"{float(loss):.3f}")
        total += loss
      mean_loss = float(total) / steps_per_epoch
      if not math.isfinite(mean_loss):
        raise FloatingPointError(f"{pair}: the loss became {mean_loss} in epoch {e + 1}.")
      if writer is not None:
        scalars = {"loss": mean_loss, "temperature": float(jnp.exp(-params["logit_scale"][...]))}
        if evaluate_fn is not None:
          scalars |= evaluate_fn(nnx.merge(graphdef, params))
        writer.write(e + 1, scalars)
      if checkpointer is not None:
        checkpointer.save(e + 1, {"params": params, "opt_state": opt_state})
      if stop is not None and stop():  # After a pair's last epoch too: the rerun saves it.
        raise Preempted(e + 1, where=f"epoch {e + 1} of {pair}")
  return nnx.merge(graphdef, params)


def _batched(fn, x, batch=500):
  return jnp.concatenate([fn(x[i : i + batch]) for i in range(0, x.shape[0], batch)])


def evaluate(model: clip.ClipModel, probe_train, probe_test, held_out) -> dict[str, float]:
  """Linear probes on the image encoder's pooled features and zero-shot retrieval (in %)."""
  feats = lambda split: _batched(lambda x: model.image_encoder(x)[0], jnp.asarray(split["image"]))
  scores = probe.probe_scores(
    feats(probe_train), feats(probe_test), probe_train, probe_test, PROBES
  )
  out = {f"probe_{name}": v for name, v in scores.items()}
  z_image = _batched(model.embed_image, jnp.asarray(held_out["image"]))
  caps = held_out["caption"]
  n, c = caps.shape[:2]
  z_text = _batched(model.embed_text, jnp.asarray(caps.reshape(n * c, -1)))
  recall = metrics.image_text_recall(z_image, z_text, jnp.repeat(jnp.arange(n), c))
  out |= {k: float(v) for k, v in recall.items()}
  return out


def trivial_baselines(probe_train, probe_test) -> dict[str, float]:
  """What the probes score without looking at the image (in %)."""
  scores = probe.trivial_scores(probe_train, probe_test, PROBES)
  return {f"probe_{name}": v for name, v in scores.items()}


def _round_trip(model: nnx.Module, dtype: str) -> None:
  """Casts every parameter to ``dtype`` and back, in place (what a reload gives)."""
  _, params = nnx.split(model, nnx.Param)
  params = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, dtype), x.dtype), params)
  nnx.update(model, params)


#: What each epoch's line of a model card's training curve keeps.
CURVE_KEYS = ("loss", "probe_shape", "probe_multilabel", "i2t_R@10", "t2i_R@10")


def training_curve(workdir, pair: str) -> list[dict[str, float]]:
  """The pair's per-epoch loss and probes from ``metrics.jsonl``, for its model card."""
  return [
    {"epoch": int(r["round"]), **{k: round(float(r[k]), 4) for k in CURVE_KEYS if k in r}}
    for r in read_metrics(workdir, run=pair)
  ]


def _folder_config(
  config, model, name, modality, partner, quality, steps, curve=()
) -> dict[str, Any]:
  encoder = model.image_encoder if modality == "image" else model.text_encoder
  world = data.WorldConfig()
  sizes = (
    {"image_size": world.image_size, "channels": 3}
    if modality == "image"
    else {"vocab_size": data.VOCAB_SIZE, "max_len": world.max_caption_len}
  )
  return {
    "encoder": name,
    "modality": modality,
    "features": encoder.features,
    **sizes,
    "embed_dim": config.embed_dim,
    "pretraining": {
      "objective": "CLIP symmetric InfoNCE, learnt temperature",
      "partner": partner,
      "web_size": config.web.size,
      "web_shift": config.web.shift,
      "seed": config.seed,
      "epochs": epochs_for(config, name if modality == "image" else partner),
      "steps": steps,
      "batch_size": config.batch_size,
      "learning_rate": config.learning_rate,
      "final_temperature": float(jnp.exp(-model.logit_scale[...])),
      **(
        {"distilled_from": distill_teacher(config), "distill_weight": float(config.distill.weight)}
        if modality == "image" and model.distill_head is not None
        else {}
      ),
      # Per epoch: the CLIP loss and the probes (their protocol: experiments/pretrain.py).
      **({"curve": list(curve)} if curve else {}),
    },
    "quality": quality,
  }


def stats_inputs(config, web: dict[str, np.ndarray], modality: str) -> np.ndarray:
  """The web inputs an encoder's feature statistics are taken over: the first ``stats_size``.

  Images, or captions in the order the pairs hold them (5 a pair).
  """
  if modality == "image":
    return web["image"][: config.stats_size]
  caps = web["caption"]
  return caps.reshape(-1, caps.shape[-1])[: config.stats_size]


def _save_pair(
  config, out_dir, model, image_name, text_name, text_owner, quality, steps, web, curve=()
):
  towers = [("image", image_name, text_name, model.image_encoder, model.image_projection)]
  if text_owner:
    towers.insert(0, ("text", text_name, image_name, model.text_encoder, model.text_projection))
  # The image folder is written last: its presence marks the pair complete.
  for modality, name, partner, encoder, projection in towers:
    pretrained.save(
      out_dir / name,
      encoder,
      _folder_config(config, model, name, modality, partner, quality, steps, curve),
      projection=np.asarray(projection.kernel[...]),
      feature_stats=pretrained.feature_stats(encoder, stats_inputs(config, web, modality)),
      dtype=config.dtype,
    )


def _add_missing_stats(config, out_dir, image_name, text_name, text_owner, web) -> None:
  """Adds the feature statistics to a finished pair's folders that predate them."""
  names = [(image_name, "image")] + ([(text_name, "text")] if text_owner else [])
  lacking = [
    (n, m)
    for n, m in names
    if not set(pretrained.STATS_KEYS) <= set(pretrained.read_tensors(out_dir / n))
  ]
  if not lacking:
    return
  model = load_pair(config, out_dir, image_name, text_name)
  for name, modality in lacking:
    encoder = model.image_encoder if modality == "image" else model.text_encoder
    stats = pretrained.feature_stats(encoder, stats_inputs(config, web, modality))
    pretrained.add_feature_stats(out_dir / name, encoder, stats)


def load_pair(config, folder: pathlib.Path, image_name: str, text_name: str) -> clip.ClipModel:
  """A :class:`ClipModel` filled from a pair's folders (the text tower from ``folder``)."""
  model = _model(config, image_name, text_name, jax.random.key(0))
  for name, encoder, projection in (
    (image_name, model.image_encoder, model.image_projection),
    (text_name, model.text_encoder, model.text_projection),
  ):
    cfg = pretrained.load_into(encoder, folder / name, expect={"encoder": name})
    projection.kernel[...] = jnp.asarray(
      pretrained.read_tensors(folder / name)["projection.kernel"]
    )
    if name == image_name:
      model.logit_scale[...] = jnp.asarray(-math.log(cfg["pretraining"]["final_temperature"]))
  return model


def run(config, workdir, *, overwrite: bool = False, progress: bool = True) -> dict[str, Any]:
  """Pretrains every pair, writes the folders, the report and ``results.json``.

  In a job of several processes every process trains every pair alike and
  process 0 alone writes (and shows progress); the others return ``{}``.
  """
  pairs = validate(config)
  workdir = pathlib.Path(workdir)
  writes = processes.is_primary()
  with claim_workdir(workdir, config.to_dict(), overwrite=overwrite):
    results = _pretrain(config, workdir, pairs, progress=progress and writes, writes=writes)
    return _report(workdir, config, pairs, results) if writes else {}


def _pretrain(config, workdir, pairs, *, progress, writes) -> dict[str, Any]:
  """Every pair of ``pairs`` trained (or read back, when an earlier run finished it)."""
  started = time.time()
  out_dir = workdir / "world-clip"
  web = data.generate(WEB_SEED + config.seed, config.web.size, shift=config.web.shift)
  held_out = data.generate(WEB_SEED + config.seed + 1, config.eval_pairs, shift=config.web.shift)
  probe_pool = data.generate(WEB_SEED + config.seed + 2, config.probe.train + config.probe.test)
  probe_train = data.take(probe_pool, np.arange(config.probe.train))
  probe_test = data.take(
    probe_pool, np.arange(config.probe.train, config.probe.train + config.probe.test)
  )

  text_owner = {}
  for image_name, text_name in pairs:
    text_owner.setdefault(text_name, image_name)
  steps_per_epoch = config.web.size // config.batch_size
  root = jax.random.key(config.seed)
  results = {"trivial": trivial_baselines(probe_train, probe_test), "pairs": {}}
  # Every epoch of the run, finished pairs' included, is one step of the job's
  # agreement on a preemption notice (processes.preempted: consecutive steps from 1);
  # a notice after the run's last epoch is no stop.
  epochs_in_all = sum(epochs_for(config, image_name) for image_name, _ in pairs)
  passed = 0

  def stop() -> bool:
    nonlocal passed
    passed += 1
    return processes.preempted(passed) and passed < epochs_in_all

  teacher = distill_teacher(config)
  students = distill_students(config, pairs)
  targets = None  # The teacher's features of the web images, once its folder exists.
  for i in training_order(config, pairs):
    image_name, text_name = pairs[i]
    pair = f"{image_name}+{text_name}"
    checkpoints = workdir / CHECKPOINTS / pair
    done = (out_dir / image_name / pretrained.CONFIG_FILE).is_file()
    if done:  # Resume: this pair was finished by an earlier run.
      quality = pretrained.read_config(out_dir / image_name)["quality"]
      for epoch in range(1, epochs_for(config, image_name) + 1):
        if stop():
          raise Preempted(passed, where=f"epoch {epoch} of {pair}")
      if writes:
        owner = text_owner[text_name] == image_name
        _add_missing_stats(config, out_dir, image_name, text_name, owner, web)
        shutil.rmtree(checkpoints, ignore_errors=True)  # Left by a stop after its folders.
    else:
      with Checkpointer(checkpoints, max_to_keep=1) as checkpointer:
        model = train_pair(
          config,
          image_name,
          text_name,
          web,
          jax.random.fold_in(root, i),
          progress=progress,
          workdir=workdir if writes else None,
          evaluate_fn=lambda m: evaluate(m, probe_train, probe_test, held_out),
          checkpointer=checkpointer,
          stop=stop,
          targets=targets if image_name in students else None,
        )
      # Measure what is shipped: the parameters after the round trip through the stored dtype.
      _round_trip(model, config.dtype)
      quality = evaluate(model, probe_train, probe_test, held_out)
      steps = epochs_for(config, image_name) * steps_per_epoch
      if writes:
        _save_pair(
          config,
          out_dir,
          model,
          image_name,
          text_name,
          text_owner[text_name] == image_name,
          quality,
          steps,
          web,
          training_curve(workdir, pair),
        )
        shutil.rmtree(checkpoints)  # The folders hold the pair now.
    if image_name == teacher:  # It trains first; every other pair is distilled from it.
      if done:  # Its image folder alone (its text tower's may be another pair's).
        encoder = _model(config, image_name, text_name, jax.random.key(0)).image_encoder
        pretrained.load_into(encoder, out_dir / image_name, expect={"encoder": image_name})
        stats = pretrained.read_feature_stats(out_dir / image_name)
      else:
        encoder = model.image_encoder
        stats = pretrained.feature_stats(encoder, stats_inputs(config, web, "image"))
      targets = teacher_features(encoder, stats, web["image"], config.dtype)
    results["pairs"][pair] = quality
  if writes:
    results["precondition"] = precondition(config, out_dir, probe_train, probe_test)
  results["wall_time_s"] = time.time() - started
  return results


def precondition(config, out_dir: pathlib.Path, probe_train, probe_test) -> dict[str, Any]:
  """FedMuscle's precondition for every two distinct encoders of ``config.precondition``.

  The top ``precondition.k`` CCA directions of the two encoders' pooled features, fitted
  on ``precondition.public_size`` public images (shift ``precondition.public_shift``),
  and a linear probe of the primary shape on each encoder's projection, fitted on the
  probe's labelled private samples (:func:`fedjax_mm.zoo.cca.shared_probe`). Encoders
  without a folder in ``out_dir`` are left out. ``{"a/b": {"x", "y", "min", ...}}``.
  """
  block = config.get("precondition") if callable(getattr(config, "get", None)) else None
  if block is None:
    return {}
  names = [n for n in dict.fromkeys(block.encoders) if (out_dir / n).is_dir()]
  public = data.generate(WEB_SEED + config.seed + 3, block.public_size, shift=block.public_shift)
  feats = {}
  for name in names:
    cfg = pretrained.read_config(out_dir / name)
    encoder = models.build_encoder(name, rngs=nnx.Rngs(0), image_size=cfg["image_size"])
    pretrained.load_into(encoder, out_dir / name, expect={"encoder": name})
    pooled = jax.jit(lambda x, e=encoder: e(x)[0])
    feats[name] = {
      k: np.asarray(_batched(pooled, jnp.asarray(split["image"])), np.float64)
      for k, split in (("public", public), ("train", probe_train), ("test", probe_test))
    }
  out = {}
  for i, a in enumerate(names):
    for b in names[i + 1 :]:
      fa, fb = feats[a], feats[b]
      out[f"{a}/{b}"] = cca_lib.shared_probe(
        fa["public"],
        fb["public"],
        (fa["train"], fb["train"], probe_train["label10"]),
        (fa["test"], fb["test"], probe_test["label10"]),
        num_classes=data.NUM_SHAPES,
        k=int(block.k),
      )
  return out


def _report(workdir, config, pairs, results) -> dict[str, Any]:
  cols = [
    "probe_shape",
    "probe_colour",
    "probe_multilabel",
    "i2t_R@1",
    "i2t_R@5",
    "i2t_R@10",
    "t2i_R@1",
    "t2i_R@5",
    "t2i_R@10",
  ]
  rows = [
    [pair, epochs_for(config, pair.split("+")[0]), *(q[c] for c in cols)]
    for pair, q in results["pairs"].items()
  ]
  trivial = results["trivial"]
  chance_r = {k: 100 * min(1.0, int(k.split("@")[1]) / config.eval_pairs) for k in cols[3:]}
  rows.append(["trivial baseline / chance", "-", *(trivial.get(c, chance_r.get(c)) for c in cols)])
  table = report_lib.format_table(
    ["pair", "epochs", "shape probe", "colour probe", "ML probe (F1)", *cols[3:]],
    rows,
    floatfmt=".1f",
  )
  summary = (
    f"{len(pairs)} pairs pretrained CLIP-style on {config.web.size:,} web pairs (shift {config.web.shift}); "
    f"linear probes fitted on {config.probe.train} private-distribution samples, scored on "
    f"{config.probe.test}; zero-shot retrieval on {config.eval_pairs} held-out web pairs x 5 captions "
    f"(i2t: any of the 5 captions; t2i chance R@K = K/{config.eval_pairs}). Trivial baselines: majority "
    f"class for shape and colour, every label present for multi-label. Wall time {results['wall_time_s']:.0f} s."
  )
  report_lib.write_report(
    workdir / "report.md",
    title="World-CLIP pretraining",
    sections=[("Result", summary), ("Quality (%)", table), *_precondition_section(config, results)],
  )
  (workdir / "results.json").write_text(json.dumps(results, indent=2))
  print("\n" + table + "\n\n" + summary)
  return results


def _precondition_section(config, results) -> list[tuple[str, str]]:
  found = results.get("precondition") or {}
  if not found:
    return []
  block = config.precondition
  rows = [
    [pair, r["x"], r["y"], r["min"], ", ".join(f"{c:.2f}" for c in r["correlations"])]
    for pair, r in found.items()
  ]
  table = report_lib.format_table(
    ["encoders a/b", "shape from a's", "shape from b's", "min", "canonical correlations"],
    rows,
    floatfmt=".1f",
  )
  text = (
    f"The top {block.k} CCA directions of each two encoders' pooled features, fitted on "
    f"{block.public_size} public images (shift {block.public_shift}); a linear probe of the "
    f"primary shape on each side's projection ({config.probe.train} labelled private samples, "
    f"scored on {config.probe.test}; chance 10%). FedMuscle can pass on only what these "
    "directions hold; issue 65 asks for >= 40% on every pair of its default lineup.\n\n" + table
  )
  return [("FedMuscle's precondition: shape in the shared directions (%)", text)]
