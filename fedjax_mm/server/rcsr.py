r"""RCSR's server side (eqs. 6-11, 13 and Algorithm 1 lines 10-17), as pure functions.

Paper: ``../shared/papers/rcsr.txt``. Every function takes ``[K]``-stacked client values
and a ``where`` ``bool [K]`` mask of the clients sampled this round (unsampled or
padding clients get weight 0 and enter no sum).

**Statistics (eq. 6).** Client k reports ``s_k = (p_I^k, p_T^k, gamma_k, m_k, l_k)``; a
missing modality's prototype slot holds the global EMA prototype it received
("filled"). ``gamma_k`` in R^4 is not defined by the paper; ours
(:func:`geometry`) is (1) the norm of the client's update Delta_k, (2) the cosine of
Delta_k to the previous global update, (3) prototype drift, the mean over available
modalities of ``1 - cos(p_v^k, pbar_v)``, (4) alignment agreement
``cos(d_k, dbar)`` with ``d_k = normalize(p_I^k - p_T^k)``, ``dbar = normalize(pbar_I -
pbar_T)``.

**Router (eq. 7).** The paper's router tokenises each s_k with a 2-layer MLP, runs L
self-attention layers "with modality-masked attention (padding slots for filled
prototypes receive zero attention)" and outputs softmax weights. One token per client
cannot have a masked *slot*, so our router makes **one token per (client, modality)
slot**: ``[p_v^k, onehot(v), gamma_k, m_k, l_k]`` -> MLP (GELU) -> width. The attention
key mask is ``m_k[v] & where_k``: filled slots and unsampled clients receive zero
attention. A client's score is a linear read-out of the mean of its real slots' outputs;
``w^R`` is the softmax of the scores over sampled clients. Consequently a filled
prototype never changes ``w^R`` (tested); it still enters L_ac through ``d_k``, as eq. 9
says. Layers are pre-LayerNorm Transformer blocks (attention + 2x-wide GELU MLP);
Table 3: 2 layers, 4 heads, width 128 (scaled by config).

**Router losses (eqs. 8-9).** ``L_R = L_pc + beta_5 L_ac`` with stop-gradient on the EMA
prototypes and dbar. L_pc's weighted prototype sum per modality runs over the clients
whose slot is real (filled entries skipped, Sec. 6); ``H(w) = -sum w log w``.

**Fairness (eqs. 10-11, Sec. 4.4, 5.1).** ``l~_k = l_k / lbar_g`` with ``lbar_g`` the
EMA (momentum beta = 0.9) of the mean loss of group g (paired / image-only /
text-only) over the sampled clients; Sec. 6 mentions z-scores, we follow 4.4 and 5.1.
Per round the group means are folded into lbar *first* (a group's first observation
initialises it), then the losses are normalised. ``q`` spans all N clients, starts at
1/N and persists; only sampled clients (which report a loss) get the factor
``exp(eta_q l~_k)``, then q is renormalised over all N. ``tau_fair`` belongs to the
objective (10), not to this update, so it appears nowhere here. Fused weights (11):
``w_k = w^R_k q_k / sum_{j in S_t} w^R_j q_j``.

**Warm-up.** For t <= T_w, ``w^R_k = |D_k| / sum_{j in S_t} |D_j|`` (the sum over the
sampled clients: the constant cancels in (11) anyway).

**EMA prototypes (line 17).** ``pbar_v <- mu pbar_v + (1 - mu) sum_k w_k p_v^k`` over the
sampled clients, filled slots included (they hold ``pbar_v`` itself, so a
single-modality client's share keeps the old prototype), as Algorithm 1 writes it.

**RCSR-p strength (eq. 13).** ``s_k = min(lambda_p (1 + max(0, 0.5 - w^R_k)), 0.5)``.

**Table 1 baselines' server steps.** MFCPL (:func:`class_prototype_average`): FedProto's
class-count weighted mean of the sampled clients' per-class prototypes of each
modality, re-normalised; a (modality, class) no sampled client reported keeps its
previous global prototype. FedMEKT (:func:`embedding_average`): the plain mean (the
authors' ``1 / k``) of the proxy-set embeddings of the sampled clients that hold the
modality; a modality no sampled client holds keeps its previous average. CreamFL
(:func:`representation_ema`): CreamFL's GCA (:func:`fedjax_mm.server.gca.gca`, eqs.
4-6) of the sampled clients' public-set representations of each modality, scored
against the global representations of the other modality, over the clients that hold
the modality (a single-modality client sends nothing for the other one, and is absent
from that modality's GCA as an unsampled client is); the global representations move
to it by an EMA, ``g_v <- decay g_v + (1 - decay) a_v``, and a modality no sampled
client holds keeps ``g_v``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_mm.losses.rcsr import cosine, normalize
from fedjax_mm.server.gca import gca

Array = jax.Array
PyTree = Any

__all__ = [
  "FairState",
  "alignment_consistency",
  "class_prototype_average",
  "data_weights",
  "embedding_average",
  "ema_prototypes",
  "fair_init",
  "fair_update",
  "fused_weights",
  "representation_ema",
  "geometry",
  "init_router",
  "personal_strength",
  "prototype_consistency",
  "router_loss",
  "router_scores",
  "router_tokens",
  "router_weights",
]

GROUPS = 3  # paired, image-only, text-only


def _masked_softmax(logits: Array, where: Array) -> Array:
  logits = jnp.where(where, logits, -jnp.inf)
  w = jax.nn.softmax(logits)
  return jnp.where(where, w, 0.0)


def entropy(w: Array) -> Array:
  """``H(w) = -sum w log w`` (0 log 0 = 0)."""
  return -jnp.sum(jnp.where(w > 0, w * jnp.log(jnp.where(w > 0, w, 1.0)), 0.0))


def geometry(
  delta: Array, prev_update: Array, prototypes: Array, global_prototypes: Array, modality: Array
) -> Array:
  """``gamma_k`` in R^4 of one client (the module docstring defines the entries).

  Args:
    delta: ``[P]`` the client's flattened update Delta_k.
    prev_update: ``[P]`` the previous round's flattened global update (0 at first).
    prototypes: ``[2, d]`` reported prototypes (filled slot included).
    global_prototypes: ``[2, d]`` the EMA prototypes received this round.
    modality: ``bool [2]`` the client's modality mask.
  """
  norm = jnp.sqrt(jnp.sum(delta * delta))
  cos_prev = cosine(delta, prev_update)
  avail = modality.astype(delta.dtype)
  drift = jnp.sum(avail * (1.0 - cosine(prototypes, global_prototypes))) / jnp.maximum(
    avail.sum(), 1.0
  )
  d_k = normalize(prototypes[0] - prototypes[1])
  d_bar = normalize(global_prototypes[0] - global_prototypes[1])
  return jnp.stack([norm, cos_prev, drift, cosine(d_k, d_bar)])


# ---------------------------------------------------------------------------
# Router (eq. 7): plain pytrees of arrays, so it stacks, checkpoints and jits as is.


def init_router(key: Array, token_dim: int, *, width: int = 128, layers: int = 2) -> dict:
  """Router parameters: tokeniser MLP, ``layers`` pre-LN attention blocks, read-out."""
  keys = iter(jax.random.split(key, 4 + 4 * layers))

  def dense(fan_in, fan_out):
    return {
      "kernel": jax.random.normal(next(keys), (fan_in, fan_out)) / jnp.sqrt(fan_in),
      "bias": jnp.zeros((fan_out,)),
    }

  def ln():
    return {"scale": jnp.ones((width,)), "bias": jnp.zeros((width,))}

  blocks = [
    {
      "ln1": ln(),
      "qkv": dense(width, 3 * width),
      "out": dense(width, width),
      "ln2": ln(),
      "mlp1": dense(width, 2 * width),
      "mlp2": dense(2 * width, width),
    }
    for _ in range(layers)
  ]
  return {
    "tok1": dense(token_dim, width),
    "tok2": dense(width, width),
    "blocks": blocks,
    "ln": ln(),
    "head": dense(width, 1),
  }


def _apply_dense(p, x):
  return x @ p["kernel"] + p["bias"]


def _apply_ln(p, x):
  mean = x.mean(-1, keepdims=True)
  var = x.var(-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + 1e-6) * p["scale"] + p["bias"]


def router_tokens(
  prototypes: Array, gamma: Array, modality: Array, loss: Array
) -> tuple[Array, Array]:
  """Slot tokens ``[K, 2, token_dim]`` and their ``bool [K, 2]`` realness (= ``m_k[v]``).

  Args:
    prototypes: ``[K, 2, d]`` reported prototypes (filled slots included).
    gamma: ``[K, 4]`` geometry vectors.
    modality: ``bool [K, 2]`` modality masks.
    loss: ``[K]`` reported losses.
  """
  k = prototypes.shape[0]
  onehot = jnp.broadcast_to(jnp.eye(2, dtype=prototypes.dtype), (k, 2, 2))
  shared = jnp.concatenate([gamma, modality.astype(gamma.dtype), loss[:, None]], axis=-1)
  shared = jnp.broadcast_to(shared[:, None, :], (k, 2, shared.shape[-1]))
  return jnp.concatenate([prototypes, onehot, shared], axis=-1), modality


def router_scores(params: dict, tokens: Array, real: Array, where: Array, *, heads: int = 4):
  """Per-client scores ``[K]`` from slot tokens (eq. 7 before the softmax).

  Args:
    params: :func:`init_router`'s pytree.
    tokens: ``[K, 2, token_dim]``.
    real: ``bool [K, 2]`` real (not filled) slots.
    where: ``bool [K]`` sampled clients.
    heads: attention heads (Table 3: 4).
  """
  k = tokens.shape[0]
  x = _apply_dense(params["tok2"], jax.nn.gelu(_apply_dense(params["tok1"], tokens)))
  width = x.shape[-1]
  x = x.reshape(2 * k, width)
  keep = (real & where[:, None]).reshape(2 * k)
  hd = width // heads
  for blk in params["blocks"]:
    h = _apply_ln(blk["ln1"], x)
    q, kk, v = jnp.split(_apply_dense(blk["qkv"], h), 3, axis=-1)
    q, kk, v = (a.reshape(2 * k, heads, hd) for a in (q, kk, v))
    logits = jnp.einsum("qhd,khd->hqk", q, kk) / jnp.sqrt(hd)
    logits = jnp.where(keep[None, None, :], logits, -jnp.inf)
    attn = jax.nn.softmax(logits, axis=-1)
    attn = jnp.where(keep[None, None, :], attn, 0.0)
    o = jnp.einsum("hqk,khd->qhd", attn, v).reshape(2 * k, width)
    x = x + _apply_dense(blk["out"], o)
    h = _apply_ln(blk["ln2"], x)
    x = x + _apply_dense(blk["mlp2"], jax.nn.gelu(_apply_dense(blk["mlp1"], h)))
  x = _apply_ln(params["ln"], x).reshape(k, 2, width)
  r = real.astype(x.dtype)
  pooled = (x * r[..., None]).sum(1) / jnp.maximum(r.sum(1), 1.0)[:, None]
  return _apply_dense(params["head"], pooled)[:, 0]


def router_weights(params, prototypes, gamma, modality, loss, where, *, heads: int = 4):
  """Eq. (7): ``w^R`` ``[K]``, softmax over the sampled clients (0 elsewhere)."""
  tokens, real = router_tokens(prototypes, gamma, modality, loss)
  return _masked_softmax(router_scores(params, tokens, real, where, heads=heads), where)


def prototype_consistency(
  w: Array,
  prototypes: Array,
  modality: Array,
  global_prototypes: Array,
  *,
  betas: tuple[float, float] = (1.0, 1.0),
  beta_4: float = 0.2,
) -> Array:
  r"""Eq. (8): ``sum_v beta_v (1 - cos(sum_k w_k p_v^k, sg[pbar_v])) - beta_4 H(w)``.

  The sum over k for modality v skips filled entries (``modality[k, v]`` False).
  """
  target = jax.lax.stop_gradient(global_prototypes)
  real = modality.astype(prototypes.dtype)
  mixed = jnp.einsum("k,kv,kvd->vd", w, real, prototypes)
  terms = 1.0 - cosine(mixed, target)
  return jnp.asarray(betas[0]) * terms[0] + betas[1] * terms[1] - beta_4 * entropy(w)


def alignment_consistency(
  w: Array, prototypes: Array, global_prototypes: Array, where: Array
) -> Array:
  r"""Eq. (9): ``1 - cos(dhat, sg[dbar]) + sum_k w_k (1 - cos(d_k, dhat))``."""
  d = normalize(prototypes[:, 0] - prototypes[:, 1])
  d_hat = normalize(jnp.einsum("k,kd->d", w, d))
  gp = jax.lax.stop_gradient(global_prototypes)
  d_bar = normalize(gp[0] - gp[1])
  spread = jnp.where(where, w * (1.0 - cosine(d, d_hat[None, :])), 0.0).sum()
  return 1.0 - cosine(d_hat, d_bar) + spread


def router_loss(
  params,
  prototypes,
  gamma,
  modality,
  loss,
  where,
  global_prototypes,
  *,
  heads: int = 4,
  betas: tuple[float, float] = (1.0, 1.0),
  beta_4: float = 0.2,
  beta_5: float = 0.3,
):
  """``L_R = L_pc + beta_5 L_ac`` (Sec. 4.3) and ``w^R``, for ``jax.value_and_grad(has_aux)``."""
  w = router_weights(params, prototypes, gamma, modality, loss, where, heads=heads)
  pc = prototype_consistency(w, prototypes, modality, global_prototypes, betas=betas, beta_4=beta_4)
  ac = alignment_consistency(w, prototypes, global_prototypes, where)
  return pc + beta_5 * ac, w


# ---------------------------------------------------------------------------
# Fairness (eqs. 10-11) and the aggregation weights.


class FairState(NamedTuple):
  """``q`` over all N clients and the groups' running mean losses ``lbar`` [3]."""

  q: Array
  lbar: Array
  seen: Array  # bool [3]: the group has been observed (its lbar is initialised)


def fair_init(n: int) -> FairState:
  # float32 (not weakly typed) as fair_update returns it: a weak ``q`` would make the
  # second round's state a new type and the jitted round compile again.
  return FairState(
    q=jnp.full((n,), 1.0 / n, jnp.float32),
    lbar=jnp.ones((GROUPS,)),
    seen=jnp.zeros((GROUPS,), bool),
  )


def client_group(modality: Array) -> Array:
  """0 paired, 1 image-only, 2 text-only, from ``bool [..., 2]`` masks."""
  return jnp.where(modality[..., 0] & modality[..., 1], 0, jnp.where(modality[..., 0], 1, 2))


def fair_update(
  state: FairState,
  loss: Array,
  group: Array,
  where: Array,
  *,
  eta_q: float = 0.1,
  momentum: float = 0.9,
  centred: bool | Array = False,
) -> tuple[FairState, Array]:
  """One exponentiated-gradient step of ``q`` (Sec. 4.4); returns ``(state, l~)``.

  As the paper writes it, only sampled clients get ``exp(eta_q l~_k)``, and ``l~`` is
  about 1, so a client gains weight each time it is sampled, whatever its loss: over
  a run ``log q`` follows how often a client was drawn. ``centred`` (ours, not the
  paper's) takes ``exp(eta_q (l~_k - mean_S l~))`` instead, the sampled clients' mean
  subtracted: a client gains weight for a loss above its sampled peers', and a round
  whose clients all report the same loss leaves ``q`` as it is.

  Args:
    state: current :class:`FairState` (``q`` ``[N]``).
    loss: ``[N]`` reported losses (ignored where not sampled).
    group: ``int [N]`` modality group (:func:`client_group`).
    where: ``bool [N]`` sampled clients.
    eta_q: step size (Table 3: 0.1).
    momentum: the running mean's momentum beta (Table 3: 0.9).
    centred: the centred step (traced bool or Python bool).
  """
  onehot = jax.nn.one_hot(group, GROUPS, dtype=loss.dtype) * where[:, None]
  count = onehot.sum(0)
  mean = (onehot * loss[:, None]).sum(0) / jnp.maximum(count, 1.0)
  observed = count > 0
  updated = jnp.where(state.seen, momentum * state.lbar + (1 - momentum) * mean, mean)
  lbar = jnp.where(observed, updated, state.lbar)
  seen = state.seen | observed
  norm_loss = jnp.where(where, loss / jnp.maximum(lbar[group], 1e-12), 0.0)
  mean_sampled = norm_loss.sum() / jnp.maximum(where.sum(), 1)
  step = jnp.where(centred, jnp.where(where, norm_loss - mean_sampled, 0.0), norm_loss)
  q = state.q * jnp.exp(eta_q * step)
  q = q / q.sum()
  return FairState(q=q, lbar=lbar, seen=seen), norm_loss


def data_weights(sizes: Array, where: Array) -> Array:
  """Warm-up ``w^R``: ``|D_k| / sum_{j in S_t} |D_j|`` (Algorithm 1, line 12)."""
  s = jnp.where(where, sizes.astype(jnp.float32), 0.0)
  return s / jnp.maximum(s.sum(), 1e-12)


def fused_weights(w_router: Array, q: Array, where: Array) -> Array:
  """Eq. (11): ``w_k = w^R_k q_k / sum_{j in S_t} w^R_j q_j``."""
  wq = jnp.where(where, w_router * q, 0.0)
  return wq / jnp.maximum(wq.sum(), 1e-30)


def ema_prototypes(
  global_prototypes: Array, prototypes: Array, w: Array, *, mu: float = 0.9
) -> Array:
  """Algorithm 1 line 17: ``pbar_v <- mu pbar_v + (1 - mu) sum_k w_k p_v^k`` (``[2, d]``)."""
  return mu * global_prototypes + (1 - mu) * jnp.einsum("k,kvd->vd", w, prototypes)


def personal_strength(w_router: Array, *, lambda_p: float) -> Array:
  """Eq. (13): ``s_k = min(lambda_p (1 + max(0, 0.5 - w^R_k)), 0.5)``."""
  return jnp.minimum(lambda_p * (1.0 + jnp.maximum(0.0, 0.5 - w_router)), 0.5)


def class_prototype_average(
  prototypes: Array, counts: Array, previous: Array, where: Array
) -> Array:
  r"""MFCPL's server: ``P_{v,c} = normalize(sum_k n^k_{v,c} P^k_{v,c} / sum_k n^k_{v,c})``.

  Args:
    prototypes: ``[K, 2, C, d]`` the clients' per-class prototypes (normalised means).
    counts: ``[K, 2, C]`` their sample counts (0 for a modality the client lacks).
    previous: ``[2, C, d]`` the global prototypes before the round.
    where: ``bool [K]`` sampled clients.

  Returns:
    ``[2, C, d]``; an entry with no count this round keeps ``previous``.
  """
  n = counts * where[:, None, None].astype(counts.dtype)
  total = n.sum(0)  # [2, C]
  mean = jnp.einsum("kvc,kvcd->vcd", n, prototypes) / jnp.maximum(total, 1.0)[..., None]
  return jnp.where((total > 0)[..., None], normalize(mean), previous)


def embedding_average(embeddings: Array, modality: Array, previous: Array, where: Array) -> Array:
  r"""FedMEKT's server: the mean proxy-set embedding over the clients holding each modality.

  Args:
    embeddings: ``[K, 2, P, d]`` each client's image / text embeddings of the proxy set.
    modality: ``bool [K, 2]`` the clients' modality masks.
    previous: ``[2, P, d]`` the average sent last round.
    where: ``bool [K]`` sampled clients.

  Returns:
    ``[2, P, d]``; a modality no sampled client holds keeps ``previous``.
  """
  held = (modality & where[:, None]).astype(embeddings.dtype)  # [K, 2]
  total = held.sum(0)  # [2]
  mean = jnp.einsum("kv,kvpd->vpd", held, embeddings) / jnp.maximum(total, 1.0)[:, None, None]
  return jnp.where((total > 0)[:, None, None], mean, previous)


def representation_ema(
  local: Array,
  modality: Array,
  previous: Array,
  where: Array,
  *,
  decay: float | Array = 0.9,
  temperature: float | Array = 1.0,
  chunk_size: int | None = None,
) -> tuple[Array, Array]:
  r"""CreamFL's server on RCSR's clients: GCA per modality, then an EMA of the global reps.

  For modality ``v`` (``o`` the other), ``a_v = GCA(local[:, v], g_o)`` over the clients
  with ``where_k & modality[k, v]`` (eqs. 4-6 of CreamFL; the others weigh 0), then
  ``g_v <- decay g_v + (1 - decay) a_v``: one step of size ``1 - decay`` on
  ``1/2 ||g_v - a_v||^2``, eq. (7)'s distillation with the representations themselves as
  the distilled parameters. Both modalities are scored against the global
  representations of the start of the round.

  Args:
    local: ``[K, 2, P, d]`` each client's image / text representations of the public
      set (whatever stands in a modality the client does not hold is never read).
    modality: ``bool [K, 2]`` the clients' modality masks.
    previous: ``[2, P, d]`` the global representations ``g`` sent this round.
    where: ``bool [K]`` sampled clients.
    decay: the EMA's decay (RCSR's Sec. 5.1: "EMA decay 0.9").
    temperature: GCA's eq. (4) temperature (1: the equation as printed).
    chunk_size: GCA's anchors per chunk (``None``: automatic).

  Returns:
    ``(g [2, P, d], gca_weights [2, K, P])``; a modality no sampled client holds keeps
    ``previous`` (and all its weights are 0).
  """
  present = modality & where[:, None]  # [K, 2]
  new, weights = [], []
  for v in range(2):
    # A client absent from modality v: its (unsent) rows are zeroed, so nothing it did not
    # send reaches the aggregate even through a NaN.
    rows = jnp.where(present[:, v, None, None], local[:, v], 0.0)
    agg, w = gca(
      rows, previous[1 - v], present[:, v], temperature=temperature, chunk_size=chunk_size
    )
    moved = decay * previous[v] + (1.0 - decay) * agg
    new.append(jnp.where(present[:, v].any(), moved, previous[v]))
    weights.append(w)
  return jnp.stack(new), jnp.stack(weights)
