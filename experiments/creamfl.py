r"""CreamFL and CreamFL + Muscle on the embedded multimodal world.

  python -m experiments.main --config=experiments/creamfl.py

trains a server (vit_s + transformer_s) from 9 clients — 3 image-only clients
(vit_t, 10-class image classification), 3 text-only clients (gru, caption
colour classification) and 3 multimodal clients (vit_t + transformer_t,
image-text retrieval) with Dirichlet(0.1) private splits, 5 of 9 taking part
per round, over a public set of 384 pairs — with every method of CreamFL's Tables 1 and 3 and FedMuscle's
Table 3, side by side from the same initial models, and ends with a table::

  | method               | i2t_R@1 | ... | t2i_R@10 | R@1_sum | RSUM | vs local | bytes/round |
  | local                |    ...  |     |          |         |          |         0 B |
  | reamFL+Mean          |    ...  |     |          |         |   +x.xx  |    ... MiB  |
  ...
  | CreamFL              |    ...
  | CreamFL+Muscle       |    ...
  Server (vit_s + transformer_s) after R rounds; Recall@K (%) on N held-out test images ...

(Recall@K in %, on held-out test images of the private distribution with 5
captions each; RSUM is the sum of the six recalls; "vs local" is the R@1 sum minus the server trained alone on the
public set.) The workdir (default ``runs/creamfl``) gets config.json,
metrics.jsonl, TensorBoard events, report.md, curves.png, results.json and
checkpoints; rerunning the command resumes. It takes about 10 minutes on a
2-core CPU.

Variants: ``:smoke`` is tiny (used by the tests). Override anything, e.g.
``--config.seed=1 --workdir=runs/creamfl_s1`` or
``--config.methods="('local','CreamFL')"``.
"""

import ml_collections

from experiments.faults import faults_config
from fedjax_mm.runner.creamfl import METHODS


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.rounds = 12
  config.eval_every = 4
  config.methods = METHODS
  # Server and clients start from the shipped World-CLIP encoders (pretrained on
  # 32x32 images), as CreamFL's start from pretrained backbones; pretrained=""
  # trains from scratch (then image_size=16 is the CPU-friendly choice).
  config.pretrained = "world-clip"
  config.image_size = 32  # the world's images, S x S
  config.rep_dim = 64  # d
  config.alpha = 0.1  # Dirichlet concentration of the private splits
  config.local_epochs = 1  # E
  config.local_batch_size = 16
  config.learning_rate = 1e-3  # clients, AdamW
  config.server_learning_rate = 1e-3
  config.weight_decay = 1e-4
  config.checkpoint_every = 1
  config.clients = ml_collections.ConfigDict(
    {
      "image": {"num": 3, "encoder": "vit_t", "train_size": 64},
      "text": {"num": 3, "encoder": "gru", "train_size": 64},
      "multimodal": {
        "num": 3,
        "image_encoder": "vit_t",
        "text_encoder": "transformer_t",
        "train_size": 64,
      },
    }
  )
  config.server = ml_collections.ConfigDict(
    {"image_encoder": "vit_s", "text_encoder": "transformer_s"}
  )
  config.public = ml_collections.ConfigDict({"size": 384, "shift": 1.0})
  config.test = ml_collections.ConfigDict(
    {"size": 250, "shift": 0.0, "folds": ml_collections.FieldReference(None, field_type=int)}
  )
  config.creamfl = ml_collections.ConfigDict(
    {
      "num_selected": 5,  # clients per round (the reference: 10 of 35)
      "batch_size": 16,  # B over the public set
      "server_temperature": 0.1,  # retrieval InfoNCE (server, multimodal clients)
      "lcr_weight": 0.5,  # gamma of eq. (3)
      "inter_temperature": 0.5,  # eq. (1), as the reference
      "intra_temperature": 0.5,  # eq. (2)
      "gca_temperature": 1.0,  # eq. (4) as printed
      "distill_weight": 1.0,  # eq. (7)
      "iot_weight": 100.0,  # reamFL+IoT
      "muscle_partners": 3,  # M local matrices per batch (server's Muscle loss)
      "muscle_tau_full": 0.2,
      "muscle_tau_reduced": 0.15,
      "gca_chunk_size": ml_collections.FieldReference(None, field_type=int),
    }
  )

  config.faults = faults_config()  # experiments/faults.py: all off

  if arg == "smoke":
    config.pretrained = ""
    config.image_size = 16
    config.rounds = 2
    config.eval_every = 1
    config.rep_dim = 8
    config.local_batch_size = 4
    for name in ("image", "text", "multimodal"):
      config.clients[name].num = 2
      config.clients[name].train_size = 6
    config.clients.image.encoder = "vit_t"
    config.server.image_encoder = "vit_t"  # tiny, but the same code path
    config.server.text_encoder = "transformer_t"
    config.public.size = 8
    config.test.size = 6
    config.creamfl.num_selected = 3
    config.creamfl.batch_size = 4
    config.creamfl.muscle_partners = 2
    config.creamfl.gca_chunk_size = 3
  elif arg is not None:
    raise ValueError(f"unknown variant {arg!r}; expected smoke.")
  return config
