"""Tests for parallel/plan.py, parallel/model_bytes.py and parallel/activations.py: Flash weight bytes per device
equal hand arithmetic from the spec's parameter counts (docs/dsv4-architecture.md §10) on two actor meshes and the
rollout FP8/FP4 expert bytes; per-device bytes agree with jax's own NamedSharding shard shapes on the tiny model;
the KV-cache formula by hand; impossible layouts are reported as not fitting; the CLI runs for the seed layouts;
errors name the problem.
The Flash `nnx.eval_shape` (10-20 s) runs once per process (`model_bytes.model_leaves` is cached)."""

import dataclasses
import math
import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv4
from dsv4.lora import LoraConfig, is_adapter_key
from launch.plan import main as plan_main
from parallel import activations, model_bytes
from parallel import plan as pl
from rl.config.algo import LearnerConfig
from sharding.mesh import MeshSpecError, build_mesh_plan
from sharding.rules import ACTOR_RULES, ROLLOUT_RULES

GiB = 2**30
# the hand counts below include the MTP block's master weights and moments: a learner that trains it
LEARNER = LearnerConfig(train_mtp=True)

# ---- Flash parameter counts (spec §10), split by dtype and by whether a dim is `embed` (FSDP-sharded on the actor).
L, N_CSA, N_HCA, N_HASH, N_MTP = 43, 21, 20, 3, 1
LAYERS = L + N_MTP  # every block (main + MTP) has attention core, mHC, norms and an MoE
ROUTED = 6_442_450_944  # 256 experts x 3 x 4096 x 2048 per layer (expert, mlp, embed)
ROUTER = 256 * 4096  # gate.weight (expert, embed)
BIAS = 256  # gate.bias fp32 (expert), learned layers: 40 main + MTP
TID2EID = 129280 * 6 * 4  # int32 (vocab, table), hash layers, replicated when tensor = 1
# per block, bf16 with an embed dim: wq_a, wkv, wo_b, attn/ffn norms, shared expert
EMB_BLOCK = 4096 * 1024 + 4096 * 512 + 8192 * 4096 + 2 * 4096 + 3 * 4096 * 2048
# per block, bf16 without an embed dim: wq_b, q_norm, kv_norm, wo_a
REP_BLOCK = 1024 * 32768 + 1024 + 512 + 8 * 1024 * 4096
F32_BLOCK = 64 + 786_486  # sinks + mHC (replicated)
EMB_CSA, REP_CSA, F32_CSA = 2 * 4096 * 1024 + 2 * 4096 * 256 + 4096 * 64, 512 + 128 + 1024 * 8192, 4 * 1024 + 4 * 256
EMB_HCA, REP_HCA, F32_HCA = 2 * 4096 * 512, 512, 128 * 512
EMB_GLOBAL = 2 * 129280 * 4096 + 4096  # embed, head (vocab, embed), final norm
EMB_MTP = 2 * 4096 * 4096 + 3 * 4096  # e_proj, h_proj (embed, None), enorm / hnorm / norm
F32_GLOBAL = 2 * (4 * 16384 + 4 + 1)  # hc_head of the model and of MTP
N_BIAS = L - N_HASH + N_MTP

EMB = LAYERS * EMB_BLOCK + N_CSA * EMB_CSA + N_HCA * EMB_HCA + EMB_GLOBAL + EMB_MTP
REP = LAYERS * REP_BLOCK + N_CSA * REP_CSA + N_HCA * REP_HCA
F32 = LAYERS * F32_BLOCK + N_CSA * F32_CSA + N_HCA * F32_HCA + F32_GLOBAL
ROUTED_ALL, ROUTER_ALL = LAYERS * ROUTED, LAYERS * ROUTER


def test_hand_counts_match_the_spec():
    """The split above adds up to the spec's totals: 277,025,390,592 routed in the 43 layers and
    290,942,289,362 logical parameters with MTP (main 284,332,240,471 + MTP 6,610,048,891)."""
    assert L * ROUTED == 277_025_390_592
    total = EMB + REP + F32 + ROUTED_ALL + ROUTER_ALL + N_BIAS * BIAS
    assert total == 284_332_240_471 + 6_610_048_891 == 290_942_289_362


@pytest.fixture(scope="module")
def flash_leaves():
    return model_bytes.model_leaves(dsv4.DSV4Config.flash())


def test_model_leaves_match_hand_counts(flash_leaves):
    floats = sum(math.prod(lf.shape) for lf in flash_leaves if lf.dtype != "int32")
    assert floats == 290_942_289_362
    assert sum(math.prod(lf.shape) for lf in flash_leaves if lf.dtype == "float32") == F32 + N_BIAS * BIAS


def _weights(report):
    return report.actor.items["weights (bf16; fp32 mHC/sinks/ape/bias; int32 tid2eid)"]


def test_actor_weights_expert8(flash_leaves):
    """actor:expert=8 (one node): only the expert dim is split: routed experts, router weight and bias / 8."""
    r = pl.plan("flash", "actor:expert=8", "mi308x", learner=LEARNER, nodes=1)
    hand = (2 * (EMB + REP) + 4 * F32 + N_HASH * TID2EID
            + (2 * (ROUTED_ALL + ROUTER_ALL) + 4 * N_BIAS * BIAS) / 8)
    assert _weights(r) == hand
    # gradients: the same minus the non-trained tables (tid2eid) and buffers (router bias)
    assert r.actor.items["gradients (param dtype)"] == hand - N_HASH * TID2EID - 4 * N_BIAS * BIAS / 8
    # master fp32 for the bf16 params only; Adam 2 x 4 bytes for every trained param
    bf16_local = EMB + REP + (ROUTED_ALL + ROUTER_ALL) / 8
    assert r.actor.items["fp32 master weights"] == 4 * bf16_local
    assert r.actor.items["Adam moments (2 x fp32)"] == 8 * (bf16_local + F32)
    assert not r.actor.fits  # 284B-parameter training state on one node: impossible
    assert r.actor.margin < -500 * GiB  # ~689 GiB per device needed vs 172.8 usable


def test_actor_weights_fsdp8_expert8(flash_leaves):
    """actor:fsdp=8,expert=8 over 64 devices (8 nodes): embed dims / 8 as well; experts and router / 64."""
    r = pl.plan("flash", "actor:fsdp=8,expert=8", "mi355x", learner=LEARNER, nodes=8)
    hand = (2 * EMB / 8 + 2 * REP + 4 * F32 + N_HASH * TID2EID
            + 2 * (ROUTED_ALL + ROUTER_ALL) / 64 + 4 * N_BIAS * BIAS / 8)
    assert _weights(r) == hand
    assert r.actor.devices == 64 and r.actor.nodes == 8


def test_rollout_expert_bytes(flash_leaves):
    """Routed experts on rollout:expert=8. FP8 (as rl/rollout/engine.py holds them): 1 B per weight split over 8, plus
    one f32 scale per 128x128 tile (each [2048, 4096] matrix is 16 x 32 whole tiles) replicated on every device.
    FP4: 0.5 B + one 1-byte E8M0 scale per 32 inputs, split like the weight."""
    spec = "actor:expert=8/rollout:expert=8"
    r = pl.plan("flash", spec, "mi355x", learner=LEARNER, nodes=2)
    assert r.rollout.items["weights: routed experts (fp8)"] == ROUTED_ALL / 8 + ROUTED_ALL / (128 * 128) * 4
    r = pl.plan("flash", spec, "mi355x", learner=LEARNER, nodes=2, rollout_experts="fp4")
    assert r.rollout.items["weights: routed experts (fp4)"] == pytest.approx(ROUTED_ALL / 8 * (0.5 + 1 / 32), rel=1e-12)
    # dequant=per_call keeps a bf16 copy of every quantised tensor (experts + the FP8 set) during generate
    r = pl.plan("flash", spec, "mi355x", learner=LEARNER, nodes=2, rollout_dequant="per_call")
    fp8_set = LAYERS * (4096 * 1024 + 1024 * 32768 + 4096 * 512 + 2 * 8192 * 4096 + 3 * 4096 * 2048) \
        + N_CSA * 1024 * 8192 + 2 * 4096 * 4096  # attention, shared expert; indexer wq_b; MTP e/h_proj
    assert r.rollout.items["bf16 copy of the quantised weights (dequant=per_call)"] == 2 * (ROUTED_ALL / 8 + fp8_set)


def test_kv_cache_layout():
    """Flash, from dsv4.cache: 43 main layers of sliding ring (128 x 512 bf16 + 128 int32); 21 CSA layers (m=4)
    with bf16 entries, f32 indexer keys (128) and 4 f32 [m, 2d] / [m, 2d_I] window states; 20 HCA (m'=128) with
    bf16 entries and 4 f32 [m', d] window states. The MTP block has no decode cache."""
    kv = model_bytes.KVCache.for_config(dsv4.DSV4Config.flash())
    fixed = 43 * (128 * 512 * 2 + 128 * 4) + 21 * 4 * (4 * 1024 + 4 * 256) * 4 + 20 * 4 * 128 * 512 * 4
    per_token = 21 * (512 * 2 + 128 * 4) / 4 + 20 * 512 * 2 / 128
    assert kv.fixed == fixed == 28_349_952 and kv.per_token == per_token == 8224
    assert kv.per_seq(4096) == fixed + 4096 * 8224


def test_per_device_bytes_match_jax_shardings():
    """On the tiny model and the 8 CPU devices, the planner's local shapes are jax's NamedSharding shard shapes."""
    cfg = dsv4.DSV4Config.tiny()
    abstract = nnx.state(dsv4.abstract_model(cfg, param_dtype=jnp.bfloat16))
    plan = build_mesh_plan("actor:fsdp=2,expert=2,tensor=2")
    leaves = {lf.path: lf for lf in model_bytes.model_leaves(cfg)}
    for role, rules in (("actor", ACTOR_RULES), ("rollout", ROLLOUT_RULES)):
        shardings = plan.param_shardings(role, abstract)
        amesh = model_bytes.abstract_mesh(dict(plan.actor.shape))
        for path, sh in nnx.to_flat_state(shardings):
            key = ".".join(map(str, path))
            leaf = leaves[key]
            assert model_bytes.local_shape(leaf, rules, amesh) == sh.get_value().shard_shape(leaf.shape), (role, key)


def test_errors():
    with pytest.raises(MeshSpecError, match=r"uses 24 devices but 2 node\(s\) x 8 = 16"):
        pl.plan("flash", "actor:fsdp=2,expert=8/rollout:expert=8", "mi308x", learner=LEARNER, nodes=2)
    with pytest.raises(MeshSpecError, match="does not divide hidden_size"):
        pl.plan("flash", "actor:fsdp=3", "mi308x", learner=LEARNER, nodes=None)
    with pytest.raises(ValueError, match="unknown gpu 'a100'"):
        pl.plan("flash", "actor:expert=8", "a100", learner=LEARNER)
    with pytest.raises(MeshSpecError, match="needs the node count"):
        pl.plan("flash", "auto", "h200", learner=LEARNER)


SEEDS = [
    # (a) 2 actor nodes + 1 FP8 rollout node of MI308X: the actor fits only with the optimizer in host memory
    (["--mesh", "actor:fsdp=2,expert=4,tensor=2/rollout:expert=8", "--gpu", "mi308x", "--nodes", "3"], "no", "yes"),
    (["--mesh", "actor:fsdp=2,expert=4,tensor=2/rollout:expert=8", "--gpu", "mi308x", "--nodes", "3",
      "--offload-optimizer", "1.0"], "yes", "yes"),
    (["--mesh", "actor:fsdp=2,expert=8/rollout:expert=8", "--gpu", "mi308x", "--nodes", "3",
      "--offload-optimizer", "1.0"], "yes", "yes"),
    # (b) 4 MI355X nodes: 3 actor nodes cannot shard power-of-two dims (data=3 replicates); 2 + 2 and colocated fit
    (["--mesh", "actor:data=3,fsdp=2,expert=4/rollout:expert=8", "--gpu", "mi355x", "--nodes", "4"], "no", "yes"),
    (["--mesh", "actor:data=3,fsdp=2,expert=4/rollout:expert=8", "--gpu", "mi355x", "--nodes", "4",
      "--offload-optimizer", "1.0", "--host-gib-per-node", "2048"], "no", "yes"),  # needs 3.6 TiB of host RAM
    (["--mesh", "actor:fsdp=2,expert=2,tensor=4/rollout:data=2,expert=8", "--gpu", "mi355x", "--nodes", "4",
      "--offload-optimizer", "0.5"], "yes", "yes"),
    (["--mesh", "actor:fsdp=2,expert=8,tensor=2", "--gpu", "mi355x", "--nodes", "4"], "yes", "yes"),
    # without the streamed update the whole offloaded state transits the device in the step (XLA's memory analysis
    # of the Flash step, launch/aot.py): host offload then saves nothing at the update's peak
    (["--mesh", "actor:fsdp=2,expert=8/rollout:expert=8", "--gpu", "mi308x", "--nodes", "3",
      "--offload-optimizer", "1.0", "--no-stream-optimizer"], "no", "yes"),
]


@pytest.mark.parametrize("argv, actor_fits, rollout_fits", SEEDS)
def test_cli_seed_layouts(capsys, argv, actor_fits, rollout_fits):
    # the run's knobs (launch/run.py flags): Flash, sequences of 1,024 + 3,072 = 4,096 tokens
    assert plan_main(["--config", "flash", "--max-prompt-len", "1024", "--max-new-tokens", "3072", *argv]) == 0
    out = capsys.readouterr().out
    line = out.strip().splitlines()[-1]
    assert line.startswith("PLAN role=actor per_device_gib=")
    fields = [kv.split("=", 1) for kv in line.split()[1:]]
    fits = [v for k, v in fields if k == "fits"]
    assert fits == [actor_fits, rollout_fits], out
    assert "verdict:" in out and "KV cache per sequence" in out


def test_cli_error_exit(capsys):
    assert plan_main(["--config", "flash", "--mesh", "actor:fsdp=3", "--gpu", "h200"]) == 2
    assert "error:" in capsys.readouterr().err


def test_ep_rows_follow_the_dispatch_backend():
    """Expert-FFN rows per local token, as parallel/expert.py sizes its buffers: padded min(f * k, E) (dropless E: T_local rows per expert),
    capacity min(ep, f) * k (dropless ep * k), ragged ep * k dropless or f * k; the activations grow with them."""
    cfg = dsv4.DSV4Config.preset("flash")
    sizes = {"data": 1, "fsdp": 2, "expert": 8, "tensor": 1}
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    assert activations.ep_rows_per_token(cfg, sizes, "padded", 1.25) == 1.25 * k
    assert activations.ep_rows_per_token(cfg, sizes, "padded", None) == e
    assert activations.ep_rows_per_token(cfg, sizes, "capacity", None) == 8 * k
    assert activations.ep_rows_per_token(cfg, sizes, "capacity", 2.0) == 2.0 * k
    assert activations.ep_rows_per_token(cfg, sizes, "ragged", None) == 8 * k
    act = {b: activations.actor_activations(cfg, sizes, 8192, 8192, None if b == "ragged" else 1.25, b)
           for b in ("padded", "ragged")}
    assert act["padded"] < act["ragged"]
    with pytest.raises(ValueError, match="--ep-backend must be one of"):
        pl.plan("flash", "actor:fsdp=2,expert=8/rollout:expert=8", "mi308x", nodes=3,
                learner=types.SimpleNamespace(**{**vars(LEARNER), "ep_backend": "dense"}))


def test_xla_cpu_items_are_labelled_and_kept_out_of_the_gpu_plan():
    """plan(xla_cpu=True) (what `--compile` compares with XLA:CPU) adds only items labelled "XLA:CPU only" (f32
    copies of one layer's dot operands; the stacked weights and saved inputs are read in place); the GPU plan,
    its verdict and every other item are unchanged; the saved layer inputs are L x T x n_hc x D bf16 bytes."""
    cfg = dsv4.DSV4Config.preset("flash")
    kw = dict(nodes=3, tokens_per_device=8192, train_seq_len=8192,
              learner=LearnerConfig(offload_optimizer=1.0, ep_backend="padded", ep_capacity_factor=1.25))
    gpu = pl.plan("flash", "actor:fsdp=2,expert=8/rollout:expert=8", "mi308x", **kw).actor
    cpu = pl.plan("flash", "actor:fsdp=2,expert=8/rollout:expert=8", "mi308x", xla_cpu=True, **kw).actor
    extra = {k: v for k, v in cpu.items.items() if k not in gpu.items}
    assert extra and all("XLA:CPU only" in k for k in extra) and gpu.cpu_only == 0
    assert cpu.cpu_only == sum(extra.values()) > 0 and cpu.gpu_total == gpu.total and cpu.fits == gpu.fits
    assert {k: v for k, v in cpu.items.items() if k in gpu.items} == gpu.items
    saved = next(v for k, v in gpu.items.items() if k.startswith("activations: saved layer inputs"))
    assert saved == cfg.num_hidden_layers * 8192 * cfg.hc_mult * cfg.hidden_size * 2


def test_kv_cache_layout_fp8():
    """Flash with the FP8 cache (dsv4.cache): each ring slot / compressed entry = 448 FP8 no-RoPE dims + 7 ue8m0
    scale bytes (one per 64 dims) + 64 bf16 RoPE dims = 583 B (DeepSeek's kernels pad it to 584); each CSA layer's
    indexer key = 128 FP8 + 1 scale byte; compressor window states stay f32."""
    kv = model_bytes.KVCache.for_config(dsv4.DSV4Config.flash(), fp8="e4m3fn")
    entry = 448 + 7 + 64 * 2
    fixed = 43 * (128 * entry + 128 * 4) + 21 * 4 * (4 * 1024 + 4 * 256) * 4 + 20 * 4 * 128 * 512 * 4
    per_token = 21 * (entry + 129) / 4 + 20 * entry / 128
    assert kv.fixed == fixed == 25_922_688 and kv.per_token == per_token == 3829.09375
    r = pl.plan("flash", "actor:expert=8/rollout:expert=8", "mi355x", learner=LEARNER, nodes=2, kv_layout="fp8")
    assert r.rollout.kv_per_token == {"fp8": per_token, "bf16": 8224}
    assert r.rollout.kv_per_seq == kv.per_seq(4096) and r.line().endswith("kv_dtype=fp8")
    assert "per added token: fp8 3,829 B, bf16 8,224 B" in r.table()
    with pytest.raises(ValueError, match="kv layout"):
        pl.plan("flash", "actor:expert=8/rollout:expert=8", "mi355x", learner=LEARNER, nodes=2, kv_layout="int8")


def test_context_axis_splits_weights_with_fsdp_and_counts_the_gathered_kv(flash_leaves):
    """Context parallelism (issue 25): `actor:fsdp=2,context=2,expert=4` holds the same weight, master and moment
    bytes per device as `actor:fsdp=4,expert=4` (FSDP over fsdp x context), and at 16,384 tokens per device of
    32K-token rows adds the all-gathered compressed KV + halo of the largest layer by hand: CSA m=4: 8,192 entries
    x (512 bf16 + 128 f32 indexer) + 127 halo keys x 512 bf16, value and gradient, one row."""
    kw = dict(learner=LEARNER, tokens_per_device=16384, train_seq_len=32768)
    cp = pl.plan("flash", "actor:fsdp=2,context=2,expert=4/rollout:expert=8", "mi308x", nodes=3, **kw)
    ref = pl.plan("flash", "actor:fsdp=4,expert=4/rollout:expert=8", "mi308x", nodes=3, **kw)
    for k, v in ref.actor.items.items():
        if not k.startswith("activations"):
            assert cp.actor.items[k] == v, k
    kv = [v for k, v in cp.actor.items.items() if k.startswith("activations: gathered compressed KV")]
    assert kv == [2 * (32768 // 4 * (512 * 2 + 128 * 4) + 127 * 512 * 2)]
    assert [v for k, v in ref.actor.items.items() if k.startswith("activations: gathered compressed KV")] == [0.0]


def test_pipeline_stages_split_the_pipelined_layers_and_print_the_bubble(flash_leaves):
    """`--learner.pipeline_stages 2` on `actor:stage=2,expert=8`: the 20 x (HCA, CSA) group (layers 3..42) is split
    over the stages, so its weights (gradients, masters, moments alike) count half per device; the 3 hash layers,
    embedding, head and MTP stay whole; the table prints the GPipe bubble (P-1)/(M+P-1) = 1/9 at M = 8."""
    pipe = dataclasses.replace(LEARNER, pipeline_stages=2)
    r = pl.plan("flash", "actor:stage=2,expert=8/rollout:expert=8", "mi308x", nodes=3, learner=pipe,
                pipeline_micro_batches=8)
    ref = pl.plan("flash", "actor:expert=8/rollout:expert=8", "mi308x", nodes=2, learner=LEARNER)
    mesh = model_bytes.abstract_mesh({"expert": 8})
    split = sum(math.prod(model_bytes.local_shape(lf, ACTOR_RULES, mesh)) * np.dtype(lf.dtype).itemsize
                for lf in flash_leaves if lf.path.startswith("layers.") and 3 <= int(lf.path.split(".")[1]) <= 42)
    w = "weights (bf16; fp32 mHC/sinks/ape/bias; int32 tid2eid)"
    assert r.actor.items[w] == ref.actor.items[w] - split / 2
    assert "pipeline: 2 stages over layers 3..42 (20 per stage" in r.table() and "= 0.111 at M=8" in r.table()
    # GPipe: each stage keeps its 20 layers' saved inputs for all 8 micro-batches: 160 layer-inputs where 40 counted
    gpipe = [v for k, v in r.actor.items.items() if k.startswith("activations: GPipe")]
    assert gpipe == [activations.saved_layer_inputs(dsv4.DSV4Config.flash(), 4096) * 40 / 43 * (8 / 2 - 1)]
    with pytest.raises(ValueError, match=r"--learner.pipeline_stages=3 does not divide the 20 repetitions"):
        pl.plan("flash", "actor:stage=3,expert=8/rollout:expert=8", "mi308x", nodes=4,
                learner=dataclasses.replace(LEARNER, pipeline_stages=3))


def test_lora_plan_counts_gradients_and_optimizer_state_of_the_adapters_alone():
    """LoRA (learner.lora.rank > 0): gradients and Adam moments for the adapters only, bytes counted by hand."""
    cfg = dsv4.DSV4Config.tiny()
    lora = LoraConfig(rank=4)
    full = pl.plan(cfg, "actor:data=1/rollout:data=1", "mi308x", learner=LEARNER, nodes=None)
    r = pl.plan(cfg, "actor:data=1/rollout:data=1", "mi308x", learner=dataclasses.replace(LEARNER, lora=lora),
                nodes=None)
    adapters = [leaf for leaf in model_bytes.model_leaves(cfg, lora) if is_adapter_key(leaf.path.replace(".", "/"))]
    n = sum(math.prod(leaf.shape) for leaf in adapters)  # float32 adapters: 4 B grads, 2 x 4 B moments, no master
    assert adapters and all(leaf.dtype == "float32" for leaf in adapters)
    assert r.actor.items["gradients (param dtype)"] == 4 * n
    assert r.actor.items["Adam moments (2 x fp32)"] == 8 * n and r.actor.items["fp32 master weights"] == 0
    assert r.actor.items["gradients (param dtype)"] < full.actor.items["gradients (param dtype)"] / 10
