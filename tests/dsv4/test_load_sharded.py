"""Sharded checkpoint I/O (issue 12): `load_hf_checkpoint(mesh=...)` equals the unsharded load bitwise and puts
every leaf in its rule's sharding; `keep_quantized` hands out the file's own bytes; the rollout built from them
computes what the dense fp32 rollout computes; FP4 -> FP8 within its documented bound; sharded random init and
export; one-line errors. The 2-process x 4-device case is `test_two_processes_load_and_export` (slow).
Run: .venv/bin/python -m pytest -q tests/dsv4/test_load_sharded.py
"""

import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from dsv4 import DSV4Config, DSV4ForCausalLM, abstract_model, fp4, load_hf_checkpoint, save_hf_checkpoint, quant
from dsv4.io.convert import CheckpointError, hf_to_official
from dsv4.io.load import init_model
from dsv4.io.safetensors import INDEX_NAME, iter_checkpoint_tensors
from randomize import random_model
from sharding.mesh import build_mesh_plan
from sharding.rules import ACTOR_RULES, ROLLOUT_RULES, param_shardings

CFG = DSV4Config.tiny()
ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = pathlib.Path(__file__).with_name("load_worker.py")


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=0)


@pytest.fixture(scope="module")
def plan():
    return build_mesh_plan("actor:fsdp=2,expert=2/rollout:expert=2,tensor=2")


@pytest.fixture(scope="module")
def ckpts(model, tmp_path_factory):
    """{kind: checkpoint dir}: fp32 / fp8 / fp8_fp4 (official names), fp8_fp4 without an index file."""
    root = tmp_path_factory.mktemp("ckpts")
    out = {q or "fp32": save_hf_checkpoint(model, root / (q or "fp32"), quantize=q, max_shard_bytes=64 * 1024)
           for q in (None, "fp8", "fp8_fp4")}
    noidx = save_hf_checkpoint(model, root / "noindex", quantize="fp8_fp4", max_shard_bytes=64 * 1024)
    (noidx / INDEX_NAME).unlink()
    out["noindex"] = noidx
    return out


def _flat(m):
    return {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(m))}


def _targets(m, mesh, rules):
    sh = param_shardings(nnx.state(m), mesh, rules)
    return {"/".join(map(str, p)): v.get_value() if isinstance(v, nnx.Variable) else v
            for p, v in nnx.to_flat_state(sh)}


def _assert_same_and_placed(ref, got, mesh, rules):
    want = _targets(got, mesh, rules)
    r, g = _flat(ref), _flat(got)
    assert set(r) == set(g)
    for k in r:
        np.testing.assert_array_equal(np.asarray(g[k]), np.asarray(r[k]), err_msg=k)
        assert g[k].dtype == r[k].dtype, k
        assert g[k].sharding.is_equivalent_to(want[k], g[k].ndim), (k, g[k].sharding, want[k])
    return g


@pytest.mark.parametrize("kind", ["fp32", "fp8", "fp8_fp4", "noindex"])
def test_sharded_load_equals_unsharded(ckpts, plan, kind):
    ref = load_hf_checkpoint(ckpts[kind], dtype=jnp.float32)
    got = load_hf_checkpoint(ckpts[kind], dtype=jnp.float32, mesh=plan.actor)  # rules=None: the actor's
    g = _assert_same_and_placed(ref, got, plan.actor, ACTOR_RULES)
    # leaves whose rule splits them are really split (no leaf whole on one device)
    w1 = g["layers/1/ffn/experts/w1"]
    assert len(w1.sharding.device_set) == 4 and w1.addressable_shards[0].data.shape == (4, 32, 32)
    assert all(len(v.sharding.device_set) == 4 for v in g.values())


def test_rollout_rules_and_bf16(ckpts, plan):
    ref = load_hf_checkpoint(ckpts["fp8_fp4"], dtype=jnp.bfloat16)
    got = load_hf_checkpoint(ckpts["fp8_fp4"], dtype=jnp.bfloat16, mesh=plan.rollout, rules=ROLLOUT_RULES)
    _assert_same_and_placed(ref, got, plan.rollout, ROLLOUT_RULES)


def test_transformers_names_sharded(plan, tmp_path):
    pytest.importorskip("transformers")
    from hf_ref import hf_model

    d = tmp_path / "hf"
    hf_model(CFG, seed=0).save_pretrained(d)  # fused experts, `model.` prefixes, no MTP
    ref = load_hf_checkpoint(d, dtype=jnp.float32)
    got = load_hf_checkpoint(d, dtype=jnp.float32, mesh=plan.actor)
    _assert_same_and_placed(ref, got, plan.actor, ACTOR_RULES)


@pytest.mark.parametrize("kind", ["fp8", "fp8_fp4"])
def test_keep_quantized_blocks_are_the_file_bytes(ckpts, plan, kind):
    raw = {hf_to_official(n): load() for n, load in iter_checkpoint_tensors(ckpts[kind])}
    state = load_hf_checkpoint(ckpts[kind], mesh=plan.rollout, rules=ROLLOUT_RULES, keep_quantized=True)
    want = _targets(abstract_model(CFG), plan.rollout, ROLLOUT_RULES)
    n = 0
    for k, v in state.items():
        if not isinstance(v, quant.QuantizedTensor):
            continue
        n += 1
        off = k.replace("/", ".")
        stacked = ".experts." in off
        names = ([off.rsplit(".", 1)[0] + f".{e}.{off.rsplit('.', 1)[1]}.weight" for e in range(v.shape[0])]
                 if stacked else [off])
        q = np.stack([raw[x] for x in names]) if stacked else raw[names[0]]
        sb = np.stack([raw[x[: -len('.weight')] + '.scale'] for x in names]) if stacked else \
            raw[names[0][: -len('.weight')] + '.scale']
        np.testing.assert_array_equal(np.asarray(v.q).view(np.uint8), q.view(np.uint8), err_msg=k)
        np.testing.assert_array_equal(np.asarray(v.scale), 2.0 ** (sb.view(np.uint8).astype(np.float64) - 127))
        assert v.kind == ("fp4" if q.dtype == np.int8 else "fp8")
        assert v.q.sharding.is_equivalent_to(want[k], v.q.ndim), (k, v.q.sharding, want[k])
    assert n == 59


def test_rollout_from_checkpoint_equals_the_dense_fp32_rollout(ckpts, plan):
    """The FP8 rollout built from the file's own blocks (FP4 experts converted exactly) holds exactly the weights of
    the dense-loaded model (no requantisation error is added), and its only difference from the fp32 rollout of that
    model is the release's FP8 activation quantisation (before every FP8 / FP4 GEMM; dsv4.quant.act_quant). Before
    the rollout quantised activations the two rollouts were equal to 1e-6; now the weights are checked bitwise and
    the rollouts compared loosely (random tiny weights, small logit gaps): measured greedy, 4 prompts x 6 tokens,
    first divergence at tokens [6, 2, 1, 0], max |dlogp| before it 0.214."""
    from rl.rollout.init import checkpoint_rollout_weights
    from rl.rollout.engine import Sampler, SamplingParams

    d = ckpts["fp8_fp4"]
    dense = load_hf_checkpoint(d, dtype=jnp.float32)
    ref = Sampler(dense, mesh=plan.rollout, weights="fp32", max_prompt_len=16)
    abstract = abstract_model(CFG)
    new = Sampler(abstract, mesh=plan.rollout, weights="fp8", max_prompt_len=16, compute_dtype=jnp.float32,
                  kv_cache_dtype="bf16")
    assert new.weight_state() is None
    w = checkpoint_rollout_weights(new, d)
    new.set_weights(w, version=0)
    wq = w["layers/1/attn/wq_a/weight"]
    assert isinstance(wq, quant.QuantizedTensor) and wq.q.dtype == jnp.float8_e4m3fn
    old = ref.weight_state()
    assert w.keys() == old.keys()
    rs = np.random.RandomState(0)
    prompts = [list(map(int, rs.randint(3, CFG.vocab_size, n))) for n in (5, 9, 3, 12)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    for k, v in w.items():  # the stored blocks dequantise to the dense-loaded weights, bit for bit
        if isinstance(v, quant.QuantizedTensor):
            np.testing.assert_array_equal(np.asarray(v.dequantize(jnp.float32)), np.asarray(old[k], np.float32))
    a, b = ref.generate(prompts, sp, seed=0), new.generate(prompts, sp, seed=0)
    first = [int(np.argmax(x != y)) if (x != y).any() else x.size for x, y in zip(a.tokens, b.tokens)]
    d = max(float(np.abs(a.logprobs[i, :f] - b.logprobs[i, :f]).max(initial=0.0)) for i, f in enumerate(first))
    assert b.tokens.shape == a.tokens.shape and max(first) >= 2 and 0 < d < 0.5, (first, d)


def test_fp4_to_fp8_exact_within_14_binades_and_bounded_beyond():
    rs = np.random.default_rng(0)
    w = rs.standard_normal((2, 256, 512)).astype(np.float32)
    packed, s = fp4.quantize_fp4(w * np.repeat(np.exp2(rs.integers(-4, 5, (2, 256, 16))), 32, -1))
    assert int(s.max()) - int(s.min()) <= 14
    dense = fp4.dequantize_fp4(packed, s)
    q, tile = jax.jit(quant.fp4_to_fp8_blockwise)(packed, s)
    assert q.dtype == jnp.float8_e4m3fn and tile.shape == (2, 2, 4)
    np.testing.assert_array_equal(np.asarray(quant.dequantize_fp8_blockwise(q, tile)), dense)
    s2 = s.copy()
    s2[..., 0], s2[..., 1] = 127 + 4, 127 - 14  # 18 binades apart inside one tile
    dense2 = fp4.dequantize_fp4(packed, s2)
    q2, t2 = quant.fp4_to_fp8_blockwise(packed, s2)
    err = np.abs(quant.dequantize_fp8_blockwise(q2, t2) - dense2)
    smax = np.repeat(np.repeat(np.asarray(t2) * 64, 128, -2), 128, -1)
    assert err.max() > 0 and (err <= smax * 2.0 ** -16).all()


def test_sharded_random_init_equals_eager(plan):
    cfg = DSV4Config.tiny(num_hidden_layers=2, compress_ratios=(4, 8), num_nextn_predict_layers=0)
    got = init_model(cfg, seed=3, mesh=plan.actor)
    one = jax.jit(lambda: nnx.state(DSV4ForCausalLM(cfg, rngs=nnx.Rngs(3))))()  # the same program, one device
    graphdef = nnx.graphdef(got)
    _assert_same_and_placed(nnx.merge(graphdef, one), got, plan.actor, ACTOR_RULES)
    eager = _flat(DSV4ForCausalLM(cfg, rngs=nnx.Rngs(3)))  # eager ops round the last ulp differently
    for k, v in _flat(got).items():
        np.testing.assert_allclose(np.asarray(v), np.asarray(eager[k]), rtol=1e-6, atol=1e-9, err_msg=k)


def test_export_from_sharded_model_round_trips(ckpts, plan, model, tmp_path):
    sharded = load_hf_checkpoint(ckpts["fp32"], dtype=jnp.float32, mesh=plan.actor)
    out = save_hf_checkpoint(sharded, tmp_path / "plain")
    back = load_hf_checkpoint(out, dtype=jnp.float32)
    for k, v in _flat(model).items():
        np.testing.assert_array_equal(np.asarray(_flat(back)[k]), np.asarray(v), err_msg=k)
    # quantised export from the sharded model writes the same bytes as from the unsharded one
    a = save_hf_checkpoint(sharded, tmp_path / "q_sharded", quantize="fp8_fp4")
    b = save_hf_checkpoint(model, tmp_path / "q_plain", quantize="fp8_fp4")
    ra, rb = dict(iter_checkpoint_tensors(a)), dict(iter_checkpoint_tensors(b))
    assert set(ra) == set(rb)
    for k in ra:
        np.testing.assert_array_equal(ra[k]().view(np.uint8), rb[k]().view(np.uint8), err_msg=k)


# ----------------------------------------------------------------------------------------------- errors


def _copy(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_truncated_file_names_file_and_tensor(ckpts, plan, tmp_path):
    d = _copy(ckpts["fp8_fp4"], tmp_path / "trunc")
    last = sorted(d.glob("*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{last.name}.*tensor .*truncated"):
        load_hf_checkpoint(d, dtype=jnp.float32, mesh=plan.actor)


def test_corrupt_bytes_name_the_tensor(ckpts, tmp_path):
    d = _copy(ckpts["fp8"], tmp_path / "nan")
    raw = {n: load() for n, load in iter_checkpoint_tensors(d)}
    q = raw["layers.1.attn.wq_b.weight"].view(np.uint8).copy()
    q[0, 0] = 0x7F  # e4m3fn NaN
    from dsv4.io.safetensors import save_sharded_checkpoint

    raw["layers.1.attn.wq_b.weight"] = q.view(ml_dtypes.float8_e4m3fn)
    d2 = tmp_path / "nan2"
    save_sharded_checkpoint(d2, raw.items())
    (d2 / "config.json").write_text((d / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wq_b\.weight.*NaN"):
        load_hf_checkpoint(d2, dtype=jnp.float32)


def test_config_mismatch_and_unreadable_directory(ckpts, plan, tmp_path):
    other = DSV4Config.tiny(hidden_size=128)
    with pytest.raises(CheckpointError, match=r"config\.json.*hidden_size 64 in the file vs 128 given"):
        load_hf_checkpoint(ckpts["fp32"], config=other, mesh=plan.actor)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nowhere")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_hf_checkpoint(tmp_path / "afile")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_hf_checkpoint(tmp_path / "empty", config=CFG)
    with pytest.raises(CheckpointError, match="config file not found"):
        load_hf_checkpoint(_nocfg(ckpts, tmp_path))


def _nocfg(ckpts, tmp_path):
    d = _copy(ckpts["fp32"], tmp_path / "nocfg")
    (d / "config.json").unlink()
    return d


def test_wrong_dtype_and_missing_tensor_sharded(ckpts, plan, tmp_path):
    from dsv4.io.safetensors import save_sharded_checkpoint

    raw = {n: load() for n, load in iter_checkpoint_tensors(ckpts["fp8_fp4"])}
    bad = dict(raw)
    bad["layers.1.ffn.experts.2.w1.scale"] = np.ones((32, 1), ml_dtypes.float8_e8m0fnu)
    d = tmp_path / "shape"
    save_sharded_checkpoint(d, bad.items())
    (d / "config.json").write_text((ckpts["fp8_fp4"] / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"layers\.1\.ffn\.experts\.2\.w1\.scale.*\[32, 2\].*\[32, 1\]"):
        load_hf_checkpoint(d, mesh=plan.actor)
    bad = {k: v for k, v in raw.items() if k != "layers.2.ffn.experts.5.w3.weight"}
    d = tmp_path / "missing"
    save_sharded_checkpoint(d, bad.items())
    (d / "config.json").write_text((ckpts["fp8_fp4"] / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*layers\.2\.ffn\.experts\.5\.w3\.weight"):
        load_hf_checkpoint(d, mesh=plan.actor)


# ------------------------------------------------------------------------------------- 2 processes x 4


@pytest.mark.slow
def test_two_processes_load_and_export(ckpts, tmp_path):
    """2 processes x 4 CPU devices (gloo): every process loads the fp8_fp4 checkpoint on the 8-device actor mesh,
    checks each addressable shard against the unsharded numpy load bitwise and each leaf's sharding, reads less
    than the whole checkpoint, then both export the sharded model (process 0 writes) and process 0 checks that
    the export loads back identically (tests/dsv4/load_worker.py)."""
    import portpicker

    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "OMPI_"))}
    # no forced 8 devices in the workers; the suite's compile options keep two concurrent processes' compiles short
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ["DSV4RL_TEST_XLA_FLAGS"],
               PYTHONPATH=f"{ROOT}:{ROOT / 'tests' / 'dsv4'}")

    def attempt(timeout_s: float, out):
        port = portpicker.pick_unused_port()
        procs = [subprocess.Popen([sys.executable, str(WORKER), "--coordinator", f"127.0.0.1:{port}",
                                   "--num-processes", "2", "--process-id", str(i), "--cpu-devices-per-process", "4",
                                   "--ckpt", str(ckpts["fp8_fp4"]), "--out", str(out)],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(2)]
        deadline, logs = time.monotonic() + timeout_s, []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            return None, [p.communicate()[0] for p in procs]
        return procs, logs

    # Up to 3 attempts: both workers sometimes hang inside a gloo collective (first seen 2026-12-01 in a full-suite
    # run; 2026-12-02: in 3 of 7 runs of this test alone, on the trees before and after the release-exact FP8 change,
    # a hang with no traceback; 2026-12-02 stop 33: one hang in a full-suite run). A run takes 7-12 s alone and 13 s
    # in a loaded suite, so 30 s bounds a hung attempt (a hang cost the suite 420 s with the former 180 + 240 s, 60 s
    # with 60 + 60 + 120). Three hangs fail the test.
    procs = None
    for n, timeout_s in enumerate((30, 30, 90)):
        procs, logs = attempt(timeout_s, tmp_path / f"export{n}")
        if procs is not None:
            break
        print(f"workers hung (attempt {n + 1}):\n" + "\n----\n".join(lg[-2000:] for lg in logs))
    if procs is None:
        pytest.fail("workers timed out 3 times:\n" + "\n----\n".join(logs))
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(logs)
    fracs = [float(line.split("read_frac=")[1].split()[0]) for lg in logs for line in lg.splitlines()
             if "read_frac=" in line]
    assert len(fracs) == 2 and all(0 < f < 1 for f in fracs), logs
    assert "export loads back identically" in logs[0]


def test_progress_bar_on_process_0(ckpts, capsys):
    load_hf_checkpoint(ckpts["fp8_fp4"], dtype=jnp.float32, progress=True)
    err = capsys.readouterr().err
    assert "loading fp8_fp4" in err and "tensors" in err and "B/s" in err


def test_export_from_sharded_model_loads_in_transformers(ckpts, plan, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    sharded = load_hf_checkpoint(ckpts["fp32"], dtype=jnp.float32, mesh=plan.actor)
    out = save_hf_checkpoint(sharded, tmp_path / "export")
    hf, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype="float32")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    sd = hf.state_dict()
    ours = _flat(sharded)
    np.testing.assert_array_equal(sd["model.embed_tokens.weight"].numpy(), np.asarray(ours["embed/weight"]))
    gu = sd["model.layers.2.mlp.experts.gate_up_proj"].numpy()
    np.testing.assert_array_equal(gu[:, : CFG.moe_intermediate_size], np.asarray(ours["layers/2/ffn/experts/w1"]))
    np.testing.assert_array_equal(sd["model.layers.1.self_attn.q_a_proj.weight"].numpy(),
                                  np.asarray(ours["layers/1/attn/wq_a/weight"]))


NAMES = ("data", "fsdp", "expert", "tensor")


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto])
def test_make_mesh_meshes_load_and_init_like_auto_meshes(ckpts, axis_type):
    """A mesh from `jax.make_mesh` (Explicit axes, its default, or Auto) is accepted by `load_hf_checkpoint` (the
    FP8 checkpoint: block dequantisation) and `init_model`, which give bitwise the arrays they give on the Auto
    mesh of the same devices (`sharding.mesh.auto_axes`), in the same shardings."""
    from sharding.mesh import auto_axes

    mesh = jax.make_mesh((1, 4, 2, 1), NAMES, axis_types=(axis_type,) * 4)
    auto = jax.sharding.Mesh(mesh.devices, NAMES, axis_types=(jax.sharding.AxisType.Auto,) * 4)
    assert auto_axes(mesh) == auto
    for make in (lambda m: load_hf_checkpoint(ckpts["fp8"], dtype=jnp.float32, mesh=m),
                 lambda m: init_model(CFG, seed=1, mesh=m)):
        got, ref = _flat(make(mesh)), _flat(make(auto))
        assert set(got) == set(ref)
        for k, v in ref.items():
            assert got[k].sharding == v.sharding, k
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v), err_msg=k)
