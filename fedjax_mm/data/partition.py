"""Splitting a dataset across clients, and stacking clients for ``vmap``.

Datasets are plain dicts of numpy arrays sharing a leading sample axis (what
`fedjax_mm.data.world.generate` and `fedjax_mm.data.digits.load_digits`
return). This module

* partitions sample indices across clients: `iid_partition` and
  `dirichlet_partition` (label skew controlled by ``alpha``), returning one
  sorted ``int64`` index array per client, disjoint across clients;
* selects samples (`take`, `split_clients`) and modalities (`drop_modality`,
  `modalities`) to make e.g. image-only or text-only clients for the
  missing-modality settings;
* stacks per-client datasets of different sizes into ``[K, n_max, ...]``
  arrays with a sample mask (`stack_clients`) and pads the client axis to a
  multiple of the device count with a client mask (`pad_clients`), the layout
  the vmapped, sharded client engine consumes (fedjax's ``ClientBlock``).

Everything is deterministic from an integer seed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

# Keys that carry each modality (keys not present are ignored).
IMAGE_KEYS: tuple[str, ...] = ("image", "mask", "background", "instance")
TEXT_KEYS: tuple[str, ...] = ("caption", "caption_label")
MODALITY_KEYS: Mapping[str, tuple[str, ...]] = {"image": IMAGE_KEYS, "text": TEXT_KEYS}


def _client_sizes(
  num: int, num_clients: int, samples_per_client: int | Sequence[int] | None
) -> np.ndarray | None:
  """Validated ``int [K]`` requested sizes, or None to split all samples."""
  if num_clients < 1:
    raise ValueError(f"num_clients must be >= 1, got {num_clients}.")
  if samples_per_client is None:
    return None
  sizes = np.broadcast_to(np.asarray(samples_per_client, dtype=np.int64), (num_clients,))
  if np.any(sizes < 0):
    raise ValueError(f"samples_per_client must be >= 0, got {samples_per_client}.")
  if sizes.sum() > num:
    raise ValueError(
      f"Asked for {int(sizes.sum())} samples in total ({num_clients} clients) but only "
      f"{num} are available."
    )
  return sizes.copy()


def iid_partition(
  num: int,
  num_clients: int,
  *,
  seed: int,
  samples_per_client: int | Sequence[int] | None = None,
) -> list[np.ndarray]:
  """Splits ``range(num)`` uniformly at random across clients.

  Args:
    num: number of samples.
    num_clients: number of clients ``K``.
    seed: integer seed.
    samples_per_client: size of every client (an int) or of each client (``K``
      ints); their sum must not exceed ``num``. None splits all ``num`` samples
      as evenly as possible (sizes differ by at most one).

  Returns:
    ``K`` sorted, disjoint ``int64`` index arrays.
  """
  sizes = _client_sizes(num, num_clients, samples_per_client)
  perm = np.random.default_rng(seed).permutation(num)
  if sizes is None:
    parts = np.array_split(perm, num_clients)
  else:
    parts = np.split(perm[: sizes.sum()], np.cumsum(sizes)[:-1])
  return [np.sort(p) for p in parts]


def dirichlet_partition(
  labels: np.ndarray,
  num_clients: int,
  *,
  alpha: float,
  seed: int,
  samples_per_client: int | Sequence[int] | None = None,
) -> list[np.ndarray]:
  """Label-skewed (non-IID) split of samples across clients.

  With ``samples_per_client`` given (the papers' small local sets), each
  client ``k`` in turn draws class proportions ``q_k ~ Dirichlet(alpha 1_C)``
  and takes ``Multinomial(n_k, q_k)`` samples of each class, without
  replacement across clients. Classes already used up are dropped and the
  shortfall is redrawn from ``q_k`` over the classes left (or in proportion to
  what is left when ``q_k`` has no mass there), so every client gets exactly
  ``n_k`` samples whenever ``sum(n_k) <= len(labels)``.

  With ``samples_per_client=None`` all samples are split, the standard way
  (Hsu et al., 2019, arXiv:1909.06335): each class ``c`` draws client shares
  ``p_c ~ Dirichlet(alpha 1_K)`` and its samples are cut in those shares, so
  client sizes vary. The draw is repeated (up to 1,000 times) until every
  client holds at least one sample.

  Small ``alpha`` (e.g. 0.1) gives clients dominated by one or two classes;
  large ``alpha`` (e.g. 100) gives near-uniform class mixes.

  Args:
    labels: ``int [n]`` class of each sample (any integer values).
    num_clients: number of clients ``K``.
    alpha: positive Dirichlet concentration.
    seed: integer seed.
    samples_per_client: an int (all clients), ``K`` ints, or None (split all).

  Returns:
    ``K`` sorted, disjoint ``int64`` index arrays into ``labels``.

  Raises:
    ValueError: on ``alpha <= 0``, sizes that do not fit, or (for None) fewer
      samples than clients.
  """
  labels = np.asarray(labels)
  if labels.ndim != 1:
    raise ValueError(f"labels must be [n], got shape {labels.shape}.")
  if not alpha > 0:
    raise ValueError(f"alpha must be > 0, got {alpha}.")
  n = labels.shape[0]
  sizes = _client_sizes(n, num_clients, samples_per_client)
  rng = np.random.default_rng(seed)
  _, cls = np.unique(labels, return_inverse=True)
  num_classes = int(cls.max()) + 1 if n else 0
  # One shuffled pool of indices per class, consumed front to back.
  pools = [rng.permutation(np.nonzero(cls == c)[0]) for c in range(num_classes)]
  counts_avail = np.array([p.size for p in pools], dtype=np.int64)

  if sizes is None:
    if n < num_clients:
      raise ValueError(f"Cannot give each of {num_clients} clients a sample out of {n}.")
    for _ in range(1000):
      shares = rng.dirichlet(np.full(num_clients, alpha), size=num_classes)  # [C, K]
      cuts = [
        (np.cumsum(s)[:-1] * a).astype(np.int64) for s, a in zip(shares, counts_avail, strict=True)
      ]
      per_class = [np.split(p, c) for p, c in zip(pools, cuts, strict=True)]
      parts = [np.concatenate([pc[k] for pc in per_class]) for k in range(num_clients)]
      if min(p.size for p in parts) > 0:
        return [np.sort(p) for p in parts]
    raise ValueError(
      f"Could not give every client a sample in 1000 draws (alpha={alpha}, n={n}, "
      f"num_clients={num_clients}); raise alpha or pass samples_per_client."
    )

  taken = np.zeros(num_classes, dtype=np.int64)
  parts = []
  for k in range(num_clients):
    q = rng.dirichlet(np.full(num_classes, alpha))
    counts = np.zeros(num_classes, dtype=np.int64)
    need = int(sizes[k])
    while need > 0:  # at least one sample is placed per pass
      room = counts_avail - taken - counts
      weight = np.where(room > 0, q, 0.0)
      if not weight.sum() > 0:
        weight = room.astype(np.float64)
      draw = np.minimum(rng.multinomial(need, weight / weight.sum()), room)
      counts += draw
      need -= int(draw.sum())
    parts.append(
      np.sort(
        np.concatenate(
          [pools[c][taken[c] : taken[c] + counts[c]] for c in range(num_classes)]
          + [np.zeros(0, dtype=np.int64)]
        )
      )
    )
    taken += counts
  return parts


def take(data: Mapping[str, np.ndarray], idx: np.ndarray | Sequence[int] | slice) -> dict:
  """Selects samples: ``{key: value[idx]}`` for every key.

  Args:
    data: dict of arrays with a shared leading axis ``n``.
    idx: integer indices, a boolean ``[n]`` mask or a slice.

  Returns:
    A new dict with the same keys.
  """
  return {k: v[idx] for k, v in data.items()}


def split_clients(
  data: Mapping[str, np.ndarray], partition: Sequence[np.ndarray]
) -> list[dict[str, np.ndarray]]:
  """Per-client datasets: ``[take(data, idx) for idx in partition]``."""
  return [take(data, idx) for idx in partition]


def modalities(data: Mapping[str, np.ndarray]) -> tuple[str, ...]:
  """The modalities present in ``data``: a subset of ``("image", "text")``.

  ``image`` is present when the key ``image`` is, ``text`` when ``caption`` is.
  """
  return tuple(m for m, key in (("image", "image"), ("text", "caption")) if key in data)


def drop_modality(data: Mapping[str, np.ndarray], modality: str) -> dict[str, np.ndarray]:
  """Removes one modality, e.g. to make an image-only or text-only client.

  ``"image"`` drops `IMAGE_KEYS` (``image``, ``mask`` and the render layers);
  ``"text"`` drops `TEXT_KEYS` (``caption`` and the caption-derived
  ``caption_label``). Labels shared by both modalities (``label10``,
  ``retrieval_label``, ...) and the latents are kept.

  Args:
    data: dict of arrays.
    modality: ``"image"`` or ``"text"``.

  Returns:
    A new dict without that modality's keys.
  """
  if modality not in MODALITY_KEYS:
    raise ValueError(f"modality must be one of {tuple(MODALITY_KEYS)}, got {modality!r}.")
  drop = MODALITY_KEYS[modality]
  return {k: v for k, v in data.items() if k not in drop}


def stack_clients(
  datasets: Sequence[Mapping[str, np.ndarray]], *, pad_to: int | None = None
) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """Zero-pads clients to a common size and stacks them.

  Args:
    datasets: ``K`` dicts with identical keys; client ``k`` holds ``n_k``
      samples, and each key has the same trailing shape and dtype everywhere.
    pad_to: common size ``N``; defaults to ``max_k n_k`` and must not be
      smaller.

  Returns:
    ``(stacked, mask)``: ``stacked[key]`` is ``[K, N, ...]`` with client ``k``'s
    samples in rows ``[:n_k]`` and zeros after, and ``mask`` is ``bool [K, N]``,
    true on real samples.
  """
  if not datasets:
    raise ValueError("stack_clients needs at least one client.")
  keys = set(datasets[0])
  for k, d in enumerate(datasets):
    if set(d) != keys:
      raise ValueError(
        f"Client {k} has keys {sorted(d)}, client 0 has {sorted(keys)}; all must match."
      )
  sizes = []
  for k, d in enumerate(datasets):
    lengths = {key: np.shape(v)[0] for key, v in d.items()}
    if len(set(lengths.values())) > 1:
      raise ValueError(f"Client {k} has arrays of different lengths: {lengths}.")
    sizes.append(next(iter(lengths.values()), 0))
  n_max = max(sizes)
  n_pad = n_max if pad_to is None else pad_to
  if n_pad < n_max:
    raise ValueError(f"pad_to={pad_to} is smaller than the largest client ({n_max}).")
  stacked = {}
  for key in datasets[0]:
    first = np.asarray(datasets[0][key])
    out = np.zeros((len(datasets), n_pad) + first.shape[1:], dtype=first.dtype)
    for k, d in enumerate(datasets):
      v = np.asarray(d[key])
      if v.shape[1:] != first.shape[1:] or v.dtype != first.dtype:
        raise ValueError(
          f"Key {key!r}: client {k} has {v.dtype}{list(v.shape[1:])} per sample, client 0 "
          f"has {first.dtype}{list(first.shape[1:])}."
        )
      out[k, : v.shape[0]] = v
    stacked[key] = out
  mask = np.arange(n_pad)[None] < np.asarray(sizes)[:, None]
  return stacked, mask


def pad_clients(
  stacked: Mapping[str, np.ndarray], mask: np.ndarray, multiple: int
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
  """Appends all-zero clients so that the client count divides evenly.

  Used to shard ``K`` clients over ``multiple`` devices.

  Args:
    stacked: ``[K, N, ...]`` arrays from `stack_clients`.
    mask: ``bool [K, N]`` sample mask.
    multiple: the client count is rounded up to a multiple of this.

  Returns:
    ``(stacked, mask, client_mask)`` with ``K' = ceil(K / multiple) *
    multiple`` clients: padding clients are all zeros and all-false in
    ``mask``; ``client_mask`` is ``bool [K']``, true on the ``K`` real clients.
  """
  if multiple < 1:
    raise ValueError(f"multiple must be >= 1, got {multiple}.")
  num_clients = mask.shape[0]
  extra = -num_clients % multiple
  pad = lambda x: np.concatenate([x, np.zeros((extra,) + x.shape[1:], dtype=x.dtype)])
  client_mask = np.arange(num_clients + extra) < num_clients
  return {k: pad(np.asarray(v)) for k, v in stacked.items()}, pad(np.asarray(mask)), client_mask
