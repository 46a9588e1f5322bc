"""The ``faults`` block every federated config shares (not a config file of its own).

Simulated client faults (:mod:`fedjax_mm.core.faults`), off by default: per round a
fraction of the participants drops out, straggles or is Byzantine (random | scaled).
Switch them on from the command line, e.g. ``--config.faults.dropout=0.3``.
"""

import ml_collections


def faults_config() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
    {
      "dropout": 0.0,
      "stragglers": 0.0,
      "byzantine": 0.0,
      "byzantine_count": 0,  # a fixed number instead of the fraction (0: the fraction)
      "byzantine_mode": "random",
      "byzantine_scale": -10.0,  # the factor of "scaled"
    }
  )
