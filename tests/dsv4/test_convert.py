"""Tests for dsv4/io/convert.py: FP8/FP4 dequantisation on load against an independent NumPy decoder,
transformers-named checkpoints (fused experts), checkpoint errors, atomic export, the name table.

The reference decoders here are written from the format description (spec §9.2, §12 item 23), not from
dsv4/quant.py or dsv4/fp4.py: FP8 e4m3fn bytes are cast by ml_dtypes and multiplied by a Kronecker-expanded
2^(b-127) block scale; FP4 e2m1 codes are split into nibbles (low nibble = even column) and decoded from their sign /
exponent / mantissa bits. No model forward is run (no XLA compile), so the file is fast.
Run: .venv/bin/python -m pytest -q tests/dsv4/test_convert.py
"""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv4 import DSV4Config, abstract_model, load_hf_checkpoint, save_hf_checkpoint
from dsv4.io import safetensors as safetensors_io
from dsv4.io.convert import CheckpointError, hf_to_official, official_tensors
from dsv4.io.safetensors import iter_checkpoint_tensors, save_sharded_checkpoint
from dsv4.quant import QuantizedTensor
from randomize import random_model

# Official names the release stores quantised (spec §9.1, §12 item 24): FP8 128x128 for these ...
FP8_NAMES = re.compile(r"^(layers\.\d+|mtp\.\d+)\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|"
                       r"ffn\.shared_experts\.w[123]|e_proj|h_proj)\.weight$")
# ... and FP4 (fp8_fp4) or FP8 (fp8) for the routed experts.
EXPERT_NAMES = re.compile(r"^(layers\.\d+|mtp\.\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")


def _by_file_name(model) -> dict[str, np.ndarray]:
    """{official per-file name: numpy array (ShapeDtypeStruct for an abstract model)}: experts split per expert."""
    out = {}
    for key, val in official_tensors(model).items():
        arr = val if isinstance(val, jax.ShapeDtypeStruct) else np.asarray(val)
        m = re.match(r"^(.*\.ffn\.experts)\.(w[123])$", key)
        if m:
            for e in range(arr.shape[0]):
                out[f"{m.group(1)}.{e}.{m.group(2)}.weight"] = None if isinstance(arr, jax.ShapeDtypeStruct) else arr[e]
        else:
            out[key] = arr
    return out


def _raw(d) -> dict[str, np.ndarray]:
    return {name: load() for name, load in iter_checkpoint_tensors(d)}


# ---------------------------------------------------------------------------- independent NumPy decoders


def ref_dequant_fp8(q: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    """W = fp8(Q) * 2^(S-127) over 128x128 tiles (spec §9.2)."""
    out, inp = q.shape
    s = np.kron(2.0 ** (scale_bytes.astype(np.float64) - 127), np.ones((128, 128)))[:out, :inp]
    return (q.astype(np.float32).astype(np.float64) * s).astype(np.float32)


def _e2m1(code: np.ndarray) -> np.ndarray:
    """e2m1 code (4 bits: sign | 2 exponent bits | 1 mantissa bit) -> value, from the bit fields."""
    sign = np.where(code & 0b1000, -1.0, 1.0)
    e, m = (code >> 1) & 0b11, code & 0b1
    mag = np.where(e == 0, 0.5 * m, 2.0 ** (e.astype(np.float64) - 1) * (1 + 0.5 * m))
    return sign * mag


def ref_dequant_fp4(packed: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    """Byte k of a row: low nibble = column 2k, high nibble = column 2k+1; one 2^(S-127) per 32 columns."""
    b = packed.view(np.uint8)
    rows, half = b.shape
    codes = np.empty((rows, 2 * half), np.uint8)
    codes[:, 0::2] = b & 0x0F
    codes[:, 1::2] = b >> 4
    s = np.repeat(2.0 ** (scale_bytes.astype(np.float64) - 127), 32, axis=1)
    return (_e2m1(codes) * s).astype(np.float32)


def test_reference_decoders_on_hand_values():
    assert _e2m1(np.arange(16, dtype=np.uint8)).tolist() == [
        0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    # one row of 32 logical values: byte 0x71 = (col 0: code 1 = 0.5, col 1: code 7 = 6), scale 2^1
    packed = np.array([[0x71] + [0x00] * 15], np.uint8).view(np.int8)
    got = ref_dequant_fp4(packed, np.array([[128]], np.uint8))
    assert got[0, :3].tolist() == [1.0, 12.0, 0.0]
    q = np.array([[1.5, -448.0]], ml_dtypes.float8_e4m3fn)
    assert ref_dequant_fp8(q, np.array([[125]], np.uint8)).tolist() == [[0.375, -112.0]]


# ------------------------------------------------------------------------------- (a) quantised exports


@pytest.fixture(scope="module")
def cfg():
    return DSV4Config.tiny()


@pytest.fixture(scope="module")
def model(cfg):
    return random_model(cfg, seed=0)


@pytest.fixture(scope="module")
def exports(model, tmp_path_factory):
    """{quantize: (directory, raw tensors, loaded model, quantized dict)} for fp8_fp4 and fp8."""
    out = {}
    for q in ("fp8_fp4", "fp8"):
        d = save_hf_checkpoint(model, tmp_path_factory.mktemp(q) / "ckpt", quantize=q)
        loaded, qdict = load_hf_checkpoint(d, dtype=jnp.float32, keep_quantized=True)
        out[q] = (d, _raw(d), loaded, qdict)
    return out


@pytest.mark.parametrize("quantize", ["fp8_fp4", "fp8"])
def test_quantised_file_layout(model, exports, quantize):
    d, raw, _, _ = exports[quantize]
    orig = _by_file_name(model)
    weights = {k for k in raw if not k.endswith(".scale")}
    assert weights == set(orig)
    fp8 = sorted(k for k in orig if FP8_NAMES.match(k))
    experts = sorted(k for k in orig if EXPERT_NAMES.match(k))
    assert len(fp8) == 5 * 5 + 2 + 5 * 3 + 2  # (4 layers + MTP) x (5 attn + 3 shared), 2 indexer wq_b, e/h_proj
    assert len(experts) == 5 * 8 * 3  # 4 layers + MTP, 8 experts, w1/w2/w3
    assert {k[: -len(".scale")] + ".weight" for k in raw if k.endswith(".scale")} == set(fp8) | set(experts)
    for k in fp8:
        assert raw[k].dtype == ml_dtypes.float8_e4m3fn, k
        assert raw[k[: -len(".weight")] + ".scale"].dtype == ml_dtypes.float8_e8m0fnu
        assert raw[k[: -len(".weight")] + ".scale"].shape == tuple(-(-n // 128) for n in orig[k].shape)
    for k in experts:
        w, s = raw[k], raw[k[: -len(".weight")] + ".scale"]
        out_, in_ = orig[k].shape
        if quantize == "fp8_fp4":
            assert w.dtype == np.int8 and w.shape == (out_, in_ // 2), k
            assert s.dtype == ml_dtypes.float8_e8m0fnu and s.shape == (out_, in_ // 32)
        else:
            assert w.dtype == ml_dtypes.float8_e4m3fn and w.shape == (out_, in_)
    # everything else is stored as it was (float32 here), e.g. the compressor and router weights
    for k in ("layers.1.attn.compressor.wkv.weight", "layers.1.attn.indexer.weights_proj.weight",
              "layers.1.ffn.gate.weight", "embed.weight", "head.weight", "layers.1.hc_attn_fn"):
        assert raw[k].dtype == np.float32
        np.testing.assert_array_equal(raw[k], orig[k])
    assert json.loads((d / "config.json").read_text())["expert_dtype"] == ("fp4" if quantize == "fp8_fp4" else "fp8")


@pytest.mark.parametrize("quantize", ["fp8_fp4", "fp8"])
def test_loader_dequantises_exactly_like_the_reference(exports, quantize):
    _, raw, loaded, _ = exports[quantize]
    got = _by_file_name(loaded)
    n_fp4 = n_fp8 = 0
    for k, w in raw.items():
        if k.endswith(".scale"):
            continue
        sc = k[: -len(".weight")] + ".scale"
        if sc not in raw:
            np.testing.assert_array_equal(got[k], w.astype(got[k].dtype), err_msg=k)
            continue
        sbytes = raw[sc].view(np.uint8)
        if w.dtype == np.int8:
            ref = ref_dequant_fp4(w, sbytes)
            n_fp4 += 1
        else:
            ref = ref_dequant_fp8(w, sbytes)
            n_fp8 += 1
        assert got[k].dtype == np.float32
        np.testing.assert_array_equal(got[k], ref, err_msg=k)
    assert (n_fp4, n_fp8) == ((120, 44) if quantize == "fp8_fp4" else (0, 164))


@pytest.mark.parametrize("quantize", ["fp8_fp4", "fp8"])
def test_dequantised_weights_within_format_bound(model, exports, quantize):
    """Power-of-two scales s <= 2 amax / fmax; round to nearest:
    FP8 e4m3 (3 mantissa bits, min normal 2^-6, subnormal step 2^-9): |err| <= 2^-4 |w| + 2^-10 s;
    FP4 e2m1 (steps 0.5 below 2, 1 in [2, 4), 2 in [4, 6]): |err| <= max(s / 4, |w| / 4)."""
    orig, got = _by_file_name(model), _by_file_name(exports[quantize][2])
    worst = {}
    for k, w in orig.items():
        if not (FP8_NAMES.match(k) or EXPERT_NAMES.match(k)):
            continue
        err = np.abs(got[k] - w)
        if quantize == "fp8_fp4" and EXPERT_NAMES.match(k):
            amax = np.repeat(np.abs(w).reshape(w.shape[0], -1, 32).max(-1), 32, axis=1)
            bound = np.maximum(2 * amax / 6 / 4, np.abs(w) / 4)
        else:
            amax = np.abs(w).max()  # every tiny tensor is a single 128x128 block
            bound = 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * (2 * amax / 448)
        assert (err <= bound * (1 + 1e-6)).all(), k
        worst[k] = (err / np.maximum(np.abs(w), 1e-12)).max()
        assert err.max() > 0, f"{k}: exactly representable? the test would be vacuous"
    assert len(worst) == 164


@pytest.mark.parametrize("quantize", ["fp8_fp4", "fp8"])
def test_keep_quantized_returns_the_stored_tensors(exports, quantize):
    _, raw, loaded, qdict = exports[quantize]
    stored = {k[: -len(".scale")] + ".weight" for k in raw if k.endswith(".scale")}
    assert set(qdict) == stored
    got = _by_file_name(loaded)
    for k, qt in qdict.items():
        assert isinstance(qt, QuantizedTensor)
        assert qt.shape == got[k].shape
        sbytes = raw[k[: -len(".weight")] + ".scale"].view(np.uint8)
        np.testing.assert_array_equal(np.asarray(qt.scale, np.float32), 2.0 ** (sbytes.astype(np.float64) - 127))
        if raw[k].dtype == np.int8:
            assert (qt.kind, qt.fmt, qt.block) == ("fp4", "e2m1", (1, 32))
        else:
            assert (qt.kind, qt.fmt, qt.block) == ("fp8", "e4m3fn", (128, 128))
        np.testing.assert_array_equal(np.asarray(qt.q).view(np.uint8), raw[k].view(np.uint8))
        np.testing.assert_array_equal(np.asarray(qt.dequantize(jnp.float32)), got[k])


def test_unquantised_export_round_trips_exactly(model, tmp_path):
    d = save_hf_checkpoint(model, tmp_path / "plain")
    loaded = load_hf_checkpoint(d, dtype=jnp.float32)
    a, b = _by_file_name(model), _by_file_name(loaded)
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # the config comes back too (expert_dtype aside: see test_config.py::test_to_hf_dict_round_trip_exact)
    assert dataclasses.replace(DSV4Config.from_hf(d), expert_dtype=None) == model.config


def test_bf16_load(exports):
    d, _, loaded32, _ = exports["fp8_fp4"]
    loaded = load_hf_checkpoint(d, dtype=jnp.bfloat16)
    assert loaded.layers[1].attn.wq_a.weight[...].dtype == jnp.bfloat16
    assert loaded.layers[1].hc_attn_fn[...].dtype == jnp.float32  # mHC, sinks, ape, bias stay f32
    assert loaded.layers[1].ffn.gate.bias[...].dtype == jnp.float32
    # FP4 values times power-of-two scales are exact in bf16
    np.testing.assert_array_equal(np.asarray(loaded.layers[1].ffn.experts.w1[...], np.float32),
                                  np.asarray(loaded32.layers[1].ffn.experts.w1[...]))


# ------------------------------------------------------------------------------- (b) transformers names


@pytest.fixture(scope="module")
def hf(cfg):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_ref import hf_model

    return hf_model(cfg, seed=0)


def test_transformers_state_dict_names_load(cfg, hf, tmp_path):
    import torch
    from safetensors.torch import save_file

    sd = hf.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd and "model.layers.0.self_attn.q_a_proj.weight" in sd
    native = tmp_path / "native"
    native.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, native / "model.safetensors")
    hf.config.to_json_file(native / "config.json")
    official = tmp_path / "official"
    hf.save_pretrained(official)
    a = load_hf_checkpoint(native, dtype=jnp.float32)
    b = load_hf_checkpoint(official, dtype=jnp.float32)
    ta, tb = _by_file_name(a), _by_file_name(b)
    assert set(ta) == set(tb) and len(ta) > 100
    for k in ta:
        np.testing.assert_array_equal(ta[k], tb[k], err_msg=k)
    # against the torch tensors themselves: fused experts split as transformers splits them (gate, up)
    i = cfg.moe_intermediate_size
    gu = sd["model.layers.2.mlp.experts.gate_up_proj"].numpy()  # [E, 2I, D]
    np.testing.assert_array_equal(np.asarray(a.layers[2].ffn.experts.w1[...]), gu[:, :i])
    np.testing.assert_array_equal(np.asarray(a.layers[2].ffn.experts.w3[...]), gu[:, i:])
    np.testing.assert_array_equal(np.asarray(a.layers[2].ffn.experts.w2[...]),
                                  sd["model.layers.2.mlp.experts.down_proj"].numpy())
    np.testing.assert_array_equal(np.asarray(a.layers[1].attn.attn_sink[...]),
                                  sd["model.layers.1.self_attn.sinks"].numpy())
    np.testing.assert_array_equal(np.asarray(a.layers[3].ffn.gate.bias[...]),
                                  sd["model.layers.3.mlp.gate.e_score_correction_bias"].numpy())
    np.testing.assert_array_equal(np.asarray(a.layers[0].ffn.gate.tid2eid[...]),
                                  sd["model.layers.0.mlp.gate.tid2eid"].numpy())
    np.testing.assert_array_equal(np.asarray(a.layers[1].attn.kv_norm.weight[...]),
                                  sd["model.layers.1.self_attn.kv_norm.weight"].numpy())
    np.testing.assert_array_equal(np.asarray(a.layers[1].attn.compressor.norm.weight[...]),
                                  sd["model.layers.1.self_attn.compressor.kv_norm.weight"].numpy())
    assert sd["model.layers.1.self_attn.kv_norm.weight"].dtype == torch.float32
    # and our own official-named export of it loads to the same values
    c = load_hf_checkpoint(save_hf_checkpoint(a, tmp_path / "ours"), dtype=jnp.float32)
    for k, v in _by_file_name(c).items():
        np.testing.assert_array_equal(v, ta[k], err_msg=k)


# ------------------------------------------------------------------------------------------- (c) errors


@pytest.fixture(scope="module")
def plain_dir(model, tmp_path_factory):
    return save_hf_checkpoint(model, tmp_path_factory.mktemp("plain") / "ckpt")


def _rewrite(src, dst, edit):
    """Copy checkpoint `src` to `dst` with `edit(dict of tensors)` applied."""
    tensors = _raw(src)
    edit(tensors)
    save_sharded_checkpoint(dst, tensors.items())
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_wrong_shape_names_tensor_and_shapes(plain_dir, tmp_path):
    def transpose(t):
        t["layers.1.attn.wq_a.weight"] = np.ascontiguousarray(t["layers.1.attn.wq_a.weight"].T)

    d = _rewrite(plain_dir, tmp_path / "bad", transpose)
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wq_a\.weight.*\[32, 64\].*\[64, 32\]"):
        load_hf_checkpoint(d, dtype=jnp.float32)


def test_wrong_expert_shape(plain_dir, tmp_path):
    def cut(t):
        t["layers.2.ffn.experts.3.w2.weight"] = t["layers.2.ffn.experts.3.w2.weight"][:, :16].copy()

    d = _rewrite(plain_dir, tmp_path / "bad", cut)
    with pytest.raises(CheckpointError, match=r"layers\.2\.ffn\.experts\.3\.w2\.weight.*\[64, 32\].*\[64, 16\]"):
        load_hf_checkpoint(d, dtype=jnp.float32)


def test_missing_and_unexpected_tensors_are_listed(plain_dir, tmp_path):
    def drop(t):
        del t["layers.1.attn.indexer.wq_b.weight"], t["norm.weight"]

    with pytest.raises(CheckpointError, match="missing 2") as e:
        load_hf_checkpoint(_rewrite(plain_dir, tmp_path / "missing", drop), dtype=jnp.float32)
    assert "layers.1.attn.indexer.wq_b.weight" in str(e.value) and "'norm.weight'" in str(e.value)

    def add(t):
        t["layers.1.attn.bogus.weight"] = np.zeros((2, 2), np.float32)
        t["layers.9.attn.wq_a.weight"] = np.zeros((32, 64), np.float32)

    with pytest.raises(CheckpointError, match="unexpected 2") as e:
        load_hf_checkpoint(_rewrite(plain_dir, tmp_path / "extra", add), dtype=jnp.float32)
    assert "layers.1.attn.bogus.weight" in str(e.value) and "layers.9.attn.wq_a.weight" in str(e.value)


def test_non_finite_and_orphan_scale(plain_dir, tmp_path):
    def nan(t):
        t["layers.1.attn.attn_sink"] = np.array([0.0, np.nan, 0.0, 0.0], np.float32)

    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.attn_sink.*NaN"):
        load_hf_checkpoint(_rewrite(plain_dir, tmp_path / "nan", nan), dtype=jnp.float32)

    def orphan(t):
        t["layers.1.attn.nothing.scale"] = np.ones((1, 1), ml_dtypes.float8_e8m0fnu)

    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.nothing"):
        load_hf_checkpoint(_rewrite(plain_dir, tmp_path / "orphan", orphan), dtype=jnp.float32)


# --------------------------------------------------------------------------------------- (d) atomic export


def test_export_is_atomic(model, tmp_path, monkeypatch):
    target = tmp_path / "export"
    real = safetensors_io.save_safetensors
    calls = []

    def failing(path, tensors, metadata=None):
        assert not target.exists(), "target visible before the export completed"
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full (simulated)")
        return real(path, tensors, metadata)

    monkeypatch.setattr(safetensors_io, "save_safetensors", failing)
    with pytest.raises(OSError, match="simulated"):
        save_hf_checkpoint(model, target, max_shard_bytes=16 * 1024)
    assert len(calls) == 3
    assert not target.exists()
    assert list(tmp_path.iterdir()) == [], f"leftovers: {list(tmp_path.iterdir())}"

    # a failed overwrite leaves the old checkpoint untouched
    monkeypatch.setattr(safetensors_io, "save_safetensors", real)
    save_hf_checkpoint(model, target, max_shard_bytes=16 * 1024)
    before = sorted(p.name for p in target.iterdir())
    assert len([n for n in before if n.endswith(".safetensors")]) > 3
    calls.clear()
    monkeypatch.setattr(safetensors_io, "save_safetensors",
                        lambda *a, **k: (_ for _ in ()).throw(OSError("disk full (simulated)")))
    with pytest.raises(OSError):
        save_hf_checkpoint(model, target, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_existing_target_needs_overwrite(model, tmp_path):
    target = tmp_path / "export"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="export"):
        save_hf_checkpoint(model, target)
    assert (target / "keep.txt").read_text() == "x"
    save_hf_checkpoint(model, target, overwrite=True)
    assert not (target / "keep.txt").exists() and (target / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


# ------------------------------------------------------------------------------------------ (e) name table


NAMES = [
    # transformers 5.23 module names (spec §9.3)
    ("model.embed_tokens.weight", "embed.weight"),
    ("lm_head.weight", "head.weight"),
    ("model.norm.weight", "norm.weight"),
    ("model.hc_head.hc_fn", "hc_head_fn"),
    ("model.hc_head.hc_base", "hc_head_base"),
    ("model.hc_head.hc_scale", "hc_head_scale"),
    ("model.layers.0.input_layernorm.weight", "layers.0.attn_norm.weight"),
    ("model.layers.0.post_attention_layernorm.weight", "layers.0.ffn_norm.weight"),
    ("model.layers.7.attn_hc.fn", "layers.7.hc_attn_fn"),
    ("model.layers.7.attn_hc.base", "layers.7.hc_attn_base"),
    ("model.layers.7.ffn_hc.scale", "layers.7.hc_ffn_scale"),
    ("model.layers.3.self_attn.sinks", "layers.3.attn.attn_sink"),
    ("model.layers.3.self_attn.q_a_proj.weight", "layers.3.attn.wq_a.weight"),
    ("model.layers.3.self_attn.q_a_norm.weight", "layers.3.attn.q_norm.weight"),
    ("model.layers.3.self_attn.q_b_proj.weight", "layers.3.attn.wq_b.weight"),
    ("model.layers.3.self_attn.kv_proj.weight", "layers.3.attn.wkv.weight"),
    ("model.layers.3.self_attn.kv_norm.weight", "layers.3.attn.kv_norm.weight"),
    ("model.layers.3.self_attn.o_a_proj.weight", "layers.3.attn.wo_a.weight"),
    ("model.layers.3.self_attn.o_b_proj.weight", "layers.3.attn.wo_b.weight"),
    ("model.layers.3.self_attn.compressor.kv_proj.weight", "layers.3.attn.compressor.wkv.weight"),
    ("model.layers.3.self_attn.compressor.gate_proj.weight", "layers.3.attn.compressor.wgate.weight"),
    ("model.layers.3.self_attn.compressor.position_bias", "layers.3.attn.compressor.ape"),
    ("model.layers.3.self_attn.compressor.kv_norm.weight", "layers.3.attn.compressor.norm.weight"),
    ("model.layers.2.self_attn.compressor.indexer.kv_proj.weight", "layers.2.attn.indexer.compressor.wkv.weight"),
    ("model.layers.2.self_attn.compressor.indexer.gate_proj.weight", "layers.2.attn.indexer.compressor.wgate.weight"),
    ("model.layers.2.self_attn.compressor.indexer.position_bias", "layers.2.attn.indexer.compressor.ape"),
    ("model.layers.2.self_attn.compressor.indexer.kv_norm.weight", "layers.2.attn.indexer.compressor.norm.weight"),
    ("model.layers.2.self_attn.compressor.indexer.q_b_proj.weight", "layers.2.attn.indexer.wq_b.weight"),
    ("model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight",
     "layers.2.attn.indexer.weights_proj.weight"),
    ("model.layers.4.mlp.gate.weight", "layers.4.ffn.gate.weight"),
    ("model.layers.4.mlp.gate.e_score_correction_bias", "layers.4.ffn.gate.bias"),
    ("model.layers.0.mlp.gate.tid2eid", "layers.0.ffn.gate.tid2eid"),
    ("model.layers.4.mlp.experts.gate_up_proj", "layers.4.ffn.experts.gate_up_proj"),
    ("model.layers.4.mlp.experts.down_proj", "layers.4.ffn.experts.down_proj"),
    ("model.layers.4.mlp.shared_experts.gate_proj.weight", "layers.4.ffn.shared_experts.w1.weight"),
    ("model.layers.4.mlp.shared_experts.up_proj.weight", "layers.4.ffn.shared_experts.w3.weight"),
    ("model.layers.4.mlp.shared_experts.down_proj.weight", "layers.4.ffn.shared_experts.w2.weight"),
    # FP8 scales: transformers' `weight_scale_inv` is the official `.scale` (a multiplier in both)
    ("model.layers.3.self_attn.q_a_proj.weight_scale_inv", "layers.3.attn.wq_a.scale"),
    ("model.layers.4.mlp.shared_experts.down_proj.weight_scale_inv", "layers.4.ffn.shared_experts.w2.scale"),
    # what transformers' save_pretrained writes (official names behind a `model.` prefix, `attn.norm` = kv_norm)
    ("model.layers.1.attn.norm.weight", "layers.1.attn.kv_norm.weight"),
    ("model.layers.1.attn.wq_a.weight", "layers.1.attn.wq_a.weight"),
    ("model.layers.1.ffn.experts.5.w2.weight", "layers.1.ffn.experts.5.w2.weight"),
    ("model.layers.1.attn.compressor.norm.weight", "layers.1.attn.compressor.norm.weight"),
    # official names pass through unchanged
    ("layers.3.attn.wq_a.weight", "layers.3.attn.wq_a.weight"),
    ("layers.3.attn.wq_a.scale", "layers.3.attn.wq_a.scale"),
    ("layers.3.attn.kv_norm.weight", "layers.3.attn.kv_norm.weight"),
    ("layers.3.ffn.experts.17.w1.weight", "layers.3.ffn.experts.17.w1.weight"),
    ("mtp.0.e_proj.weight", "mtp.0.e_proj.weight"),
    ("head.weight", "head.weight"),
    ("embed.weight", "embed.weight"),
    ("something.else", "something.else"),
]


@pytest.mark.parametrize("hf_name, official", NAMES)
def test_hf_to_official(hf_name, official):
    assert hf_to_official(hf_name) == official


def test_every_transformers_tensor_has_a_home(cfg, hf):
    """Every tensor transformers holds for the tiny model maps onto a name our loader expects."""
    ours = set(_by_file_name(abstract_model(
        DSV4Config.tiny(num_nextn_predict_layers=0, compress_ratios=(0, 4, 8, 4)))))
    fused = {f"layers.{i}.ffn.experts.{w}" for i in range(cfg.num_hidden_layers) for w in ("gate_up_proj", "down_proj")}
    mapped = {hf_to_official(k) for k in hf.state_dict()}
    assert mapped - fused == {k for k in ours if ".ffn.experts." not in k}
    assert mapped & fused == fused
