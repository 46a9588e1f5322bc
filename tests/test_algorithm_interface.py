"""Every system is an ``Algorithm(init, round)`` (fedjax_mm/algorithms/base.py): the
builders return one, and RCSR's and FedRGB's rounds through ``alg.round`` are the direct
calls' (``round_step``, ``FedRGB.round``) bit for bit.

Four compiles of RCSR's round (RCSR and CreamFL, each through the interface and directly)
on tests/rcsr_toys.py's encoders of one block each, and two of FedRGB's on
tests/fedrgb_toys.py's.
"""

import functools
import typing

import fedrgb_toys
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rcsr_toys

from fedjax_mm.algorithms import base, creamfl, creamfl_fedavg, fedmuscle, fedrgb, fedscmr
from fedjax_mm.algorithms import rcsr as alg
from fedjax_mm.algorithms.fedavg import fedavg
from fedjax_mm.data import world
from fedjax_mm.models import image, text

#: Each system's builder (and the FedAvg baselines of its own module).
BUILDERS = [
  fedavg,
  fedmuscle.fedmuscle,
  creamfl.creamfl,
  creamfl_fedavg.fedavg_towers,
  fedscmr.fedscmr,
  fedrgb.algorithm,
  alg.algorithm,
]


def assert_same(a, b):
  """Equal trees of equal arrays (typed PRNG keys by their data)."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("builder", BUILDERS, ids=lambda f: f"{f.__module__}.{f.__name__}")
def test_every_builder_returns_an_algorithm(builder):
  assert typing.get_type_hints(builder)["return"] is base.Algorithm


# -- RCSR ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rcsr_setup():
  """tests/rcsr_toys.py's clients on encoders of one block each, and a public set."""
  setup = rcsr_toys.tiny(
    lambda rngs: image.Vit(width=16, depth=1, num_heads=1, image_size=16, rngs=rngs),
    lambda rngs: text.TextTransformer(
      vocab_size=len(world.VOCAB), max_len=12, width=16, depth=1, num_heads=1, rngs=rngs
    ),
  )
  cfg = world.WorldConfig(image_size=16, captions_per_image=2, max_caption_len=12)
  d = world.generate(1, 5, config=cfg)
  public = {"image": jnp.asarray(d["image"]), "caption": jnp.asarray(d["caption"][:, 0])}
  return setup, public


def test_rcsr_builds_an_algorithm_for_every_method(rcsr_setup):
  spec = rcsr_setup[0][0]
  algs = {name: alg.algorithm(spec, name) for name in alg.METHODS}
  assert all(isinstance(a, base.Algorithm) for a in algs.values())
  # Rounds compare by their static switches: the methods sharing a program are equal.
  assert algs["rcsr"].round == algs["fedavg"].round == algs["pfedmma"].round
  assert hash(algs["rcsr"].round) == hash(algs["fedavg"].round)
  assert algs["moon"].round != algs["fedavg"].round != algs["creamfl"].round


@pytest.mark.parametrize("name", ["rcsr", "creamfl"])
def test_rcsr_round_through_the_interface_is_round_step(rcsr_setup, name):
  (spec, glob, personal, frozen, arrays, mask, mod), public = rcsr_setup
  meth = alg.method(name)
  a = alg.algorithm(spec, name, meth)
  key = jax.random.key(2)
  state = jax.jit(a.init)(glob, personal, frozen, arrays, mask, mod, key, public=public)
  direct = jax.jit(functools.partial(alg.init, spec))(
    glob, personal, frozen, arrays, mask, mod, key, meth, public=public
  )
  assert_same(state, direct)
  state = state.replace(round=jnp.asarray(1, jnp.int32))  # past the router's warm-up
  data = {"frozen": frozen, "train": arrays, "mask": mask, "modality": mod, "public": public}
  got = jax.jit(a.round)(state, data)
  flags = alg.round_flags(name)
  # The old direct call, the runner's before the interface (the data arguments of the
  # program: closed over, XLA would fold them as constants into another program).
  direct = lambda meth, s, d: alg.round_step(
    spec, d["frozen"], meth, s, d["train"], d["mask"], d["modality"], public=d["public"], **flags
  )
  want = jax.jit(direct)(meth, state, data)
  assert_same(got, want)


# -- FedRGB --------------------------------------------------------------------------------


def test_fedrgb_round_through_the_interface_is_the_direct_call():
  rgb, state, arrays, mask, _ = fedrgb_toys.tiny("fedrgb")
  a = fedrgb.algorithm(rgb.config, rgb.encoder_def, rgb.aligner_def)
  assert isinstance(a, base.Algorithm) and isinstance(rgb.algorithm, base.Algorithm)
  key = jax.random.key(3)
  assert_same(
    a.init(key, state.encoder, state.aligner, 3), rgb.init(key, state.encoder, state.aligner, 3)
  )
  got = jax.jit(a.round)(state, arrays, mask)
  want = jax.jit(rgb.round)(state, arrays, mask)
  assert_same(got, want)
