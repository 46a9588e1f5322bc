"""Numbers of a config: finite and in range, checked before anything is built (runner.validation)."""

import math

import experiment_main
import pytest

from experiments import creamfl as creamfl_config
from experiments import fedmuscle as fedmuscle_config
from experiments import fedrgb as fedrgb_config
from experiments import fedscmr as fedscmr_config
from experiments import pretrain as pretrain_config
from experiments import rcsr as rcsr_config
from fedjax_mm.data import world
from fedjax_mm.runner import creamfl, fedmuscle, fedrgb, fedscmr, rcsr, validation
from fedjax_mm.runner.errors import ConfigError
from fedjax_mm.zoo import pretrain

RUNNERS = {
  "fedmuscle": (fedmuscle, fedmuscle_config, validation.FEDMUSCLE, (None, "smoke", "setup2")),
  "creamfl": (creamfl, creamfl_config, validation.CREAMFL, (None, "smoke")),
  "fedscmr": (fedscmr, fedscmr_config, validation.FEDSCMR, (None, "smoke")),
  "fedrgb": (fedrgb, fedrgb_config, validation.FEDRGB, (None, "smoke", "ablations")),
  "rcsr": (rcsr, rcsr_config, validation.RCSR, (None, "smoke", "ablations", "baselines")),
}


def _set(config, key: str, value) -> None:
  """Sets a dotted key; ``users[1].train_size`` indexes a list."""
  *parents, leaf = key.split(".")
  node = config
  for part in parents:
    name, _, index = part.partition("[")
    node = node[name]
    if index:
      node = node[int(index.rstrip("]"))]
  node[leaf] = value


@pytest.mark.parametrize("name", RUNNERS)
def test_every_number_of_the_shipped_configs_has_a_rule(name):
  """A numeric field added to a config without a range here fails this test, not a run."""
  _, module, spec, variants = RUNNERS[name]
  for variant in variants:
    config = module.get_config(variant)
    validation.check_numbers(config, spec)  # The shipped configs are valid.
    patterns = {pattern for _, pattern, _ in validation.numeric_fields(config)}
    assert patterns <= set(spec), f"{name}:{variant} has no rule for {sorted(patterns - set(spec))}"


def test_every_number_of_the_pretraining_configs_has_a_rule():
  """PRETRAIN plus one count per ``epochs.<image encoder>`` entry, as its validate adds."""
  for variant in (None, "smoke"):
    config = pretrain_config.get_config(variant)
    pretrain.validate(config)
    patterns = {pattern for _, pattern, _ in validation.numeric_fields(config)}
    epochs = {f"epochs.{name}" for name in dict(config.epochs)}
    assert patterns <= set(validation.PRETRAIN) | epochs, sorted(
      patterns - set(validation.PRETRAIN)
    )


@pytest.mark.parametrize(
  "name,key,value,message",
  [
    ("fedmuscle", "learning_rate", math.nan, "learning_rate must be finite and > 0, got nan."),
    ("fedmuscle", "learning_rate", math.inf, "learning_rate must be finite and > 0, got inf."),
    ("fedmuscle", "learning_rate", 0.0, "learning_rate must be > 0, got 0.0."),
    ("fedmuscle", "weight_decay", -1e-4, "weight_decay must be >= 0, got -0.0001."),
    ("fedmuscle", "muscle.tau_full", 0.0, "muscle.tau_full must be > 0, got 0.0."),
    ("fedmuscle", "muscle.tau_reduced", -math.inf, "muscle.tau_reduced must be finite and > 0"),
    ("fedmuscle", "public.shift", 1.5, "public.shift must be in [0, 1], got 1.5."),
    ("fedmuscle", "local_batch_size", 0, "local_batch_size must be >= 1, got 0."),
    ("fedmuscle", "users[1].train_size", 0, "users[1].train_size must be >= 1, got 0."),
    ("fedmuscle", "seed", -1, "seed must be >= 0, got -1."),
    ("fedmuscle", "baselines.sage.threshold", 1.5, "baselines.sage.threshold must be in [0, 1]"),
    ("fedmuscle", "baselines.sage.half_gap", 0.0, "baselines.sage.half_gap must be > 0"),
    ("fedmuscle", "baselines.cofed.margin", -0.1, "baselines.cofed.margin must be in [0, 1]"),
    ("creamfl", "server_learning_rate", math.nan, "server_learning_rate must be finite and > 0"),
    ("creamfl", "weight_decay", math.nan, "weight_decay must be finite and >= 0, got nan."),
    ("creamfl", "server_weight_decay", -0.1, "server_weight_decay must be >= 0, got -0.1."),
    ("creamfl", "server_optimizer", "sgd", "server_optimizer must be one of adamw, adamp"),
    ("creamfl", "server_lr_schedule", "step", "server_lr_schedule must be one of constant"),
    ("creamfl", "creamfl.lcr_weight", math.inf, "creamfl.lcr_weight must be finite and >= 0"),
    ("creamfl", "creamfl.gca_temperature", -1.0, "creamfl.gca_temperature must be > 0"),
    ("creamfl", "test.shift", -0.1, "test.shift must be in [0, 1], got -0.1."),
    ("creamfl", "alpha", math.nan, "alpha must be finite and > 0, got nan."),
    ("creamfl", "local_batch_size", 0, "local_batch_size must be >= 1"),
    ("fedscmr", "learning_rate", math.nan, "learning_rate must be finite and > 0, got nan."),
    ("fedscmr", "fedprox_mu", -0.01, "fedprox_mu must be >= 0, got -0.01."),
    ("fedscmr", "features.image_noise", math.nan, "features.image_noise must be finite and >= 0"),
    ("fedscmr", "fedscmr.gamma", math.inf, "fedscmr.gamma must be finite and >= 0, got inf."),
    ("fedscmr", "batch_size", 0, "batch_size must be >= 1, got 0."),
    ("fedrgb", "seed", -1, "seed must be >= 0, got -1."),
    ("fedrgb", "image_size", 12, "image_size must be >= 16, got 12."),
    ("fedrgb", "max_caption_len", 4, "max_caption_len must be >= 8, got 4."),
    ("fedrgb", "weight_decay", math.nan, "weight_decay must be finite and >= 0, got nan."),
    ("fedrgb", "num_clients", 1, "num_clients must be >= 2, got 1."),
    ("fedrgb", "downstream.fractions", (0.1, 1.5), "downstream.fractions[1] must be in (0, 1]"),
    ("rcsr", "seed", -1, "seed must be >= 0, got -1."),
    ("rcsr", "image_size", 12, "image_size must be >= 16, got 12."),
    ("rcsr", "max_caption_len", 4, "max_caption_len must be >= 8, got 4."),
    ("rcsr", "learning_rate", -1.0, "learning_rate must be > 0, got -1.0."),
    ("rcsr", "local_epochs", 0, "local_epochs must be >= 1, got 0."),
    ("rcsr", "dim", 0, "dim must be >= 1, got 0."),
    ("rcsr", "personal_hidden", 0, "personal_hidden must be >= 1, got 0."),
    ("rcsr", "lr_warmup", -1, "lr_warmup must be >= 0, got -1."),
    ("rcsr", "rcsr.router_heads", 0, "rcsr.router_heads must be >= 1, got 0."),
    ("rcsr", "rcsr.personal_start", -3, "rcsr.personal_start must be >= 0, got -3."),
    ("rcsr", "rcsr.lambda_p", math.inf, "rcsr.lambda_p must be finite and in [0, 1], got inf."),
    ("rcsr", "rcsr.mekt_temperature", 0.0, "rcsr.mekt_temperature must be > 0, got 0.0."),
    ("rcsr", "participation", 0.0, "participation must be in (0, 1], got 0.0."),
  ],
)
def test_validate_names_the_bad_number(name, key, value, message):
  runner, module, _, _ = RUNNERS[name]
  config = module.get_config("smoke")
  _set(config, key, value)
  with pytest.raises(ConfigError) as info:
    runner.validate(config)
  assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("name", RUNNERS)
def test_a_bad_client_map_is_refused(name):
  runner, module, _, _ = RUNNERS[name]
  config = module.get_config("smoke")
  assert validation.check_client_map(config) == "auto"
  config.client_map = "map:0"
  with pytest.raises(ConfigError, match="client_map must be 'auto', 'vmap', 'scan' or 'map:<k>'"):
    runner.validate(config)


def test_the_world_bounds_are_the_worlds_own():
  """WORLD_IMAGE_SIZE / WORLD_CAPTION_LEN admit exactly what WorldConfig builds."""
  for key, rule in (
    ("image_size", validation.WORLD_IMAGE_SIZE),
    ("max_caption_len", validation.WORLD_CAPTION_LEN),
  ):
    low = int(rule.low)
    world.WorldConfig(**{key: low})
    with pytest.raises(ValueError, match=key):
      world.WorldConfig(**{key: low - 1})
    assert rule.admits(low) and not rule.admits(low - 1)


@pytest.mark.parametrize("name", ["creamfl", "fedscmr", "fedrgb", "rcsr"])
def test_an_empty_method_list_is_named_as_empty(name):
  runner, module, _, _ = RUNNERS[name]
  config = module.get_config("smoke")
  config.methods = ()
  with pytest.raises(ConfigError, match=r"^methods is empty; name at least one of "):
    runner.validate(config)


@pytest.mark.parametrize("name", ["creamfl", "fedscmr", "fedrgb", "rcsr"])
def test_a_method_listed_twice_is_refused(name):
  runner, module, _, _ = RUNNERS[name]
  config = module.get_config("smoke")
  config.methods = (config.methods[0], config.methods[0])
  with pytest.raises(ConfigError, match=r"^methods: .*(twice|at most once)"):
    runner.validate(config)


def test_check_numbers_on_plain_nests():
  spec = {"a.b[]": validation.COUNT, "f": validation.FRACTION}
  validation.check_numbers({"a": {"b": [1, 2]}, "f": 1, "flag": True, "name": "x", "c": None}, spec)
  with pytest.raises(ConfigError, match=r"^a\.b\[1\] must be >= 1, got 0\.$"):
    validation.check_numbers({"a": {"b": [1, 0]}}, spec)
  with pytest.raises(ConfigError, match=r"^a\.b\[0\] must be an integer >= 1, got 2\.5\.$"):
    validation.check_numbers({"a": {"b": [2.5]}}, spec)
  # A number no rule names must still be finite.
  with pytest.raises(ConfigError, match=r"^extra\.x must be finite, got -inf\.$"):
    validation.check_numbers({"extra": {"x": -math.inf}}, spec)
  assert validation.POSITIVE.describe() == "> 0" and validation.FRACTION.describe() == "in [0, 1]"
  share = validation.Range(0, 1, high_open=True)
  assert share.describe() == "in [0, 1)" and share.admits(0.0) and not share.admits(1.0)
  assert validation.Range(high=1, high_open=True).describe() == "< 1"
  with pytest.raises(ConfigError, match=r"^s must be in \[0, 1\), got 1\.0\.$"):
    validation.check_numbers({"s": 1.0}, {"s": share})


@pytest.mark.parametrize(
  "config,override",
  [
    ("experiments/fedmuscle.py:smoke", "--config.learning_rate=nan"),
    ("experiments/creamfl.py:smoke", "--config.learning_rate=inf"),
    ("experiments/fedscmr.py:smoke", "--config.learning_rate=nan"),
    ("experiments/fedrgb.py:smoke", "--config.learning_rate=nan"),
    ("experiments/rcsr.py:smoke", "--config.learning_rate=inf"),
  ],
)
def test_non_finite_learning_rate_exits_2_before_any_compilation(
  tmp_path, main_cache, monkeypatch, config, override
):
  # JAX logs every compilation at WARNING when asked: there must be none.
  monkeypatch.setenv("JAX_LOG_COMPILES", "1")
  code, _, err = experiment_main.run(config, tmp_path / "run", override, cache_dir=main_cache)
  assert code == 2, err[-2000:]
  lines = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and "learning_rate must be finite and > 0" in lines[0], err[-2000:]
  assert "Compiling" not in err, err[-2000:]
  assert not (tmp_path / "run").exists()  # Nothing was written.
