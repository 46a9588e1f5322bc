"""RCSR on the engine: the missing tower gets no update under AdamW, personal adapters
never leave the client, mapped == looped client updates, every method's round runs."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rcsr_toys
from flax import nnx
from rcsr_toys import MODALITY, PER_ROUND, N

from fedjax_mm.algorithms import rcsr as alg
from fedjax_mm.data import world
from fedjax_mm.models import image, text

_unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
RNG_PROTOS = _unit(np.random.default_rng(0).normal(size=(N, 2, 8))).astype(np.float32)


@pytest.fixture(scope="module")
def setup():
  return rcsr_toys.tiny(
    lambda rngs: image.vit_t(image_size=16, rngs=rngs),
    lambda rngs: text.transformer_t(vocab_size=len(world.VOCAB), max_len=12, rngs=rngs),
    labels=True,
    num_classes=3,
  )


@pytest.fixture(scope="module")
def update_fn(setup, update_from):
  """One client's update from the global model at lr 1e-2, s_k 0.3, personal on.

  :func:`update_from`'s program with these as its arguments: the same client update,
  and one compile (about 12 s) for both fixtures instead of two.
  """
  glob = setup[1]

  def fn(meth, protos, k_personal, key, k_arrays, k_mask, k_mod):
    lr, on, s_k = jnp.asarray(1e-2), jnp.asarray(True), jnp.asarray(0.3)
    return update_from(
      meth, glob, protos, lr, on, k_personal, key, k_arrays, k_mask, k_mod, s_k, {}
    )

  return fn


@pytest.fixture(scope="module")
def public():
  """FedMEKT's proxy set: 5 pairs of another world draw (caption 0)."""
  cfg = world.WorldConfig(image_size=16, captions_per_image=2, max_caption_len=12)
  d = world.generate(1, 5, config=cfg)
  return {"image": jnp.asarray(d["image"]), "caption": jnp.asarray(d["caption"][:, 0])}


@pytest.fixture(scope="module")
def state0(setup, public):
  spec, glob, personal, frozen, arrays, mask, mod = setup
  init = jax.jit(functools.partial(alg.init, spec))
  return init(glob, personal, frozen, arrays, mask, mod, jax.random.key(2), public=public)


#: round_step's static switches, each off (FedAvg's).
FLAGS_OFF = alg.round_flags("fedavg")


@pytest.fixture(scope="module")
def step(setup):
  """One jitted round for the module's tests (compiled once per set of static switches).

  Every switch is passed, off unless the call turns it on: jit keys its cache on the
  keywords a call names, so ``step(...)`` and ``step(..., moon=False)`` would each trace
  and compile the same round (about 10 s each).
  """
  spec, frozen = setup[0], setup[3]
  jitted = jax.jit(
    functools.partial(alg.round_step, spec, frozen), static_argnames=tuple(FLAGS_OFF)
  )
  return lambda *args, **kwargs: jitted(*args, **(FLAGS_OFF | kwargs))


def _update(setup, fn, k, meth, protos):
  _, _, personal, _, arrays, mask, mod = setup
  k_arrays, k_mask, k_mod = _row((arrays, mask, mod), k)
  return fn(meth, protos, personal, jax.random.key(k), k_arrays, k_mask, k_mod)


def _changed(a, b, part):
  """Each leaf's ``max |a - b|`` whose path holds ``part``.

  In numpy: the same float32 differences, exactly, without compiling eager jnp programs
  (three per leaf shape), whose executables' memory mappings filled the process until
  conftest cleared the caches and the rounds compiled again.
  """
  leaves = jax.tree_util.tree_leaves_with_path(
    jax.tree.map(lambda x, y: np.abs(np.asarray(x) - np.asarray(y)).max(), a, b)
  )
  return {jax.tree_util.keystr(p): float(v) for p, v in leaves if part in jax.tree_util.keystr(p)}


def test_missing_tower_gets_no_update_under_adamw(setup, update_fn):
  protos = jnp.ones((2, 8)) / jnp.sqrt(8.0)
  glob = setup[1]
  new, _, _ = _update(setup, update_fn, 1, alg.method("rcsr"), protos)  # image-only client
  assert all(v == 0.0 for v in _changed(new, glob, "text_").values())
  assert max(_changed(new, glob, "image_").values()) > 0
  new, _, _ = _update(setup, update_fn, 2, alg.method("rcsr"), protos)  # text-only client
  assert all(v == 0.0 for v in _changed(new, glob, "image_").values())
  assert max(_changed(new, glob, "text_").values()) > 0


def test_personal_adapter_only_moves_under_rcsr_p(setup, update_fn):
  protos = jnp.ones((2, 8)) / jnp.sqrt(8.0)
  personal = setup[2]
  _, p_off, _ = _update(setup, update_fn, 0, alg.method("rcsr"), protos)
  assert all(v == 0.0 for v in _changed(p_off, personal, "").values())
  _, p_on, _ = _update(setup, update_fn, 0, alg.method("rcsr_p"), protos)
  assert max(_changed(p_on, personal, "").values()) > 0


def test_mapped_equals_looped_client_updates(setup, update_fn):
  spec, glob, personal, frozen, arrays, mask, mod = setup
  protos = jnp.ones((2, 8)) / jnp.sqrt(8.0)
  meth = alg.method("rcsr_p")
  fn = functools.partial(
    alg.client_update, spec, frozen, meth, glob, protos, jnp.asarray(1e-2), jnp.asarray(True)
  )
  stacked_personal = jax.tree.map(lambda x: jnp.broadcast_to(x, (N,) + x.shape), personal)
  keys = jnp.stack([jax.random.key(k) for k in range(N)])
  args = (stacked_personal, keys, arrays, mask, mod, jnp.full((N,), 0.3))
  mapped = jax.jit(lambda a: alg.map_clients(fn, a, "vmap"))(args)
  for k in range(N):
    looped = _update(setup, update_fn, k, meth, protos)
    for a, b in zip(jax.tree.leaves(looped), jax.tree.leaves(mapped), strict=True):
      np.testing.assert_allclose(a, np.asarray(b)[k], rtol=2e-4, atol=2e-6)


def test_rounds_of_every_method_and_personal_state_stays_home(setup, state0, step, public):
  spec, glob, personal, frozen, arrays, mask, mod = setup
  states = {}
  for name in alg.METHODS:
    state = state0
    flags = alg.round_flags(name)
    if flags["mekt"] or flags["cream"]:
      flags["public"] = public
    for _ in range(2):  # round 2 is past the router's warm-up (T_w = 1)
      state, metrics = step(alg.method(name), state, arrays, mask, mod, **flags)
    # A round returns the state type it takes (dtypes, weak types, shapes), so a
    # run's second round reuses the first round's compile (a weakly typed q did not).
    assert jax.tree.map(jax.typeof, state) == jax.tree.map(jax.typeof, state0), name
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.params))
    assert np.isclose(np.nansum(metrics["weight"]), 1.0)
    states[name] = state
  np.testing.assert_allclose(states["rcsr"].fair.q.sum(), 1.0, rtol=1e-6)
  assert not np.allclose(states["rcsr"].fair.q, 1 / N)  # the q game ran
  np.testing.assert_array_equal(states["fedavg"].fair.q, state0.fair.q)
  # Ours: the centred q game plays too, to other weights than the paper's.
  np.testing.assert_allclose(states["rcsr_centred_q"].fair.q.sum(), 1.0, rtol=1e-6)
  assert not np.allclose(states["rcsr_centred_q"].fair.q, states["rcsr"].fair.q)
  # RCSR-p reports the shared loss exactly, so its q game and global model are RCSR's.
  np.testing.assert_array_equal(states["rcsr_p"].fair.q, states["rcsr"].fair.q)
  for x, y in zip(*(jax.tree.leaves(states[m].params) for m in ("rcsr_p", "rcsr")), strict=True):
    np.testing.assert_array_equal(x, y)
  # The global model never depends on the personal adapters: replace them, same round.
  moved = state0.replace(personal=jax.tree.map(lambda x: x + 1.0, state0.personal))
  a, _ = step(alg.method("rcsr_p"), state0, arrays, mask, mod)
  b, _ = step(alg.method("rcsr_p"), moved, arrays, mask, mod)
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
    np.testing.assert_array_equal(x, y)
  # What is sent is adapters + heads only (no encoder, no personal adapter).
  sent = alg.sent_bytes(glob)
  assert sent < sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(frozen))
  names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(glob)}
  assert not any("personal" in n or "encoder" in n for n in names)


def test_ablation_switches_act(setup, state0, step):
  """Table 5 / C.4 ablations: each removes what it names and nothing else."""
  spec, glob, personal, frozen, arrays, mask, mod = setup
  no_align = alg.method("rcsr_no_align")
  assert float(no_align.lambda_a) == 0 and float(no_align.lambda_s) == 0
  assert bool(no_align.router) and bool(no_align.fair)

  def two_rounds(name):
    state = state0
    outs = []
    for _ in range(2):  # round 2 is past the router's warm-up (T_w = 1)
      state, out = step(alg.method(name), state, arrays, mask, mod)
      outs.append(out)
    return state, outs

  full, full_out = two_rounds("rcsr")
  no_minimax, _ = two_rounds("rcsr_no_minimax")
  np.testing.assert_array_equal(no_minimax.fair.q, state0.fair.q)  # no q game
  moved = _changed(no_minimax.router, state0.router, "")
  assert max(moved.values()) > 0  # ... but the router trains
  zero, zero_out = two_rounds("rcsr_zero_fill")
  # Round 1 (warm-up: data-size weights) is the same; the zero fill reaches the router.
  np.testing.assert_array_equal(zero_out[0]["weight"], full_out[0]["weight"])
  assert float(zero_out[1]["router_loss"]) != float(full_out[1]["router_loss"])
  # ... and only the router: the EMA prototypes of round 1 are the full method's.
  one_full, _ = step(alg.method("rcsr"), state0, arrays, mask, mod)
  one_zero, _ = step(alg.method("rcsr_zero_fill"), state0, arrays, mask, mod)
  np.testing.assert_array_equal(one_zero.prototypes, one_full.prototypes)


def test_strength_eq13_or_fixed(setup):
  spec = setup[0]
  wr = jnp.asarray([0.05, 0.3, 0.6])
  adaptive = alg.strength(spec, alg.method("rcsr_p"), wr)
  expect = np.minimum(spec.lambda_p * (1 + np.maximum(0, 0.5 - np.asarray(wr))), 0.5)
  np.testing.assert_allclose(adaptive, expect, rtol=1e-6)
  fixed = alg.strength(spec, alg.method("rcsr_p_fixed"), wr)
  np.testing.assert_allclose(fixed, np.full(3, spec.lambda_p), rtol=1e-6)


def test_personal_learning_rate_ratio_acts(setup):
  """Sec. 4.5's 0.1 x lr is a config knob: 0 freezes the adapter, 1 moves it more."""
  spec, glob, personal, frozen, arrays, mask, mod = setup
  protos = jnp.ones((2, 8)) / jnp.sqrt(8.0)
  k_arrays, k_mask, k_mod = _row((arrays, mask, mod), 0)

  def moved(r):
    s = dataclasses.replace(spec, personal_lr_ratio=r)
    fn = jax.jit(functools.partial(alg.client_update, s, frozen, alg.method("rcsr_p"), glob))
    _, new, _ = fn(
      protos,
      jnp.asarray(1e-2),
      jnp.asarray(True),
      personal,
      jax.random.key(0),
      k_arrays,
      k_mask,
      k_mod,
      jnp.asarray(0.3),
    )
    return max(_changed(new, personal, "").values())

  base = moved(0.1)
  assert base > 0 and moved(0.0) == 0.0
  assert moved(1.0) > 3 * base


def test_moon_term_acts_and_keeps_previous_models(setup, state0, step):
  """MOON: weight 0 is FedAvg (to rounding); weight 1 changes the round; the sampled
  clients' local models become their ``previous`` ones, the others keep theirs."""
  spec, glob, personal, frozen, arrays, mask, mod = setup
  fedavg, _ = step(alg.method("fedavg"), state0, arrays, mask, mod)
  off, _ = step(alg.method("moon", moon_mu=0.0), state0, arrays, mask, mod, moon=True)
  # (Two different compiles: equal up to float32 rounding of reordered sums.)
  assert max(_changed(fedavg.params, off.params, "").values()) < 2e-6
  # Round 2: the previous models now differ from the global one, so the term has a gradient.
  fedavg2, _ = step(alg.method("fedavg"), off, arrays, mask, mod)
  moon2, out = step(alg.method("moon"), off, arrays, mask, mod, moon=True)
  print("MOON vs FedAvg", max(_changed(moon2.params, fedavg2.params, "").values()))
  assert max(_changed(moon2.params, fedavg2.params, "").values()) > 1e-4
  sampled = np.asarray(out["sampled"])
  for k in range(N):
    prev, before = _row(moon2.previous, k), _row(off.previous, k)
    assert (max(_changed(prev, before, "").values()) > 0) == sampled[k]


@pytest.fixture(scope="module")
def update_from(setup):
  """One client's update from given starting adapters + heads (a looped reference)."""
  spec, frozen = setup[0], setup[3]

  @jax.jit
  def fn(
    meth, start, protos, lr, personal_on, k_personal, key, k_arrays, k_mask, k_mod, s_k, extra
  ):
    return alg.client_update(
      spec,
      frozen,
      meth,
      start,
      protos,
      lr,
      personal_on,
      k_personal,
      key,
      k_arrays,
      k_mask,
      k_mod,
      s_k,
      **extra,
    )

  return fn


@pytest.fixture(scope="module")
def embed(setup):
  """A client's embeddings of given images and captions (one jit for the module's tests)."""
  spec, frozen = setup[0], setup[3]
  return jax.jit(functools.partial(alg.client_embeddings, spec, frozen))


def _looped_round(setup, update_from, meth, state, start_of, extra=None):
  """Round_step's sampling and client updates, one client at a time: ``(idx, news)``
  with ``news[j] = (adapters + heads, personal)`` of the j-th sampled client;
  ``extra``: client_update's keyword arguments (MFCPL's, FedMEKT's, CreamFL's)."""
  spec, _, _, _, arrays, mask, mod = setup
  t = state.round
  _, k_sample, k_clients = jax.random.split(jax.random.fold_in(state.rng, t), 3)
  idx = np.sort(np.asarray(jax.lax.top_k(jax.random.uniform(k_sample, (N,)), PER_ROUND)[1]))
  keys = jax.random.split(k_clients, PER_ROUND)
  s_k = alg.strength(spec, meth, state.last_wr[idx])
  news = []
  for j, k in enumerate(idx):
    k_arrays, k_mask, k_mod = _row((arrays, mask, mod), k)
    new_global, new_personal, _ = update_from(
      meth,
      start_of(k),
      state.prototypes,
      alg.round_lr(spec, t),
      t >= spec.personal_start,
      _row(state.personal, k),
      keys[j],
      k_arrays,
      k_mask,
      k_mod,
      np.asarray(s_k)[j],
      {} if extra is None else extra,
    )
    news.append((new_global, new_personal))
  return idx, news


def _row(tree, k):
  """Client ``k``'s row of each leaf, in numpy (an eager ``x[k]`` compiles per k and shape)."""
  return jax.tree.map(lambda x: np.asarray(x)[k], tree)


def _assert_close(a, b, atol=2e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=2e-4, atol=atol)


#: Where a gradient entry is near Adam's epsilon (1e-8), Adam's step m / (sqrt(v) + eps)
#: turns that gradient's float32 rounding into a visible part of the learning rate: one of
#: the 64 entries of a pFedMMA client adapter came out 1.3e-5 apart (the setup's lr is
#: 1e-2) between the engine and the looped reference, which agree in float64
#: (JAX_ENABLE_X64=1). Half a percent of the learning rate is far below what averaging a
#: client's own adapters, or training the wrong client, would move them.
ADAM_ROUNDING_ATOL = 5e-3 * 1e-2


def test_fedper_adapters_and_heads_never_leave_the_client(setup, state0, step, update_from):
  """FedPer: each sampled client trains its own adapters + heads (== a looped reference
  started from them), keeps them, and the server's model does not move."""
  spec, glob, personal, frozen, arrays, mask, mod = setup
  meth = alg.method("fedper")
  s1, _ = step(meth, state0, arrays, mask, mod, fedper=True)
  s2, out = step(meth, s1, arrays, mask, mod, fedper=True)
  for x, y in zip(jax.tree.leaves(s2.params), jax.tree.leaves(state0.params), strict=True):
    np.testing.assert_array_equal(x, y)
  idx, news = _looped_round(setup, update_from, meth, s1, lambda k: _row(s1.previous, k))
  assert np.array_equal(np.flatnonzero(np.asarray(out["sampled"])), idx)
  for k, (new_global, _) in zip(idx, news, strict=True):
    _assert_close(_row(s2.previous, k), new_global)
  # Two clients with different data end with different adapters + heads.
  assert max(_changed(_row(s2.previous, idx[0]), _row(s2.previous, idx[1]), "").values()) > 1e-4
  # An unsampled client's model is its own: perturbing it changes no sampled client.
  j = int(np.flatnonzero(~np.asarray(out["sampled"]))[0])
  bumped = s1.replace(previous=jax.tree.map(lambda x: x.at[j].add(1.0), s1.previous))
  s2b, _ = step(meth, bumped, arrays, mask, mod, fedper=True)
  for k in idx:
    a, b = jax.tree.leaves(_row(s2b.previous, k)), jax.tree.leaves(_row(s2.previous, k))
    for x, y in zip(a, b, strict=True):
      np.testing.assert_array_equal(x, y)
  # The ledger: no adapters / heads either way, only the prototype report / broadcast.
  assert alg.traffic_bytes("fedper", glob, spec.dim) == (2 * spec.dim * 4, 2 * spec.dim * 4)
  up, down = alg.traffic_bytes("fedavg", glob, spec.dim)
  assert up == down == alg.sent_bytes(glob) + 2 * spec.dim * 4


def test_pfedmma_shared_adapters_averaged_client_adapters_stay_home(
  setup, state0, step, update_from
):
  """pFedMMA: the shared adapters + heads are the data-size weighted average of the
  clients' (computed here by hand from a looped reference); each client's own adapters
  are what it trained and are never averaged; an unsampled client's are untouched."""
  spec, glob, personal, frozen, arrays, mask, mod = setup
  meth = alg.method("pfedmma")
  assert float(meth.client_scale) == 0.5
  s1, out = step(meth, state0, arrays, mask, mod)
  idx, news = _looped_round(setup, update_from, meth, state0, lambda k: state0.params)
  sizes = np.asarray(mask)[idx].sum(1)
  w = sizes / sizes.sum()
  want = jax.tree.map(
    lambda g, *new: g + sum(wk * (n - g) for wk, n in zip(w, new, strict=True)),
    state0.params,
    *[g for g, _ in news],
  )
  _assert_close(s1.params, want)
  for k, (_, new_personal) in zip(idx, news, strict=True):
    _assert_close(_row(s1.personal, k), new_personal, atol=ADAM_ROUNDING_ATOL)
    moved = _changed(_row(s1.personal, k), personal, "client_")
    held = [t for t, on in zip(("image_", "text_"), np.asarray(mod)[k], strict=True) if on]
    assert all(max(v for p, v in moved.items() if t in p) > 0 for t in held)
    assert all(v == 0 for p, v in moved.items() if not any(t in p for t in held))
    # RCSR-p's adapter is not pFedMMA's: it stays at its initial value.
    assert all(v == 0 for v in _changed(_row(s1.personal, k), personal, "'personal'").values())
  a, b = (_row(s1.personal, k) for k in idx[:2])
  assert max(_changed(a, b, "client_").values()) > 0
  j = int(np.flatnonzero(~np.asarray(out["sampled"]))[0])
  for x, y in zip(jax.tree.leaves(_row(s1.personal, j)), jax.tree.leaves(personal), strict=True):
    np.testing.assert_array_equal(x, y)
  # The client-specific adapters are not sent.
  names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(glob)}
  assert not any("client_" in n for n in names)


def test_placeholder_learns_from_the_router_loss_only_after_warm_up(setup, state0, step):
  """C.4's learnable placeholder: L_R has a gradient in a filled slot; the placeholder is
  untouched in the warm-up round (router off) and moves in the next; RCSR's does not."""
  spec, glob, personal, frozen, arrays, mask, mod = setup
  protos = jnp.asarray(RNG_PROTOS)
  c_mod = jnp.asarray(MODALITY)
  # Jitted: one compile, where eager it compiled ~280 programs (one per op and shape).
  grad = jax.jit(
    jax.grad(
      lambda p: alg.S.router_loss(
        state0.router,
        p,
        jnp.zeros((N, 4)),
        c_mod,
        jnp.ones((N,)),
        jnp.ones((N,), bool),
        state0.prototypes,
        heads=spec.router_heads,
      )[0]
    )
  )(protos)
  filled = ~np.asarray(MODALITY)
  assert np.abs(np.asarray(grad)[filled]).max() > 0
  meth = alg.method("rcsr_placeholder_fill")
  s1, o1 = step(meth, state0, arrays, mask, mod)  # round 1 <= T_w: no router step
  np.testing.assert_array_equal(s1.placeholder, state0.placeholder)
  s2, o2 = step(meth, s1, arrays, mask, mod)
  assert np.abs(np.asarray(s2.placeholder - s1.placeholder)).max() > 0
  full1, _ = step(alg.method("rcsr"), state0, arrays, mask, mod)
  full2, f2 = step(alg.method("rcsr"), full1, arrays, mask, mod)
  np.testing.assert_array_equal(full2.placeholder, state0.placeholder)
  # ... and it is what the router sees: round 2's L_R differs from the EMA fill's.
  assert float(o2["router_loss"]) != float(f2["router_loss"])


def _fedavg_of(state, idx, news, mask):
  """The data-size weighted FedAvg of the looped clients' adapters + heads."""
  sizes = np.asarray(mask)[idx].sum(1)
  w = sizes / sizes.sum()
  return jax.tree.map(
    lambda g, *new: g + sum(wk * (n - g) for wk, n in zip(w, new, strict=True)),
    state.params,
    *[g for g, _ in news],
  )


def _mean_rows(num, den, previous):
  """``num / den`` re-normalised where ``den > 0``, else ``previous`` (numpy)."""
  mean = num / np.maximum(den, 1)[..., None]
  norm = np.linalg.norm(mean, axis=-1, keepdims=True)
  return np.where(den[..., None] > 0, mean / np.maximum(norm, 1e-12), np.asarray(previous))


def test_mfcpl_weight_acts_and_server_averages_class_prototypes(
  setup, state0, step, update_from, embed
):
  """MFCPL: weight 0 is FedAvg (to rounding), weight 1 changes the round; the round ==
  a looped reference; the server's class prototypes == the count-weighted mean of the
  sampled clients' per-class prototypes of their held modalities, by hand."""
  spec, glob, personal, frozen, arrays, mask, mod = setup
  assert np.asarray(alg.M.valid_prototypes(state0.class_prototypes)).all()  # every class seen
  fedavg, _ = step(alg.method("fedavg"), state0, arrays, mask, mod)
  off, _ = step(alg.method("mfcpl", mfcpl_mu=0.0), state0, arrays, mask, mod, mfcpl=True)
  assert max(_changed(fedavg.params, off.params, "").values()) < 2e-6
  meth = alg.method("mfcpl")
  s1, _ = step(meth, state0, arrays, mask, mod, mfcpl=True)
  print("MFCPL vs FedAvg", max(_changed(s1.params, fedavg.params, "").values()))
  assert max(_changed(s1.params, fedavg.params, "").values()) > 1e-4
  extra = {"class_prototypes": state0.class_prototypes}
  idx, news = _looped_round(setup, update_from, meth, state0, lambda k: state0.params, extra)
  _assert_close(s1.params, _fedavg_of(state0, idx, news, mask))
  num, den = np.zeros((2, 3, spec.dim)), np.zeros((2, 3))
  for k, (g, q) in zip(idx, news, strict=True):
    images, captions = np.asarray(arrays["image"])[k], np.asarray(arrays["caption"])[k, :, 0]
    z = [np.asarray(x) for x in embed(g, q, images, captions)]
    labels, valid = np.asarray(arrays["label"])[k], np.asarray(mask)[k]
    for v in range(2):
      for c in range(3):
        rows = z[v][(labels == c) & valid]
        if MODALITY[k, v] and len(rows):
          mean = rows.mean(0)
          num[v, c] += len(rows) * mean / np.linalg.norm(mean)
          den[v, c] += len(rows)
  want = _mean_rows(num, den, state0.class_prototypes)
  np.testing.assert_allclose(s1.class_prototypes, want, rtol=2e-4, atol=2e-6)


def test_fedmekt_weight_acts_and_server_averages_proxy_embeddings(
  setup, state0, step, update_from, public, embed
):
  """FedMEKT: the first targets are the initial model's proxy embeddings; weight 0 is
  FedAvg (to rounding), weight 1 changes the round; the round == a looped reference;
  the server's targets == the mean proxy embeddings of the sampled clients holding each
  modality, by hand."""
  spec, glob, personal, frozen, arrays, mask, mod = setup
  s0 = state0
  first = jnp.stack(embed(glob, personal, public["image"], public["caption"]))
  np.testing.assert_allclose(s0.public_embeddings, first, rtol=1e-5, atol=1e-6)
  kw = {"mekt": True, "public": public}
  fedavg, _ = step(alg.method("fedavg"), s0, arrays, mask, mod)
  off, _ = step(alg.method("fedmekt", mekt_mu=0.0), s0, arrays, mask, mod, **kw)
  assert max(_changed(fedavg.params, off.params, "").values()) < 2e-6
  # Round 2: the targets (the clients' round-1 average) differ from the global model's.
  fedavg2, _ = step(alg.method("fedavg"), off, arrays, mask, mod)
  meth = alg.method("fedmekt")
  s2, _ = step(meth, off, arrays, mask, mod, **kw)
  print("FedMEKT vs FedAvg", max(_changed(s2.params, fedavg2.params, "").values()))
  assert max(_changed(s2.params, fedavg2.params, "").values()) > 1e-4
  extra = {"public": public, "public_targets": off.public_embeddings}
  idx, news = _looped_round(setup, update_from, meth, off, lambda k: off.params, extra)
  # (Adam's steps on near-zero gradients magnify the rounding of mapped vs looped.)
  _assert_close(s2.params, _fedavg_of(off, idx, news, mask), atol=2e-5)
  sums, n = np.zeros((2, 5, spec.dim)), np.zeros(2)
  for k, (g, q) in zip(idx, news, strict=True):
    e = np.stack([np.asarray(x) for x in embed(g, q, public["image"], public["caption"])])
    for v in range(2):
      if MODALITY[k, v]:
        sums[v] += e[v]
        n[v] += 1
  want = np.where(
    n[:, None, None] > 0, sums / np.maximum(n, 1)[:, None, None], off.public_embeddings
  )
  np.testing.assert_allclose(s2.public_embeddings, want, rtol=2e-4, atol=2e-6)


def test_creamfl_weight_acts_gca_ema_and_single_modality_clients(
  setup, state0, step, update_from, public, embed
):
  """CreamFL: weight 0 is FedAvg (to rounding), its weight changes the clients' updates
  (not only the loss's scale, which AdamW would undo); the round == a looped reference
  from the global model, whose public representations are eq. (2)'s negatives; a
  single-modality client's missing tower comes back bit-identical; the server's global
  representations == GCA over the clients holding each modality (what a client does not
  hold, here NaN, is never read), folded in by the EMA at 0.9."""
  spec, glob, personal, frozen, arrays, mask, mod = setup
  kw = {"cream": True, "public": public}
  fedavg, _ = step(alg.method("fedavg"), state0, arrays, mask, mod)
  off, _ = step(alg.method("creamfl", cream_mu=0.0), state0, arrays, mask, mod, **kw)
  assert max(_changed(fedavg.params, off.params, "").values()) < 2e-6
  meth = alg.method("creamfl")
  assert float(meth.cream_mu) == 0.5 and spec.cream_decay == 0.9
  s1, _ = step(meth, state0, arrays, mask, mod, **kw)
  s4, _ = step(alg.method("creamfl", cream_mu=2.0), state0, arrays, mask, mod, **kw)
  print("CreamFL vs FedAvg", max(_changed(s1.params, fedavg.params, "").values()))
  assert max(_changed(s1.params, fedavg.params, "").values()) > 1e-4
  assert max(_changed(s1.params, s4.params, "").values()) > 1e-4
  start = jnp.stack(embed(state0.params, personal, public["image"], public["caption"]))
  np.testing.assert_allclose(state0.public_embeddings, start, rtol=1e-5, atol=1e-6)
  extra = {"public": public, "cream_reps": (state0.public_embeddings, start)}
  idx, news = _looped_round(setup, update_from, meth, state0, lambda k: state0.params, extra)
  _assert_close(s1.params, _fedavg_of(state0, idx, news, mask), atol=2e-5)
  singles = [j for j, k in enumerate(idx) if not MODALITY[k].all()]
  assert singles  # 3 of the 4 clients are sampled: one of them holds one modality
  for j in singles:
    missing = "text_" if MODALITY[idx[j], 0] else "image_"
    assert all(v == 0.0 for v in _changed(news[j][0], state0.params, missing).values())
  reports = []
  for j, k in enumerate(idx):
    e = np.stack([np.asarray(x) for x in embed(*news[j], public["image"], public["caption"])])
    e[~MODALITY[k]] = np.nan  # never sent
    reports.append(e)
  want, _ = alg.S.representation_ema(
    np.stack(reports), MODALITY[idx], state0.public_embeddings, np.ones(len(idx), bool)
  )
  assert np.isfinite(np.asarray(s1.public_embeddings)).all()
  np.testing.assert_allclose(s1.public_embeddings, want, rtol=2e-4, atol=2e-5)
  assert not np.allclose(s1.public_embeddings, state0.public_embeddings)


@pytest.mark.parametrize("build", [image.vit_t, image.vitc_t], ids=["patch_stem", "conv_stem"])
def test_adapted_forward_is_the_encoders_own_when_adapters_are_zero(build):
  # RcsrModel runs the ViT's blocks itself (an adapter after each); with every adapter's
  # branch zeroed it must be the encoder's forward, whichever stem the ViT has.
  enc = build(image_size=16, rngs=nnx.Rngs(0))
  txt = text.transformer_t(vocab_size=len(world.VOCAB), max_len=12, rngs=nnx.Rngs(1))
  model = alg.RcsrModel(
    enc, txt, adapter_dim=4, head_hidden=8, dim=6, personal_hidden=4, rngs=nnx.Rngs(2)
  )
  for adapter in (*model.image_adapters, *model.client_image_adapters):
    adapter.up.kernel[...] = jnp.zeros_like(adapter.up.kernel[...])
    adapter.up.bias[...] = jnp.zeros_like(adapter.up.bias[...])
  x = jax.random.uniform(jax.random.key(0), (3, 16, 16, 3))
  want = model.image_head(enc(x)[0])
  want = want / jnp.linalg.norm(want, axis=-1, keepdims=True)
  for scale in (None, jnp.asarray(0.7)):
    np.testing.assert_allclose(model.embed_image(x, scale), want, rtol=1e-5, atol=1e-6)
  # And the adapters act: a non-zero branch changes the embedding.
  first = model.image_adapters[0]
  first.down.kernel[...] = jax.random.normal(jax.random.key(1), first.down.kernel[...].shape)
  first.up.kernel[...] = jax.random.normal(jax.random.key(2), first.up.kernel[...].shape)
  assert float(jnp.abs(model.embed_image(x) - want).max()) > 1e-2
