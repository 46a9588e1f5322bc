"""core.optim: AdamP against a literal NumPy transcription of the reference's step, the
per-round rate, and PyTorch's cosine annealing."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from fedjax_mm.core import optim


def reference_adamp_step(p, grad, state, *, lr, b1, b2, eps, wd, delta, wd_ratio, nesterov):
  """``adamp.AdamP.step`` for one weight in PyTorch's layout (channels first), in NumPy.

  Returns the new weight and which branch the projection took.
  """
  state["step"] += 1
  bc1, bc2 = 1 - b1 ** state["step"], 1 - b2 ** state["step"]
  state["exp_avg"] = b1 * state["exp_avg"] + (1 - b1) * grad
  state["exp_avg_sq"] = b2 * state["exp_avg_sq"] + (1 - b2) * grad * grad
  denom = np.sqrt(state["exp_avg_sq"]) / math.sqrt(bc2) + eps
  step_size = lr / bc1
  if nesterov:
    perturb = (b1 * state["exp_avg"] + (1 - b1) * grad) / denom
  else:
    perturb = state["exp_avg"] / denom
  ratio, branch = 1.0, "adam"
  if p.ndim > 1:
    expand = [-1] + [1] * (p.ndim - 1)
    views = {"channel": lambda x: x.reshape(x.shape[0], -1), "layer": lambda x: x.reshape(1, -1)}
    for name, view in views.items():
      x, y = view(grad), view(p)
      cos = np.abs(
        np.sum(x * y, 1) / np.maximum(np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1), eps)
      )
      if cos.max() < delta / math.sqrt(view(p).shape[1]):
        p_n = p / (np.linalg.norm(view(p), axis=1).reshape(expand) + eps)
        perturb = perturb - p_n * np.sum(view(p_n * perturb), 1).reshape(expand)
        ratio, branch = wd_ratio, name
        break
  if wd > 0:
    p = p * (1 - lr * wd * ratio)
  return p - step_size * perturb, branch


def _orthogonal(g, w, rows):
  """``g`` with its component along ``w`` removed, per row of ``rows`` (channels) or whole."""
  g2, w2 = g.reshape(rows, -1), w.reshape(rows, -1)
  g2 = g2 - w2 * np.sum(g2 * w2, 1, keepdims=True) / np.sum(w2 * w2, 1, keepdims=True)
  return g2.reshape(g.shape)


def _at_cosine(g, w, rows, c):
  """A gradient at ``cos = c`` with each row (channel) of ``w``."""
  u = _orthogonal(g, w, rows).reshape(rows, -1)
  u /= np.linalg.norm(u, axis=1, keepdims=True)
  w2 = w.reshape(rows, -1) / np.linalg.norm(w.reshape(rows, -1), axis=1, keepdims=True)
  return (c * w2 + math.sqrt(1 - c * c) * u).reshape(g.shape)


# Torch layout (channels first) -> Flax layout, and the leaf's name there.
LEAVES = {
  "conv": (
    (6, 3, 3, 3),
    lambda x: x.transpose(2, 3, 1, 0),
    "kernel",
  ),  # [out,in,kh,kw] -> [kh,kw,in,out]
  "dense": ((5, 7), lambda x: x.T, "kernel"),  # [out, in] -> [in, out]
  "embed": ((9, 4), lambda x: x, "embedding"),  # [num, dim] in both
  "bias": ((5,), lambda x: x, "bias"),
}


@pytest.mark.parametrize("nesterov", [False, True])
def test_adamp_equals_the_reference_step_in_flax_layouts(nesterov, x64):
  rng = np.random.default_rng(0)
  hp = dict(lr=0.01, b1=0.9, b2=0.999, eps=1e-8, wd=0.05, delta=0.1, wd_ratio=0.1)
  torch_params = {k: rng.normal(size=s) for k, (s, _, _) in LEAVES.items()}
  flax = lambda tree: {k: {LEAVES[k][2]: LEAVES[k][1](v)} for k, v in tree.items()}  # noqa: E731
  params = flax(torch_params)
  tx = optim.adamp(
    hp["lr"], hp["b1"], hp["b2"], hp["eps"], hp["wd"], hp["delta"], hp["wd_ratio"], nesterov
  )
  opt = tx.init(params)
  states = {k: {"step": 0, "exp_avg": 0 * v, "exp_avg_sq": 0 * v} for k, v in torch_params.items()}
  branches = {k: set() for k in LEAVES}
  for step in range(12):
    grads = {}
    for k, p in torch_params.items():
      g = rng.normal(size=p.shape)
      # In turn: a gradient orthogonal to each channel (the channel test holds), one
      # orthogonal to the whole weight (only the layer test can hold), one near the
      # channel test's threshold, a random one.
      if p.ndim > 1 and step % 4 == 0:
        g = _orthogonal(g, p, p.shape[0])
      elif p.ndim > 1 and step % 4 == 1:
        g = _orthogonal(g, p, 1)
      elif p.ndim > 1 and step % 4 == 2:
        # |cos| per channel between delta / sqrt(channel size) and delta / sqrt(channels):
        # which side of the test it falls on depends on the threshold's size.
        rows, cols = p.shape[0], p.size // p.shape[0]
        g = _at_cosine(g, p, rows, 0.05 * (1 / math.sqrt(rows) + 1 / math.sqrt(cols)))
      grads[k] = g
    for k in torch_params:
      torch_params[k], branch = reference_adamp_step(
        torch_params[k], grads[k], states[k], nesterov=nesterov, **hp
      )
      branches[k].add(branch)
    updates, opt = jax.jit(tx.update)(flax(grads), opt, params)
    params = optax.apply_updates(params, updates)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12),
      params,
      flax(torch_params),
    )
  # Each weight of 2 or more dimensions took all three branches; the bias Adam's step.
  assert all(branches[k] == {"channel", "layer", "adam"} for k in ("conv", "dense", "embed"))
  assert branches["bias"] == {"adam"}


def test_adamp_channel_axes_decide_the_projection(x64):
  """Read in the wrong layout, a kernel projects by the wrong channels: the axes act."""
  rng = np.random.default_rng(1)
  w = rng.normal(size=(4, 6))  # Flax [in, out]
  g = _orthogonal(rng.normal(size=(6, 4)), w.T, 6).T  # orthogonal per output channel
  params, grads = {"kernel": jnp.asarray(w)}, {"kernel": jnp.asarray(g)}
  out = {}
  for axes in ({"kernel": -1}, {"kernel": 0}):
    tx = optim.adamp(0.1, channel_axes=axes)
    out[axes["kernel"]] = tx.update(grads, tx.init(params), params)[0]["kernel"]
  # Projected per output channel: no step along any output channel's weight.
  np.testing.assert_allclose(np.sum(np.asarray(out[-1]) * w, 0), 0, atol=1e-7)  # eps in the norm
  assert np.max(np.abs(np.sum(np.asarray(out[0]) * w, 0))) > 1e-3


def test_flax_channel_axes_of_an_nnx_state():
  """Kernels (Linear, Conv) by their last axis, embeddings and the rest by their first,
  through ``nnx.split``'s ``Param(value=...)`` wrappers; AdamP steps on the state."""

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(10, 4, rngs=rngs)
      self.conv = nnx.Conv(4, 6, (3, 3), rngs=rngs)
      self.dense = nnx.Linear(6, 5, rngs=rngs)

  _, state = nnx.split(Model(nnx.Rngs(0)))
  axes = {
    "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): a
    for path, a in jax.tree_util.tree_leaves_with_path(optim.flax_channel_axes(state))
  }
  assert axes == {
    "conv/bias/value": 0,
    "conv/kernel/value": -1,
    "dense/bias/value": 0,
    "dense/kernel/value": -1,
    "embed/embedding/value": 0,
  }
  tx = optim.adamp(1e-2, weight_decay=0.1)
  grads = jax.tree.map(jnp.ones_like, state)
  updates, _ = jax.jit(tx.update)(grads, tx.init(state), state)
  assert jax.tree.structure(updates) == jax.tree.structure(state)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


def test_adamp_needs_params():
  tx = optim.adamp(1e-3)
  params = {"w": jnp.ones((2, 2))}
  with pytest.raises(ValueError, match="needs the parameters"):
    tx.update(params, tx.init(params))


@pytest.mark.parametrize(
  "make",
  [lambda lr: optax.adamw(lr, weight_decay=0.1), lambda lr: optim.adamp(lr, weight_decay=0.1)],
)
def test_at_rate_is_the_learning_rate_times_the_factor(make, x64):
  rng = np.random.default_rng(2)
  params = {"kernel": jnp.asarray(rng.normal(size=(3, 4))), "bias": jnp.asarray(rng.normal(size=4))}
  factor = 0.3
  scaled, plain = optim.at_rate(make(1e-2), jnp.asarray(factor)), make(1e-2 * factor)
  a, b = params, params
  sa, sb = scaled.init(a), plain.init(b)
  for _ in range(4):
    g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), params)
    ua, sa = scaled.update(g, sa, a)
    ub, sb = plain.update(g, sb, b)
    a, b = optax.apply_updates(a, ua), optax.apply_updates(b, ub)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-12), a, b)
  # And it moves the result: the factor is not ignored.
  assert not np.allclose(
    a["kernel"],
    optax.apply_updates(params, make(1e-2).update(g, make(1e-2).init(params), params)[0])["kernel"],
  )


def test_cosine_annealing_is_pytorchs_recursive_schedule(x64):
  """Against ``CosineAnnealingLR.get_lr``'s recursion, stepped once a round (eta_min = 0)."""
  rounds, base = 30, 2e-4
  lrs = [base]
  for t in range(1, rounds):
    lrs.append(
      lrs[-1] * (1 + math.cos(math.pi * t / rounds)) / (1 + math.cos(math.pi * (t - 1) / rounds))
    )
  got = [float(base * optim.cosine_annealing(t, rounds)) for t in range(rounds)]
  np.testing.assert_allclose(got, lrs, rtol=1e-6)
  assert got[0] == base and got[-1] < 0.01 * base
  with pytest.raises(ValueError, match="rounds >= 1"):
    optim.cosine_annealing(0, 0)
