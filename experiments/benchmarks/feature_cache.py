"""FedMuscle's rounds with the frozen encoders' features cached against without, same run.

  python -m experiments.benchmarks.feature_cache [--config=experiments/fedmuscle.py] \
    [--rounds=3] [--config.<key>=...]

Builds the experiment of ``--config`` twice, with ``cache_features`` True
(:mod:`fedjax_mm.core.features`: a user whose encoder trains nothing reads its
pooled features, computed once per set) and False (every encoder runs at every
step), from the same initial states. After one untimed round of each method
(the compile), the two take turns: one round of every method and its
evaluation each, ``--rounds`` times, so they share this machine's drifting
speed. It prints the build time of each (the cached one computes the features
there), the median time of a round with its evaluation, and their ratio (above
1: caching is faster), then how far apart the two runs' test metrics are after
the last round (the largest absolute difference, in metric points: float32
rounding, since the encoder sees batches of another size).
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from fedjax_mm.runner import fedmuscle

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/fedmuscle.py", "FedMuscle config.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Timed rounds of each variant, after one untimed.")


def _round(experiment, states):
  """One round of every method and its evaluation; the new states and the evaluations."""
  out, evals = {}, {}
  for name, step in experiment.methods.items():
    out[name], _ = step(states[name])
    evals[name] = experiment.evaluate(out[name])
  jax.block_until_ready(out)
  return out, evals


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _ROUNDS.value < 1:
    raise app.UsageError("--rounds must be >= 1.")
  variants, built = {}, {}
  for cache in (False, True):
    config = _CONFIG.value.copy_and_resolve_references()
    config.cache_features = cache
    start = time.perf_counter()
    experiment = fedmuscle.experiment(config)
    built[cache] = time.perf_counter() - start
    variants[cache] = experiment
  users = fedmuscle.validate(_CONFIG.value)
  states = {cache: e.init() for cache, e in variants.items()}
  evals = {}
  for cache, e in variants.items():  # the compile
    states[cache], evals[cache] = _round(e, states[cache])
  times = {False: [], True: []}
  for _ in range(_ROUNDS.value):
    for cache, e in variants.items():
      start = time.perf_counter()
      states[cache], evals[cache] = _round(e, states[cache])
      times[cache].append(time.perf_counter() - start)
  names = [f"{u.name} ({u.encoder}/{u.task})" for u in users]
  print(f"users: {', '.join(names)}; methods: {', '.join(variants[True].methods)}")
  print(f"{'variant':<28} {'build (s)':>10} {'round + eval (s)':>17}")
  for cache, label in ((False, "every encoder every step"), (True, "frozen features cached")):
    print(f"{label:<28} {built[cache]:>10.1f} {statistics.median(times[cache]):>17.2f}")
  ratio = statistics.median(times[False]) / statistics.median(times[True])
  print(f"round + eval, uncached / cached: {ratio:.2f}x (median of {_ROUNDS.value} turns)")
  diff = max(
    float(np.max(np.abs(np.subtract(evals[True][m]["users"], evals[False][m]["users"]))))
    for m in evals[True]
  )
  print(f"largest test-metric difference after {_ROUNDS.value + 1} rounds: {100 * diff:.2g} points")


if __name__ == "__main__":
  app.run(main)
