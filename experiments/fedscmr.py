r"""FedSCMR and its baselines on the embedded world's labelled cross-modal retrieval split.

  python -m experiments.main --config=experiments/fedscmr.py

builds three clients A, B, C, each holding image-text feature pairs of its own
subset of the 10 classes (7, 6 and 5 classes; 360, 300 and 240 training pairs,
60 validation pairs and 150 own-class test pairs each), plus one shared test
set of 300 pairs over all 10 classes, and trains DSCMR per client, FedAvg and
FedProx of the whole model, FedAvg and FedProx of the common layer only,
FedCMR (its authors' code's rule), FedSCMR and the three ablations of FedSCMR
side by side from the same initial models for 20 rounds. It prints rankings
on both test protocols (with the mAP of a random ranking) and tables like the
paper's Tables 1-4::

  | Method                  | mean mAP@N | mean NDCG@N | mAP - DSCMR (paired) |
  | FedAvg                  |     0.xxxx |      0.xxxx |              +0.xxxx |
  ...
  | random ranking (chance) |     0.xxxx |      0.xxxx |                      |
  | Metric | Task    | Method | N=10 A | N=10 B | N=10 C | N=20 A | ... | N=50 C |
  | mAP    | Img2Txt | DSCMR  | 0.xxxx | ...

(mAP@N and NDCG@N for N = 10, 20, 30, 50, img2txt / txt2img / average, per
client). The workdir (default ``runs/fedscmr``) gets config.json,
metrics.jsonl, TensorBoard events, report.md, global.png and metrics.png (test
mAP per round on the shared and the own-class test), lambda.png (aggregation
weights per round), results.json and checkpoints; rerunning the command
resumes. Three seeds and their mean ± std::

  for s in 0 1 2; do
    python -m experiments.main --config=experiments/fedscmr.py --config.seed=$s \
      --workdir=runs/fedscmr_s$s
  done
  python -m experiments.summarize runs/fedscmr_s0 runs/fedscmr_s1 runs/fedscmr_s2

Real precomputed features: ``--config.features.path=feats.npz`` with arrays
``image [n, d_img]``, ``text [n, d_txt]`` and integer ``labels [n]``.

Variant ``:smoke`` is tiny (used by the tests).

Variant ``:paper`` is the paper's Wikipedia setup (Sec. 5): three clients on the
Wikipedia dataset's 2,866 image-text pairs of 10 classes, as 4,096-d VGG-19 fc7
image features and 1,024-d sentence-BERT text features, read from
:data:`PAPER_FEATURES` (``image [n, 4096]``, ``text [n, 1024]``, ``labels [n]``;
docs/guides/paper_scale.md); without that file the run stops at validation
in one line naming it (exit 2). alpha = beta = 0.1 and gamma = 30 (its best,
Figs. 4-6), mAP@N and NDCG@N for N = 10, 20, 30, 50. The paper does not state
the clients' class subsets and sizes, the rounds, epochs, batch size, learning
rate or the BaseNet widths: those keep the defaults above.
"""

import ml_collections

from experiments.faults import faults_config

#: The ``:paper`` variant's features (relative to the working directory).
PAPER_FEATURES = "data/wikipedia_vgg19_sbert.npz"


def _client(name, classes, train_size):
  return {"name": name, "classes": classes, "train_size": train_size}


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.seed = 0
  # How the engine batches a group's clients: auto (vmap on accelerators and
  # meshes, a compiled loop on one CPU device), vmap, scan or map:<k>.
  config.client_map = "auto"
  # Devices of each process the clients are spread over (padded to a multiple; in a job
  # of several processes, over that many devices of every process); on a CPU, XLA exposes one device unless jax_num_cpu_devices is set before the first
  # computation (experiments.main --cpu_devices).
  config.devices = 1
  config.rounds = 20
  config.local_epochs = 2
  config.batch_size = 32
  config.learning_rate = 1e-3  # Adam
  config.test_size = 150  # own-class test pairs per client
  config.val_size = 60  # validation pairs per client: v^k of eq. (12)
  config.global_test_size = 300  # the shared test set, 30 pairs of each class
  config.checkpoint_every = 1
  config.clients = [_client("A", 7, 360), _client("B", 6, 300), _client("C", 5, 240)]
  config.features = ml_collections.ConfigDict(
    {
      "path": "",  # An .npz of real features (image, text, labels); empty: the embedded world.
      # Frozen World-CLIP encoders' pooled features, the analogue of the paper's VGG-19 /
      # sentence-BERT features: cnn_m is the shipped encoder that knows the primary shape,
      # this benchmark's label (linear probe 74.6% on 10 classes). image_encoder="" gives
      # the earlier stand-in, seeded projections of per-shape pixel areas; a text_encoder
      # without "world-clip/" is a frozen *random* tower (or "bow").
      "image_encoder": "world-clip/cnn_m",
      "text_encoder": "world-clip/transformer_t",
      "image_dim": 64,
      "image_noise": 0.5,
    }
  )
  config.model = ml_collections.ConfigDict({"hidden": 256, "dim": 64})  # BaseNet width, d
  # The paper's best alpha = beta = 0.1 (Figs. 4-5) and gamma = 30 (Fig. 6).
  config.fedscmr = ml_collections.ConfigDict(
    {"alpha": 0.1, "beta": 0.1, "gamma": 30.0, "map_n": 50}
  )
  config.dscmr = ml_collections.ConfigDict({"alpha": 0.1, "beta": 0.1})  # Baselines' loss.
  config.fedprox_mu = 0.01
  # FedCMR's code: 80% of the local pairs before aggregation, 20% after; then
  # W^k <- W - 0.5 (W^k - W^k_start).
  config.fedcmr = ml_collections.ConfigDict({"split": 0.8, "correction": 0.5})
  config.ns = (10, 20, 30, 50)
  config.methods = (
    "dscmr",
    "fedavg",
    "fedprox",
    "fedavg_common",
    "fedprox_common",
    "fedcmr",
    "fedscmr",
    "fedscmr_no_lcs",
    "fedscmr_no_lccs",
    "fedscmr_no_phi",
  )

  config.faults = faults_config()  # experiments/faults.py: all off

  if arg == "smoke":
    config.rounds = 2
    config.local_epochs = 1
    config.batch_size = 8
    config.test_size = 12
    config.val_size = 6
    config.global_test_size = 20
    config.clients = [_client("A", 4, 16), _client("B", 3, 12), _client("C", 2, 8)]
    config.features.image_encoder = ""  # the stand-in: nothing to load
    config.features.image_dim = 8
    config.features.text_encoder = "bow"  # numpy: no encoder to compile
    config.model = ml_collections.ConfigDict({"hidden": 16, "dim": 8})
    config.fedscmr.map_n = 5
    config.ns = (5, 10)
    config.methods = ("dscmr", "fedscmr")
  elif arg == "paper":
    config.features.path = PAPER_FEATURES
    config.fedscmr.alpha = config.fedscmr.beta = 0.1
    config.fedscmr.gamma = 30.0
    config.ns = (10, 20, 30, 50)
  elif arg is not None:
    raise ValueError(f"unknown variant {arg!r}; expected smoke or paper.")
  return config
