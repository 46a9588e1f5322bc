"""Six users of the FedMuscle experiment, shared by the tests of Table 1's baselines.

The ``:smoke`` users (MLC cnn_s, IC10 vit_t, IC100 cnn_s) and two more IC10 cnn_s
users, so that the federated baselines have partners: users 4 and 5 share a task and
an architecture, user 2 shares only their task (and so its head's shape); users 1
(MLC, 10 outputs like IC10) and 3 are alone in theirs. Built and compiled once per
session.
"""

import functools

import jax
import numpy as np
import rounding

from experiments import fedmuscle as fedmuscle_config
from fedjax_mm.runner import fedmuscle as runner

ALL = ",".join(runner.METHODS)


@functools.cache
def build():
  """``(config, users, groups, states, train, test, public, trivial)`` of the six users."""
  config = fedmuscle_config.get_config("smoke")
  config.users = list(config.users) + [fedmuscle_config._user("cnn_s", "ic10", 16)] * 2
  config.methods = ALL
  # Raw features: the toys' expected votes and pseudo-labels (e.g. which CoFED users'
  # votes all conflict) were worked out on them. Standardisation has its own tests
  # (test_pretrained.py, test_fedmuscle_run.py); the baselines see it in the smoke runs.
  config.standardize = False
  users, groups, states, train, test, public, trivial = runner.build(config)
  return config, users, groups, states, train, test, public, trivial


@functools.cache
def algorithm(name, **overrides):
  """A method on these users (``overrides``: its ``baselines.<name>`` keys) and its jitted round."""
  config, users, groups, *_ = build()
  if overrides:
    config = config.copy_and_resolve_references()
    for key, value in overrides.items():
      config.baselines[name][key] = value
  alg = runner.algorithms(config, users, groups)[name]
  return alg, jax.jit(alg.round)


def one_round(name, public=None, *, states=None, **overrides):
  """``(state, stats)`` after one round of a method from ``states`` (default: the initial ones)."""
  _, _, _, base, train, _, default_public, _ = build()
  alg, round_fn = algorithm(name, **overrides)
  state = alg.init(states or base, jax.random.key(7))
  args = (train,) if name == "local" else (train, default_public if public is None else public)
  return round_fn(state, *args)


def leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_same(a, b):
  """Equal up to float32 rounding (two programs: see ``rounding.py``)."""
  rounding.assert_close(leaves(a), leaves(b))


def changed(a, b):
  """Different by more than float32 rounding."""
  return not rounding.close(leaves(a), leaves(b))


def shifted(states, g):
  """The states with user ``g + 1``'s parameters moved by 0.5."""
  states = list(states)
  states[g] = states[g].replace(params=jax.tree.map(lambda x: x + 0.5, states[g].params))
  return tuple(states)
