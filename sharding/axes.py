"""Logical axis names: the only place they are spelled.

Model code names *logical* axes (what a dimension means); `sharding/rules.py` maps them to *mesh* axes
(`stage`, `data`, `fsdp`, `context`, `expert`, `tensor`) per role. Weights use bare names, activations the `act_`
prefix.
Every parameter of `dsv4` carries a tuple of these (or None for "never shard") as its `logical_axes`
metadata, one entry per array dimension.
"""

# Weight axes.
VOCAB = "vocab"            # vocabulary rows of embed / head
EMBED = "embed"            # model width D (hidden_size)
Q_LORA = "q_lora"          # query latent (q_lora_rank)
HEADS = "heads"            # flattened query heads x head_dim (wq_b output), and per-head vectors (sinks)
KV = "kv"                  # the single shared K=V head dim (head_dim)
O_LORA = "o_lora"          # grouped output projection: o_groups x o_lora_rank
O_IN = "o_in"              # per-group input of wo_a (heads_per_group x head_dim)
COMPRESS = "compress"      # compressor projection outputs (c x head_dim or c x index_head_dim)
INDEX_HEADS = "index_heads"  # lightning-indexer heads (x index_head_dim when flattened)
EXPERT = "expert"          # routed-expert index
MLP = "mlp"                # expert / shared-expert intermediate size
HC = "hc"                  # mHC coefficient rows ((2+n)n or n): tiny, replicated
TABLE = "table"            # integer lookup tables (tid2eid) columns: replicated
LAYERS = "layers"          # the stacked layer dim of a pipelined layer group (parallel/pipeline.py): split in stages

# Activation axes.
ACT_BATCH = "act_batch"
ACT_SEQ = "act_seq"
ACT_EMBED = "act_embed"
ACT_HEADS = "act_heads"
ACT_VOCAB = "act_vocab"
ACT_EXPERT = "act_expert"
ACT_STAGE = "act_stage"    # the pipeline's stage dim of its per-stage activations [P, ...] (parallel/pipeline.py)

WEIGHT_AXES = (VOCAB, EMBED, Q_LORA, HEADS, KV, O_LORA, O_IN, COMPRESS, INDEX_HEADS, EXPERT, MLP, HC, TABLE, LAYERS)
ACTIVATION_AXES = (ACT_BATCH, ACT_SEQ, ACT_EMBED, ACT_HEADS, ACT_VOCAB, ACT_EXPERT, ACT_STAGE)
ALL_AXES = WEIGHT_AXES + ACTIVATION_AXES
