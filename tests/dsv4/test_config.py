"""Tests for dsv4/config.py: `DSV4Config.from_hf` on the official Flash config and on transformers' own keys,
`to_hf_dict` round trips, arbitrary compression ratios, and the errors (each naming the field / key / path).

The official Flash `config.json` below is written out from the spec (docs/dsv4-architecture.md §2.1),
not from `DSV4Config`, so the comparison is independent. The transformers dict comes from
`transformers.DeepseekV4Config(...).to_dict()` (5.23), i.e. exactly what its `save_pretrained` writes.
Run: .venv/bin/python -m pytest -q tests/dsv4/test_config.py
"""

import dataclasses
import json
import logging

import pytest

from dsv4 import ConfigError, DSV4Config, abstract_model
from dsv4.config import CSA, HCA, SLIDING

# The shipped DeepSeek-V4-Flash config.json (spec §2.1), key by key.
FLASH_OFFICIAL = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0],  # 44 entries: 43 layers + the MTP layer
    "compress_rope_theta": 160000,
    "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "num_hash_layers": 3,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "initializer_range": 0.02,
    "expert_dtype": "fp4",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "transformers_version": "4.57.1",
}


def _diff(a: DSV4Config, b: DSV4Config) -> dict:
    """Fields that differ: {name: (a value, b value)} (empty = equal field by field)."""
    return {f.name: (getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
            if getattr(a, f.name) != getattr(b, f.name)}


def _flash(**changes) -> dict:
    d = json.loads(json.dumps(FLASH_OFFICIAL))  # deep copy
    d.update(changes)
    return d


# ------------------------------------------------------------------------------------------------ (a) Flash


def test_official_flash_config_equals_preset():
    got = DSV4Config.from_hf(_flash())
    assert _diff(got, DSV4Config.flash()) == {}
    assert got == DSV4Config.flash()
    assert len(got.compress_ratios) == 44 and got.compress_ratios[-1] == 0
    assert got.rope_scaling.factor == 16.0 and got.rope_scaling.original_max_position_embeddings == 65536
    assert got.quantization_config["weight_block_size"] == [128, 128]


def test_flash_layer_schedule():
    cfg = DSV4Config.from_hf(_flash())
    kinds = cfg.layer_kinds
    assert len(kinds) == 43
    assert kinds[:2] == (SLIDING, SLIDING)
    assert all(kinds[i] == CSA for i in range(2, 43, 2))  # 21 even layers 2..42
    assert all(kinds[i] == HCA for i in range(3, 43, 2))  # 20 odd layers 3..41
    assert (kinds.count(SLIDING), kinds.count(CSA), kinds.count(HCA)) == (2, 21, 20)
    assert [cfg.compress_ratios[i] for i in (2, 3, 41, 42)] == [4, 128, 128, 4]
    assert cfg.layer_kind(43) == SLIDING  # the MTP layer
    assert [cfg.is_hash_layer(i) for i in range(4)] == [True, True, True, False]


# ------------------------------------------------------------------------------- (b) transformers' own keys


def _transformers_tiny_dict() -> dict:
    """What transformers 5.23 writes for the tiny config: layer_types / compress_rates / mlp_layer_types and
    rope_parameters nested as {main, compress} (transformers nests the flat yarn dict itself)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV4Config(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        index_n_heads=16, index_head_dim=16, index_topk=3, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=32, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32.0, "beta_slow": 1.0},
        max_position_embeddings=1048576, dtype="float32",
    )
    return json.loads(hf.to_json_string())


def test_transformers_native_keys_equal_tiny():
    d = _transformers_tiny_dict()
    # the dict really is in transformers' schema (no official compress_ratios / num_hash_layers / rope_scaling)
    assert "compress_ratios" not in d and "num_hash_layers" not in d and "rope_scaling" not in d
    assert set(d["rope_parameters"]) == {"main", "compress"}
    assert d["rope_parameters"]["compress"]["rope_type"] == "yarn"
    assert d["rope_parameters"]["compress"]["attention_factor"] == 1.0
    got = DSV4Config.from_hf(d)
    tiny = DSV4Config.tiny()
    # `expert_dtype` is storage metadata that transformers does not write (see the test below)
    assert _diff(got, dataclasses.replace(tiny, expert_dtype=got.expert_dtype)) == {}
    assert got.compress_ratios == (0, 4, 8, 4, 0)
    assert got.layer_kinds == (SLIDING, CSA, HCA, CSA)
    assert got.num_hash_layers == 1 and got.csa_compress_ratio == 4
    assert (got.rope_theta, got.compress_rope_theta) == (10000.0, 160000.0)


def test_transformers_dict_has_no_fp4_experts():
    """A dict without `expert_dtype` (transformers, our unquantised export) has no FP4 experts (issue 10)."""
    assert DSV4Config.from_hf(_transformers_tiny_dict()).expert_dtype is None


# ---------------------------------------------------------------------------------------- (c) round trips


@pytest.mark.parametrize("name", ["flash"])
def test_to_hf_dict_round_trip_quantized(name):
    cfg = getattr(DSV4Config, name)()
    d = json.loads(json.dumps(cfg.to_hf_dict(quantized=True)))  # through JSON, as on disk
    assert _diff(DSV4Config.from_hf(d), cfg) == {}


@pytest.mark.parametrize("name", ["tiny", "small", "flash"])
def test_to_hf_dict_round_trip_architecture(name):
    """Every field that shapes the model survives to_hf_dict -> JSON -> from_hf."""
    cfg = getattr(DSV4Config, name)()
    got = DSV4Config.from_hf(json.loads(json.dumps(cfg.to_hf_dict())))
    storage = {"expert_dtype", "quantization_config"}  # to_hf_dict() describes an unquantised export
    assert {k: v for k, v in _diff(got, cfg).items() if k not in storage} == {}
    assert got.layer_kinds == cfg.layer_kinds and got.compress_ratios == cfg.compress_ratios


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_to_hf_dict_round_trip_exact(name):
    cfg = getattr(DSV4Config, name)()
    for quantized in (False, True):
        assert _diff(DSV4Config.from_hf(json.loads(json.dumps(cfg.to_hf_dict(quantized=quantized)))), cfg) == {}


def test_to_hf_dict_is_loadable_by_transformers():
    transformers = pytest.importorskip("transformers")
    d = DSV4Config.tiny().to_hf_dict()
    hf = transformers.DeepseekV4Config(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert hf.layer_types == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                              "compressed_sparse_attention"]
    assert hf.compress_rates == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
    assert hf.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"]
    assert hf.qk_rope_head_dim == 8


# ------------------------------------------------------------------------------------- (d) arbitrary ratios


def test_arbitrary_hca_ratio_in_official_list():
    ratios = [0, 0] + [4, 16] * 20 + [4] + [0]
    cfg = DSV4Config.from_hf(_flash(compress_ratios=ratios))
    assert cfg.compress_ratios == tuple(ratios)
    assert cfg.layer_kinds == DSV4Config.flash().layer_kinds
    assert cfg.layer_kind(3) == HCA and cfg.compress_ratios[3] == 16
    # the model built from it has ratio-16 HCA compressors (ape has one row per window slot); no memory used
    small = DSV4Config.from_hf({**DSV4Config.tiny().to_hf_dict(), "layer_types": None,
                                "compress_ratios": [0, 4, 16, 4, 0]})
    model = abstract_model(small)
    assert model.layers[2].attn.ratio == 16
    assert model.layers[2].attn.compressor.ape.shape == (16, small.head_dim)
    assert model.layers[1].attn.compressor.ape.shape == (4, 2 * small.head_dim)  # CSA: overlap, width 2d


def test_csa_ratio_other_than_4_via_compress_rates():
    d = {**DSV4Config.tiny().to_hf_dict(), "compress_rates": {"compressed_sparse_attention": 8,
                                                              "heavily_compressed_attention": 32}}
    cfg = DSV4Config.from_hf(d)
    assert cfg.csa_compress_ratio == 8
    assert cfg.compress_ratios == (0, 8, 32, 8, 0)
    assert cfg.layer_kinds == (SLIDING, CSA, HCA, CSA)


# ------------------------------------------------------------------------------------------- (e) errors


def test_unknown_keys_are_logged_by_name(caplog):
    with caplog.at_level(logging.WARNING, logger="dsv4.config"):
        DSV4Config.from_hf(_flash(frobnicate_level=3, zz_extra="x"))
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1, msgs
    assert "frobnicate_level" in msgs[0] and "zz_extra" in msgs[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dsv4.config"):
        DSV4Config.from_hf(_flash())  # the official file has nothing unknown
        DSV4Config.from_hf(_transformers_tiny_dict())  # neither has transformers' own dict
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim"])
def test_missing_required_key(key):
    d = _flash()
    del d[key]
    with pytest.raises(ConfigError, match=key):
        DSV4Config.from_hf(d)


@pytest.mark.parametrize("changes, field", [
    (dict(o_groups=3), "o_groups"),
    (dict(num_experts_per_tok=300), "num_experts_per_tok"),
    (dict(compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0, 0]), "compress_ratios"),  # 45 entries
    (dict(compress_ratios=[0, 0] + [4, 128] * 20), "compress_ratios"),  # 42 entries
    (dict(compress_ratios=[0, 0, -4] + [128, 4] * 20 + [0]), "compress_ratios"),  # negative
    (dict(compress_ratios=[0, 0] + [4, 128] * 20 + [4] + [4]), "compress_ratios"),  # MTP entry non-zero
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_key_value_heads=8), "num_key_value_heads"),
    (dict(qk_rope_head_dim=63), "qk_rope_head_dim"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
])
def test_impossible_values_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        DSV4Config.from_hf(_flash(**changes))


def test_official_list_without_mtp_entry_is_accepted():
    """43 entries (no MTP entry): the MTP layer is implied sliding, as in transformers' truncated list."""
    cfg = DSV4Config.from_hf(_flash(compress_ratios=[0, 0] + [4, 128] * 20 + [4]))
    assert cfg.compress_ratios == DSV4Config.flash().compress_ratios


def test_ratio_error_messages_say_what_is_wrong():
    with pytest.raises(ConfigError, match=r"compress_ratios has 45 entries.*44"):
        DSV4Config.from_hf(_flash(compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0, 0]))
    with pytest.raises(ConfigError, match=r"compress_ratios entries must be >= 0"):
        DSV4Config.from_hf(_flash(compress_ratios=[0, 0, -4] + [128, 4] * 20 + [0]))
    with pytest.raises(ConfigError, match=r"compress_ratios: the MTP entries"):
        DSV4Config.from_hf(_flash(compress_ratios=[0, 0] + [4, 128] * 20 + [4, 4]))
    with pytest.raises(ConfigError, match=r"num_experts_per_tok=7 exceeds n_routed_experts=6"):
        DSV4Config.from_hf(_flash(num_experts_per_tok=7, n_routed_experts=6))
    with pytest.raises(ConfigError, match=r"o_groups=3 must divide num_attention_heads=64"):
        DSV4Config.from_hf(_flash(o_groups=3))


def test_bad_layer_types_name_the_entry():
    d = DSV4Config.tiny().to_hf_dict()
    d["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    with pytest.raises(ConfigError, match=r"layer_types\[1\]='full_attention'"):
        DSV4Config.from_hf(d)
    d["layer_types"] = ["sliding_attention"] * 3
    with pytest.raises(ConfigError, match="layer_types has 3 entries"):
        DSV4Config.from_hf(d)


# ----------------------------------------------------------------------------------------------- files


def test_directory_and_file_paths(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FLASH_OFFICIAL))
    assert DSV4Config.from_hf(tmp_path) == DSV4Config.flash()
    assert DSV4Config.from_hf(str(tmp_path / "config.json")) == DSV4Config.flash()
    other = tmp_path / "flash_config.json"
    other.write_text(json.dumps(FLASH_OFFICIAL))
    assert DSV4Config.from_hf(other) == DSV4Config.flash()


def test_bad_json_and_missing_file_name_the_path(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text('{"vocab_size": 256,')
    with pytest.raises(ConfigError, match="broken.json"):
        DSV4Config.from_hf(bad)
    with pytest.raises(ConfigError, match="nowhere"):
        DSV4Config.from_hf(tmp_path / "nowhere")
    notobj = tmp_path / "list.json"
    notobj.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="list.json"):
        DSV4Config.from_hf(notobj)
