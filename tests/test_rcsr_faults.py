"""Client faults in RCSR's round (every method of algorithms/rcsr.py): off == today's round,
dropped clients weigh 0 and lose their round, all dropped leaves the server as it was,
stragglers take their budget of steps, and a scaled Byzantine update moves FedAvg's aggregate
by exactly its weight times (scale - 1) (the runner's faults block: tests/test_faults_run.py).

Five compiles of one round (no faults, and four fault settings; the method is a traced
argument, so FedAvg and RCSR-p share each) on encoders of one block each.
"""

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rcsr_toys
import rounding
from rcsr_toys import BATCH, PER_ROUND, N

from fedjax_mm.algorithms import rcsr as alg
from fedjax_mm.core import faults as faults_lib
from fedjax_mm.data import world
from fedjax_mm.models import image, text

#: round(0.01 * 3) = 0: switched on, nobody drawn.
IDLE = faults_lib.Faults(dropout=0.01)
#: One of the 3 sampled clients drops, one of the two survivors straggles.
DROP_ONE = faults_lib.Faults(dropout=0.34, stragglers=0.34)
DROP_ALL = faults_lib.Faults(dropout=1.0)
SCALE = -10.0
BYZANTINE = faults_lib.Faults(byzantine_count=1, byzantine_mode="scaled", byzantine_scale=SCALE)


@pytest.fixture(scope="module")
def setup():
  """tests/rcsr_toys.py's clients on a ViT and a text Transformer of one block each
  (fewer compile seconds than test_rcsr_alg.py's)."""
  return rcsr_toys.tiny(
    lambda rngs: image.Vit(width=16, depth=1, num_heads=1, image_size=16, rngs=rngs),
    lambda rngs: text.TextTransformer(
      vocab_size=len(world.VOCAB), max_len=12, width=16, depth=1, num_heads=1, rngs=rngs
    ),
  )


@pytest.fixture(scope="module")
def state0(setup):
  spec, glob, personal, frozen, arrays, mask, mod = setup
  init = jax.jit(functools.partial(alg.init, spec))
  return init(glob, personal, frozen, arrays, mask, mod, jax.random.key(2))


@pytest.fixture(scope="module")
def routed(state0):
  """The start of round 2: past the router's warm-up (T_w = 1), so RCSR's router steps."""
  return state0.replace(round=jnp.asarray(1, jnp.int32))


@pytest.fixture(scope="module")
def step(setup):
  """``(method, state, faults) -> (state, metrics)``: one compile per fault setting."""
  spec, _, _, frozen, arrays, mask, mod = setup
  jitted = jax.jit(functools.partial(alg.round_step, spec, frozen), static_argnames=("faults",))
  return lambda name, state, faults: jitted(
    alg.method(name), state, arrays, mask, mod, faults=faults
  )


def _masks(state, faults):
  """The round's faults over its sampled clients, derived as round_step documents."""
  key = jax.random.fold_in(jax.random.fold_in(state.rng, state.round), faults_lib.SALT)
  return jax.tree.map(np.asarray, faults_lib.draw(key, jnp.ones((PER_ROUND,), bool), faults))


def _row(tree, k):
  return jax.tree.map(lambda x: x[k], tree)


def _equal(a, b) -> bool:
  """Bit for bit (keys by their data)."""

  def raw(x):
    return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x

  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  return all(np.array_equal(raw(x), raw(y)) for x, y in pairs)


def _full_steps(mask):
  """Each client's local steps without faults: ``E ceil(n_k / b)`` (E = 1)."""
  return -(-np.asarray(mask).sum(1) // BATCH)


def test_faults_off_and_faults_that_draw_nobody_equal_todays_round(setup, routed, step):
  """Off is the default and takes the fault-free code path (no fault metrics: the
  program of the round before faults existed). Switched on with nobody drawn, the fault
  path gives the same round: a budget of every step masks no step and every mask selects
  the honest value, so they agree to float rounding (another program, fused otherwise:
  measured a few ulp, ``rounding.py``)."""
  mask = setup[5]
  assert inspect.signature(alg.round_step).parameters["faults"].default is faults_lib.NONE
  assert not faults_lib.NONE.enabled and IDLE.enabled
  for name in ("fedavg", "rcsr_p"):  # data-size weights; router + q game + personal adapters
    today, out = step(name, routed, faults_lib.NONE)
    assert "fault_counts" not in out and "steps" not in out
    idle, idle_out = step(name, routed, IDLE)
    counts = {k: int(v) for k, v in idle_out["fault_counts"].items()}
    assert counts == {"dropped": 0, "stragglers": 0, "byzantine": 0}
    # The router's parameters are compared through its optimiser state (Adam's moments of
    # the gradients), not after the step: Adam's first step turns a gradient of pure
    # rounding noise (the attention keys' bias, whose gradient is 0 in exact arithmetic:
    # softmax ignores a shift) into a full step of +-lr.
    rounding.assert_close(idle.replace(router=today.router), today)
    for key in ("loss", "weight", "router_loss", "sampled"):
      rounding.assert_close(idle_out[key], out[key])
    sampled = np.asarray(out["sampled"])
    steps = np.asarray(idle_out["steps"])[sampled]
    np.testing.assert_array_equal(steps, _full_steps(mask)[sampled])


@pytest.fixture(scope="module")
def drop_one(routed, step):
  """RCSR-p's round 2 with one of the three sampled clients dropped, both survivors
  straggling: ``(state, metrics, masks, idx)``."""
  new, out = step("rcsr_p", routed, DROP_ONE)
  idx = np.flatnonzero(np.asarray(out["sampled"]))
  return new, out, _masks(routed, DROP_ONE), idx


def test_dropped_client_weighs_zero_and_loses_its_round(routed, drop_one):
  new, out, masks, idx = drop_one
  assert masks.dropped.sum() == 1 and int(out["fault_counts"]["dropped"]) == 1
  gone, kept = idx[masks.dropped], idx[~masks.dropped]
  np.testing.assert_array_equal(np.flatnonzero(out["dropped"]), gone)  # the runner's ledger
  weight = np.asarray(out["weight"])
  assert weight[gone] == 0 and (weight[kept] > 0).all()
  np.testing.assert_allclose(weight[kept].sum(), 1.0, rtol=1e-6)
  # The router's softmax (w^R, kept as last_wr) runs over the survivors alone.
  np.testing.assert_allclose(np.asarray(new.last_wr)[kept].sum(), 1.0, rtol=1e-6)
  assert (np.asarray(new.last_wr)[kept] != np.asarray(routed.last_wr)[kept]).all()
  # The dropped client's round is lost on its side: personal adapters and last w^R as
  # they were, while a survivor that took a step moved its own (RCSR-p trains them).
  (k,) = gone
  assert _equal(_row(new.personal, k), _row(routed.personal, k))
  assert new.last_wr[k] == routed.last_wr[k]
  stepped = kept[np.asarray(out["steps"])[kept] > 0]
  assert len(stepped) and np.asarray(out["steps"])[k] > 0  # the dropped one trained too
  for j in stepped:
    assert not _equal(_row(new.personal, j), _row(routed.personal, j))
  # The q game reads survivors only: the dropped client's q gets no factor, as the
  # unsampled client's, so their ratio is kept; a survivor's is not.
  (u,) = np.setdiff1d(np.arange(N), idx)
  q0, q1 = np.asarray(routed.fair.q, np.float64), np.asarray(new.fair.q, np.float64)
  np.testing.assert_allclose(q1[k] / q1[u], q0[k] / q0[u], rtol=1e-6)
  assert abs(q1[kept[0]] / q1[u] - q0[kept[0]] / q0[u]) > 1e-3


def test_stragglers_take_exactly_their_budget_of_steps(setup, drop_one):
  mask = setup[5]
  _, out, masks, idx = drop_one
  assert masks.straggler.sum() == 1 and int(out["fault_counts"]["stragglers"]) == 1
  full = _full_steps(mask)[idx]
  budget = np.asarray(
    faults_lib.step_budget(
      jnp.asarray(masks.work), np.asarray(mask)[idx].sum(1), num_epochs=1, batch_size=BATCH
    )
  )
  steps = np.asarray(out["steps"])[idx]
  np.testing.assert_array_equal(steps, budget)
  # The stragglers stop short of their full count; the dropped client trained in full
  # (it drops after training has started).
  assert (steps[masks.straggler] < full[masks.straggler]).all()
  np.testing.assert_array_equal(steps[masks.dropped], full[masks.dropped])


def test_when_every_sampled_client_drops_the_server_state_is_unchanged(routed, step):
  """With q 1% off its simplex and a non-zero last global update, so that a renormalised
  q, a zero update, an EMA towards 0 or the router's NaN gradient would all show."""
  start = routed.replace(
    fair=routed.fair._replace(q=jnp.asarray([0.1, 0.2, 0.3, 0.41], jnp.float32)),
    prev_update=jax.random.normal(jax.random.key(5), routed.prev_update.shape),
  )
  new, out = step("rcsr_p", start, DROP_ALL)
  assert int(out["fault_counts"]["dropped"]) == PER_ROUND
  sampled = np.asarray(out["sampled"])
  np.testing.assert_array_equal(np.asarray(out["weight"])[sampled], 0.0)
  assert int(new.round) == int(start.round) + 1
  for field in dataclasses.fields(start):  # params, prototypes, router, q game, ...
    if field.name != "round":
      assert _equal(getattr(new, field.name), getattr(start, field.name)), field.name


def test_scaled_byzantine_update_moves_fedavg_by_its_weight_times_scale_minus_one(
  setup, state0, step
):
  """FedAvg (data-size weights, no router): the Byzantine client's received update is
  ``scale x`` its honest one, so the aggregate is the honest round's plus ``w_b (scale -
  1) (trained_b - g)``, and so is the last global update gamma_k reads; its reported
  prototypes are ``scale x`` the honest ones in the slots it holds; its loss is honest.
  ``trained_b`` is ``client_update`` run alone with the round's key for that client."""
  spec, glob, personal, frozen, arrays, mask, mod = setup
  meth = alg.method("fedavg")
  honest, out = step("fedavg", state0, faults_lib.NONE)
  byz, byz_out = step("fedavg", state0, BYZANTINE)
  masks = _masks(state0, BYZANTINE)
  idx = np.flatnonzero(np.asarray(out["sampled"]))
  (j,) = np.flatnonzero(masks.byzantine)
  b = idx[j]
  # Round_step's key for its j-th sampled client (fold_in(rng, t), then split).
  _, _, k_clients = jax.random.split(jax.random.fold_in(state0.rng, state0.round), 3)
  key = jax.random.split(k_clients, PER_ROUND)[j]
  update = jax.jit(functools.partial(alg.client_update, spec, frozen, meth))
  trained, _, _ = update(
    state0.params,
    state0.prototypes,
    alg.round_lr(spec, state0.round),
    state0.round >= spec.personal_start,
    _row(state0.personal, b),
    key,
    _row(arrays, b),
    mask[b],
    mod[b],
    alg.strength(spec, meth, state0.last_wr[b]),
  )
  sizes = np.asarray(mask)[idx].sum(1)
  w_b = sizes[j] / sizes.sum()
  np.testing.assert_array_equal(byz_out["weight"], out["weight"])
  rounding.assert_close(byz_out["loss"], out["loss"])  # same training, honest report
  factor = w_b * (SCALE - 1.0)
  expect = jax.tree.map(lambda h, t, g: h + factor * (t - g), honest.params, trained, glob)
  rounding.assert_close(byz.params, expect)
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
  rounding.assert_close(
    byz.prev_update, honest.prev_update + factor * (flat(trained) - flat(state0.params))
  )
  # Its prototypes: scale x the honest report in the held slots; a missing slot holds
  # the server's EMA prototype and is not corrupted.
  z_i, z_t = alg.client_embeddings(
    spec, frozen, trained, _row(state0.personal, b), arrays["image"][b], arrays["caption"][b, :, 0]
  )
  report = alg._reported(z_i, z_t, mask[b], mod[b], state0.prototypes)
  held = np.asarray(mod[b])[:, None]
  sent = np.where(held, SCALE * np.asarray(report), np.asarray(report))
  mu = spec.proto_momentum
  moved = (1 - mu) * w_b * (sent - np.asarray(report))
  rounding.assert_close(byz.prototypes, honest.prototypes + moved)
  assert np.abs(moved).max() > 1e-3
