r"""Runs an experiment from a config file.

  python -m experiments.main --config=experiments/fedmuscle.py [--workdir=runs/fedmuscle] [--overwrite]

The loop lives in the library (``fedjax_mm.runner.loop``); this file only
parses flags and picks the experiment by the config file's name
(``fedjax_mm.runner.EXPERIMENTS``). A bad config or workdir is reported in one
line on stderr with exit status 2, before any compilation; so are a run that
produced NaN/Inf and a workdir whose checkpoints are all damaged.
"""

import pathlib
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from fedjax_mm.core.checkpoint import CheckpointError
from fedjax_mm.runner import EXPERIMENTS, experiment_runner
from fedjax_mm.runner.errors import ConfigError, NonFiniteError
from fedjax_mm.runner.workdir import WorkdirError

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (default: runs/<config name>).")
_OVERWRITE = flags.DEFINE_bool(
  "overwrite", False, "Move an existing workdir with another config aside."
)
_CACHE = flags.DEFINE_string(
  "compilation_cache",
  str(pathlib.Path("~/.cache/fedjax_mm/xla").expanduser()),
  "Folder of JAX's persistent compilation cache, so reruns, resumes and other seeds "
  "skip compilation; empty to disable.",
)


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  if _CACHE.value:
    jax.config.update("jax_compilation_cache_dir", _CACHE.value)
  config_path = flags.FLAGS["config"].config_filename
  name = pathlib.Path(config_path.split(":")[0]).stem
  if name not in EXPERIMENTS:
    sys.exit(f"error: no runner for config {name!r}; known: {', '.join(EXPERIMENTS)}")
  run = experiment_runner(name)
  workdir = _WORKDIR.value or str(pathlib.Path("runs") / name)
  try:
    run(_CONFIG.value, workdir, overwrite=_OVERWRITE.value)
  except (ConfigError, WorkdirError, NonFiniteError, CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
