"""Runs ``python -m experiments.main`` in a subprocess, as a user would, for the end-to-end tests.

The child gets the repository on its path, no fake-device XLA flags (the
experiments run on the real CPU device) but the tests' fast-compile flag (see
``conftest.py``), and a compilation cache shared by the test session, so runs of
the same config in one session compile once.

The cache keeps every program, however fast its compile, so that a test can list what a
run compiled (:func:`cached_programs`) and check that a resumed run compiled no program
the first run had not (:func:`assert_resume_compiled_nothing_new`).

Every run is also a check that no compiled program of the experiment holds its data or
weights as constants: JAX warns when a lowering captures more than
``JAX_CAPTURED_CONSTANTS_WARN_BYTES`` of closed-over arrays, and :func:`run` fails on
that warning. The smoke models are tiny, so the threshold is low (a few KB).
"""

import os
import pathlib
import subprocess
import sys

import conftest

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: Closed-over arrays one lowering may capture (bytes) before JAX warns, and its warning.
CAPTURED_BYTES = 2048
CAPTURED = "constants were captured during lowering"


def start(
  config: str, workdir, *overrides: str, cache_dir, env=None, module: str = "experiments.main"
) -> subprocess.Popen:
  """Starts the command; the caller waits on (or kills) the process.

  ``env`` adds environment variables to the child's (after the ones set here);
  ``module`` is what ``python -m`` runs (a test's wrapper around experiments.main).
  """
  env, extra = dict(os.environ), env
  env["XLA_FLAGS"] = conftest.FAST_COMPILE
  env["PYTHONPATH"] = str(ROOT)
  env["JAX_CAPTURED_CONSTANTS_WARN_BYTES"] = str(CAPTURED_BYTES)
  env["JAX_CAPTURED_CONSTANTS_REPORT_FRAMES"] = "6"  # Where each one was captured.
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # Cache every program.
  env.update(extra or {})
  cmd = [
    sys.executable,
    "-m",
    module,
    f"--config={config}",
    f"--workdir={workdir}",
    f"--compilation_cache={cache_dir}",
    *overrides,
  ]
  return subprocess.Popen(
    cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )


def run(
  config: str,
  workdir,
  *overrides: str,
  cache_dir,
  timeout: int = 600,
  env=None,
  module: str = "experiments.main",
):
  """Runs the command to completion: ``(exit code, stdout, stderr)``.

  Raises AssertionError if a lowering captured more than ``CAPTURED_BYTES`` of constants.
  """
  proc = start(config, workdir, *overrides, cache_dir=cache_dir, env=env, module=module)
  out, err = proc.communicate(timeout=timeout)
  assert CAPTURED not in err, "a compiled program closes over arrays:\n" + err[-6000:]
  return proc.returncode, out, err


#: Programs a resumed run compiles that a fresh one does not: the eager slices, reshapes
#: and array lifts (``jnp.asarray``, JAX's ``stage``) that unpack its checkpoint
#: (``fedjax_mm.runner.loop._unpack``).
UNPACKING = frozenset({"jit_dynamic_slice", "jit_reshape", "jit_stage"})


def cached_programs(cache_dir) -> set[str]:
  """The entries of a JAX compilation cache: ``<program name>-<key>-cache``, one per program."""
  return {p.name for p in pathlib.Path(cache_dir).glob("*-cache")}


def assert_resume_compiled_nothing_new(cache_dir, before: set[str]) -> None:
  """Fails if the run since ``before`` (:func:`cached_programs`) compiled a program that is
  not in the cache, other than :data:`UNPACKING`'s: its rounds and evaluations must be
  the first run's programs (its state typed and placed as the fresh one).
  """
  new = sorted(cached_programs(cache_dir) - before)
  compiled = [entry for entry in new if entry.rsplit("-", 2)[0] not in UNPACKING]
  assert not compiled, f"the resumed run compiled {len(compiled)} new programs: {compiled}"
