r"""GCA (CreamFL eqs. (4)-(6)) in chunks vs all at once: memory and time.

  python -m experiments.benchmarks.gca [--num_public=50000 --dim=256 --clients=10] [--full]

Eq. (4) compares every local representation with every global one of the other
modality: ``C x P x P`` similarities, 100 GB at the paper's ``P = 50,000`` and
``C = 10``. :func:`fedjax_mm.server.gca.gca` streams the anchors in chunks.

1. **Memory at P = 50,000** (nothing is run): XLA's own accounting of the
   compiled program (``compile().memory_analysis()``: arguments, outputs and
   temporaries), chunked vs unchunked, and the ratio.
2. **Time** at sizes that fit the unchunked program too (``--timing_public``):
   chunked vs unchunked in the same process (ratio), each the best of
   ``--repeats`` after a warm-up, checked equal.
3. **Time at P = 50,000**, chunked: run in full with ``--full`` (``C P^2 d =
   6.4e12`` multiply-adds: minutes on a laptop CPU, a second or so on a GPU);
   otherwise extrapolated from the largest timing size by ``P^2`` (printed as
   such).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import benchmarks
from fedjax_mm.server import gca

_PUBLIC = flags.DEFINE_integer("num_public", 50_000, "P, public samples.", lower_bound=1)
_DIM = flags.DEFINE_integer("dim", 256, "d, representation dimension.", lower_bound=1)
_CLIENTS = flags.DEFINE_integer("clients", 10, "C, clients that sent this modality.", lower_bound=1)
_CHUNK = flags.DEFINE_integer(
  "chunk_size", None, "Anchors per chunk (default: automatic).", lower_bound=1
)
_TIMING = benchmarks.define_counts(
  "timing_public", ["2000", "4000"], "P values for the timed comparison."
)
_REPEATS = flags.DEFINE_integer(
  "repeats", 3, "Timed repetitions (best is reported).", lower_bound=1
)
_FULL = flags.DEFINE_bool("full", False, "Also run the chunked GCA at --num_public.")


def _program(chunk_size):
  return jax.jit(lambda local, g, present: gca.gca(local, g, present, chunk_size=chunk_size))


def _memory(num_public, chunk_size):
  """Bytes of (arguments, outputs, temporaries) XLA reserves for one GCA call."""
  c, d = _CLIENTS.value, _DIM.value
  args = (
    jax.ShapeDtypeStruct((c, num_public, d), jnp.float32),
    jax.ShapeDtypeStruct((num_public, d), jnp.float32),
    jax.ShapeDtypeStruct((c,), jnp.bool_),
  )
  stats = _program(chunk_size).lower(*args).compile().memory_analysis()
  return stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.temp_size_in_bytes


def _inputs(num_public, seed=0):
  keys = jax.random.split(jax.random.key(seed), 2)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  local = unit(jax.random.normal(keys[0], (_CLIENTS.value, num_public, _DIM.value)))
  global_other = unit(jax.random.normal(keys[1], (num_public, _DIM.value)))
  present = jnp.arange(_CLIENTS.value) % 3 != 2  # some clients absent
  return local, global_other, present


def _time(fn, args):
  jax.block_until_ready(fn(*args))  # compile + warm up
  best = float("inf")
  for _ in range(_REPEATS.value):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def _gib(n):
  return f"{n / 2**30:8.3f} GiB"


def main(argv):
  del argv
  p, c, d = _PUBLIC.value, _CLIENTS.value, _DIM.value
  chunk = _CHUNK.value or gca.default_chunk_size(c, p)
  print(f"GCA, C={c} clients, d={d}, chunk={chunk} anchors ({jax.devices()[0].platform})\n")

  # --- 1. Memory at the paper's size (compiled, not run) -------------------
  chunked = _memory(p, chunk)
  whole = _memory(p, p)
  print(f"memory at P={p:,} (XLA memory_analysis: arguments / outputs / temporaries)")
  print(f"  chunked   : {_gib(chunked[0])} / {_gib(chunked[1])} / {_gib(chunked[2])}")
  print(f"  unchunked : {_gib(whole[0])} / {_gib(whole[1])} / {_gib(whole[2])}")
  print(f"  temporaries, unchunked / chunked: {whole[2] / max(chunked[2], 1):,.0f}x\n")

  # --- 2. Time, chunked vs unchunked, where both fit ------------------------
  print("time (best of repeats), chunked vs unchunked in this process")
  last = None
  for size in (int(s) for s in _TIMING.value):
    args = _inputs(size)
    size_chunk = _CHUNK.value or gca.default_chunk_size(c, size)
    t_chunked = _time(_program(size_chunk), args)
    t_whole = _time(_program(size), args)
    a, b = _program(size_chunk)(*args), _program(size)(*args)
    same = all(np.allclose(x, y, rtol=1e-4, atol=1e-6) for x, y in zip(a, b, strict=True))
    print(
      f"  P={size:>6,}: chunked {t_chunked * 1e3:9.1f} ms (chunk {size_chunk}), "
      f"unchunked {t_whole * 1e3:9.1f} ms, ratio {t_chunked / t_whole:5.2f}x, equal={same}"
    )
    last = (size, t_chunked)

  # --- 3. Time at the paper's size -----------------------------------------
  if _FULL.value:
    t_full = _time(_program(chunk), _inputs(p))
    print(f"\nchunked at P={p:,}: {t_full:.1f} s (measured)")
  elif last is not None:
    size, t = last
    print(
      f"\nchunked at P={p:,}: ~{t * (p / size) ** 2:.0f} s (extrapolated by P^2 from P={size:,}; "
      "run with --full to measure)"
    )


if __name__ == "__main__":
  app.run(main)
