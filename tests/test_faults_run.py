"""Every experiment's smoke config runs a round with every client fault switched on, and a
bad ``faults`` block is refused before anything is built."""

import experiment_main
import pytest

from experiments import creamfl as creamfl_config
from experiments import fedmuscle as fedmuscle_config
from experiments import fedrgb as fedrgb_config
from experiments import fedscmr as fedscmr_config
from experiments import rcsr as rcsr_config
from fedjax_mm.runner import creamfl, fedmuscle, fedrgb, fedscmr, rcsr
from fedjax_mm.runner.errors import ConfigError
from fedjax_mm.runner.writers import read_metrics

FAULTS = (
  "--config.faults.dropout=0.34",
  "--config.faults.stragglers=0.5",
  "--config.faults.byzantine=0.34",
)

# (config, extra overrides, metric prefix, the run that logs the counts, clients per round)
SYSTEMS = {
  # M = 1: with one of three users dropped, the other two can still find a partner.
  "fedmuscle": ("experiments/fedmuscle.py:smoke", ("--config.muscle.num_partners=1",), "", 3),
  "creamfl": (
    "experiments/creamfl.py:smoke",
    # VQA (Table 2's analogue) is tested by test_creamfl_run; here it would only add a compile.
    ("--config.methods=('reamFL+Mean','CreamFL')", "--config.vqa.enabled=False"),
    "CreamFL/",
    3,
  ),
  "fedscmr": ("experiments/fedscmr.py:smoke", ("--config.methods=('fedavg','fedscmr')",), "", 3),
  "fedrgb": (
    "experiments/fedrgb.py:smoke",
    # The studies after the last round are tested by test_fedrgb_run; here they would
    # only add compiles.
    (
      "--config.methods=('fedrgb',)",
      "--config.distortion.enabled=False",
      "--config.downstream.enabled=False",
      "--config.segmentation.enabled=False",
    ),
    "",
    3,
  ),
  # 2 of its 4 clients a round; RCSR's other methods run the same round (tests/test_rcsr_faults.py).
  "rcsr": ("experiments/rcsr.py:smoke", ("--config.methods=('rcsr_p',)",), "", 2),
}


@pytest.mark.parametrize("name", SYSTEMS)
def test_smoke_round_with_every_fault(tmp_path, main_cache, name):
  config, extra, prefix, participants = SYSTEMS[name]
  workdir = tmp_path / "run"
  code, _, err = experiment_main.run(
    config, workdir, "--config.rounds=1", *FAULTS, *extra, cache_dir=main_cache, timeout=900
  )
  assert code == 0, err[-3000:]
  records = [r for r in read_metrics(workdir) if f"{prefix}faults/dropped" in r]
  assert records, "no fault counts in metrics.jsonl"
  for r in records:
    assert r["round"] == 1
    # Of 3 participants round(0.34 * 3) = 1 drops and 1 is Byzantine; stragglers:
    # round(0.5 * 3) = 2 of the 2 survivors (of 2: 1 drops, and the survivor is both).
    dropped = round(0.34 * participants)
    assert r[f"{prefix}faults/dropped"] == dropped
    assert r[f"{prefix}faults/byzantine"] == round(0.34 * participants)
    assert r[f"{prefix}faults/stragglers"] == min(round(0.5 * participants), participants - dropped)
  assert (workdir / "results.json").exists()


@pytest.mark.parametrize(
  "runner,module",
  [
    (fedmuscle, fedmuscle_config),
    (creamfl, creamfl_config),
    (fedscmr, fedscmr_config),
    (fedrgb, fedrgb_config),
    (rcsr, rcsr_config),
  ],
)
@pytest.mark.parametrize(
  "key,value,message",
  [
    ("dropout", 1.5, "faults.dropout must be in [0, 1], got 1.5."),
    ("stragglers", -0.1, "faults.stragglers must be in [0, 1], got -0.1."),
    ("byzantine_count", -1, "faults.byzantine_count must be >= 0, got -1."),
    ("byzantine_scale", float("nan"), "faults.byzantine_scale must be finite, got nan."),
    ("byzantine_mode", "flip", "faults.byzantine_mode must be one of ('random', 'scaled')"),
  ],
)
def test_bad_faults_are_refused_before_anything_is_built(runner, module, key, value, message):
  config = module.get_config("smoke")
  config.faults[key] = value
  with pytest.raises(ConfigError) as info:
    runner.validate(config)
  assert message in str(info.value)
