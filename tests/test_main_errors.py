"""What every system's command does with a config it cannot run: one line, exit 2, nothing written.

The same end-to-end checks for each system, run through ``python -m experiments.main`` as a
user would: a bad value is refused by validation before anything is built, and a TFDS
dataset that is not prepared names its ``tfds build`` command before anything compiles.
"""

import experiment_main
import hf_toys
import pytest

#: (config, override, what the one error line must contain). FedMuscle's cover each kind of
#: check its validation makes; the others, one per system.
BAD_CONFIGS = [
  ("fedmuscle", "--config.muscle.num_partners=3", "num_partners"),
  ("fedmuscle", "--config.muscle.batch_size=1", "at least 2"),
  ("fedmuscle", "--config.muscle.tau_reduced=0.25", "gamma > 0"),
  ("fedmuscle", "--config.muscle.loss=cosine", "muscle.loss"),
  ("fedmuscle", "--config.public.modalities=('text',)", "needs image in the public set"),
  ("fedmuscle", "--config.pretrained=nope", "no pretrained checkpoint 'nope/cnn_s'"),
  ("fedmuscle", "--config.lora_rank=-1", "lora_rank"),
  ("fedmuscle", "--config.fine_tune=lora", "fine_tune must be one of adapters, full"),
  ("fedmuscle", "--config.test_sizes.ic10=0", "test_sizes.ic10 must be >= 1, got 0"),
  ("creamfl", "--config.creamfl.num_selected=0", "num_selected"),
  ("fedrgb", "--config.fedrgb.rho=-1", "fedrgb.rho"),
  ("fedscmr", "--config.fedscmr.gamma=-1", "gamma must be >= 0"),
  ("rcsr", "--config.missing_rate=1.5", "missing_rate"),
]


@pytest.mark.parametrize(
  "name,override,message",
  BAD_CONFIGS,
  ids=[f"{n}:{o.split('=')[0][9:]}" for n, o, _ in BAD_CONFIGS],
)
def test_bad_config_is_one_line_and_exit_2(tmp_path, main_cache, name, override, message):
  code, _, err = experiment_main.run(
    f"experiments/{name}.py:smoke", tmp_path / "run", override, cache_dir=main_cache, timeout=300
  )
  assert code == 2, err[-2000:]
  lines = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and message in lines[0], err[-2000:]
  assert not (tmp_path / "run").exists()  # Nothing was written.


_CREAMFL_TEXT_TOWERS = (
  "clients.text.encoder",
  "clients.multimodal.text_encoder",
  "server.text_encoder",
)

#: (config, overrides, the dataset named first). FedMuscle checks its tasks in order (IC10's
#: CIFAR-10 is the first missing); CreamFL reads its image clients' CIFAR-100 first, and its
#: :paper BERT server is a folder this machine lacks, so every text tower is on MiniLM.
MISSING_DATA = [
  (
    "fedmuscle.py:smoke",
    ("--config.data.source=tfds", "--config.data.limit=8"),
    "cifar10",
  ),
  (
    "creamfl.py:paper",
    tuple(f"--config.{k}={hf_toys.MINILM}" for k in _CREAMFL_TEXT_TOWERS),
    "cifar100",
  ),
]


@pytest.mark.parametrize(
  "config,overrides,dataset", MISSING_DATA, ids=[c.split(".")[0] for c, _, _ in MISSING_DATA]
)
def test_missing_dataset_exits_2_naming_the_build_command(
  tmp_path, main_cache, monkeypatch, config, overrides, dataset
):
  pytest.importorskip("tensorflow_datasets")
  monkeypatch.setenv("JAX_LOG_COMPILES", "1")  # JAX logs every compilation: there must be none
  data_dir = tmp_path / "tfds"
  code, _, err = experiment_main.run(
    f"experiments/{config}",
    tmp_path / "run",
    *overrides,
    f"--config.data.data_dir={data_dir}",
    cache_dir=main_cache,
  )
  assert code == 2, err[-2000:]
  lines = [line for line in err.splitlines() if line.startswith("error:")]
  command = f"tfds build {dataset} --data_dir={data_dir} --file_format=array_record"
  assert len(lines) == 1 and command in lines[0], err[-2000:]
  assert "Compiling" not in err, err[-2000:]
  assert not (tmp_path / "run").exists() and not data_dir.exists()
