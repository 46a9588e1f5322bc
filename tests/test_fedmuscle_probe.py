"""FedMuscle's linear probes of users' representations (config.probe, the positive control)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import fedmuscle as fedmuscle_config
from fedjax_mm import data
from fedjax_mm.algorithms import probe
from fedjax_mm.runner import fedmuscle as runner
from fedjax_mm.runner.errors import ConfigError


def _config(**probe_block):
  config = fedmuscle_config.get_config("smoke")
  config.rounds = 2
  config.probe.train, config.probe.test = 64, 64
  for k, v in probe_block.items():
    config.probe[k] = v
  return config


@pytest.fixture(scope="module")
def probed_run(tmp_path_factory):
  config = _config(users=(1, 2))
  workdir = tmp_path_factory.mktemp("probed")
  results = runner.run(config, workdir, progress=False)
  return config, workdir, results


def test_probes_are_reported_for_the_initial_models_and_every_method(probed_run):
  config, workdir, results = probed_run
  probes = results["probes"]
  assert set(probes) == {"initial", "trivial", "fedmuscle", "local"}
  for row in probes.values():
    assert set(row) == {"user 1", "user 2"}
    for scores in row.values():
      assert set(scores) == {"shape", "colour"}
      assert all(0 <= v <= 100 for v in scores.values())
  # The users train: after two rounds their representations probe differently.
  assert probes["fedmuscle"] != probes["initial"] and probes["local"] != probes["initial"]
  report = (workdir / "report.md").read_text()
  assert "## Linear probes of the users' representations (64 labelled" in report
  assert json.loads((workdir / "results.json").read_text())["probes"] == probes
  # The per-user metrics keep their place in results.json.
  assert len(results["fedmuscle"]) == len(config.users)


def test_probes_equal_a_direct_fit_on_the_initial_models(probed_run):
  # user 1 (cnn_s, pretrained, frozen) reads cached features in the run; its probe goes
  # through the raw model on the images, as this direct computation does.
  config, _, results = probed_run
  users, groups, states, *_ = runner.build(config)
  pool = data.generate(config.seed * 1000 + 20, 128)
  train, test = (data.take(pool, np.arange(a, a + 64)) for a in (0, 64))
  for n in (1, 2):
    g, s = groups[n - 1], states[n - 1]
    model = g.merge(jax.tree.map(lambda x: x[0], s.params), s.shared)
    z = jax.jit(model.represent)(jnp.asarray(pool["image"]))
    direct = probe.probe_scores(z[:64], z[64:], train, test, ("shape", "colour"))
    for target, value in direct.items():
      # The run batches the images (256 a call): one test scene may flip with rounding.
      assert results["probes"]["initial"][f"user {n}"][target] == pytest.approx(value, abs=1.6)
  trivial = probe.trivial_scores(train, test, ("shape", "colour"))
  assert results["probes"]["trivial"]["user 1"] == trivial


def test_no_probe_no_probes_key():
  config = _config()
  assert runner._probed(config) == ()
  tables = runner.fedmuscle_report.tables(config)
  assert [t.title for t in tables] == ["Per user (metric in %) and Delta against local training"]
  assert len(runner.fedmuscle_report.tables(_config(users=(3,)))) == 2


@pytest.mark.parametrize(
  "block,message",
  [
    ({"users": (4,)}, "probe.users must name distinct users by number, 1 to 3; got (4,)."),
    ({"users": (1, 1)}, "probe.users must name distinct users by number, 1 to 3; got (1, 1)."),
    ({"users": (0,)}, "probe.users[0] must be >= 1, got 0."),
    ({"users": (1,), "targets": ("size",)}, "probe.targets must name some of shape, colour, "),
    ({"users": (1,), "train": 1}, "probe.train must be >= 2, got 1."),
  ],
)
def test_bad_probe_blocks_are_refused_in_one_line(block, message):
  with pytest.raises(ConfigError) as e:
    runner.validate(_config(**block))
  assert str(e.value).startswith(message)
