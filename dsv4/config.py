"""DeepSeek-V4 model configuration: every field of the official `config.json`, presets, HF conversion.

`DSV4Config` is a frozen, keyword-only dataclass whose field names are exactly those of the released
DeepSeek-V4-Flash `config.json` (docs/dsv4-architecture.md §2.1). The per-layer schedule is the
official `compress_ratios` list: one entry per main layer plus one per MTP layer, 0 = sliding window only,
`csa_compress_ratio` (4) = Compressed Sparse Attention (overlapping windows + lightning indexer), any other
positive ratio = Heavily Compressed Attention. `from_hf` also reads transformers' native keys
(`layer_types`, `compress_rates`, `mlp_layer_types`), which is the only way to express a CSA ratio other than 4.

Presets: `flash()` (the released Flash config), `tiny()` (every component active, fast on CPU, §11 of the spec),
`small()` (~85M parameters, for CPU benchmarks).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from typing import Any, Mapping

log = logging.getLogger(__name__)

SLIDING, CSA, HCA = "sliding", "csa", "hca"
HF_LAYER_TYPES = {
    SLIDING: "sliding_attention",
    CSA: "compressed_sparse_attention",
    HCA: "heavily_compressed_attention",
}
_FROM_HF_LAYER_TYPE = {v: k for k, v in HF_LAYER_TYPES.items()}


class ConfigError(ValueError):
    """An impossible, missing or unsupported configuration value; the message names the key."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """YaRN scaling of the compressed-layer RoPE (spec §5.2). Applied only to CSA/HCA layers; no mscale."""

    type: str = "yarn"
    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DSV4Config:
    """DeepSeek-V4 hyper-parameters (names = official `config.json` keys; spec §2.1).

    Raises:
        ConfigError: in `__post_init__` for impossible values, naming the field.
    """

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4, 0)
    compress_rope_theta: float = 160000.0
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = RopeScaling()
    max_position_embeddings: int = 1048576
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    num_hash_layers: int = 3
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_dropout: float = 0.0
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    initializer_range: float = 0.02
    expert_dtype: str | None = "fp4"
    quantization_config: Mapping[str, Any] | None = None
    torch_dtype: str = "bfloat16"
    use_cache: bool = True
    # Not in the official file: which positive ratio means CSA when reading an official `compress_ratios` list
    # (the official code: `overlap = compress_ratio == 4`).
    csa_compress_ratio: int = 4

    # ------------------------------------------------------------------ validation
    def __post_init__(self):
        pos = [
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim",
            "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim",
            "index_topk", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "hc_mult",
            "hc_sinkhorn_iters", "max_position_embeddings", "csa_compress_ratio",
        ]
        for k in pos:
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"config field {k!r} must be a positive integer, got {v!r}")
        for k in ("num_hash_layers", "n_shared_experts", "num_nextn_predict_layers"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 0:
                raise ConfigError(f"config field {k!r} must be a non-negative integer, got {v!r}")
        if self.num_key_value_heads != 1:
            raise ConfigError(f"num_key_value_heads must be 1 (one shared K=V head), got {self.num_key_value_heads}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and <= head_dim={self.head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(f"index_head_dim={self.index_head_dim} must be >= qk_rope_head_dim={self.qk_rope_head_dim}")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(f"o_groups={self.o_groups} must divide num_attention_heads={self.num_attention_heads}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts={self.n_routed_experts}"
            )
        if self.num_hash_layers > self.num_hidden_layers:
            raise ConfigError(f"num_hash_layers={self.num_hash_layers} exceeds num_hidden_layers={self.num_hidden_layers}")
        n_total = self.num_hidden_layers + self.num_nextn_predict_layers
        ratios = tuple(int(r) for r in self.compress_ratios)
        if len(ratios) == self.num_hidden_layers and self.num_nextn_predict_layers:
            ratios = ratios + (0,) * self.num_nextn_predict_layers  # the MTP entries are sliding layers
        if len(ratios) != n_total:
            raise ConfigError(
                f"compress_ratios has {len(self.compress_ratios)} entries; expected num_hidden_layers + "
                f"num_nextn_predict_layers = {n_total}"
            )
        if any(r < 0 for r in ratios):
            raise ConfigError(f"compress_ratios entries must be >= 0, got {list(ratios)}")
        if any(r for r in ratios[self.num_hidden_layers:]):
            raise ConfigError("compress_ratios: the MTP entries (after num_hidden_layers) must be 0 (sliding)")
        object.__setattr__(self, "compress_ratios", ratios)
        if self.scoring_func != "sqrtsoftplus":
            raise ConfigError(f"scoring_func={self.scoring_func!r} is not supported (only 'sqrtsoftplus')")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act={self.hidden_act!r} is not supported (only 'silu')")
        if self.tie_word_embeddings:
            raise ConfigError("tie_word_embeddings=True is not supported (DeepSeek-V4 has a separate head)")
        if self.attention_bias:
            raise ConfigError("attention_bias=True is not supported (DeepSeek-V4 has no biases)")
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", _rope_scaling_from_dict(self.rope_scaling))
        if self.rope_scaling is not None and self.rope_scaling.type != "yarn":
            raise ConfigError(f"rope_scaling.type={self.rope_scaling.type!r} is not supported (only 'yarn')")
        if self.quantization_config is not None and not isinstance(self.quantization_config, Mapping):
            raise ConfigError("quantization_config must be a mapping or None")

    def __hash__(self):
        return hash(json.dumps(self.to_dict(), sort_keys=True, default=str))

    # ------------------------------------------------------------------ derived schedule
    def layer_kind(self, i: int) -> str:
        """'sliding' | 'csa' | 'hca' for layer i (i >= num_hidden_layers are the MTP layers)."""
        r = self.compress_ratios[i]
        if r == 0:
            return SLIDING
        return CSA if r == self.csa_compress_ratio else HCA

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(self.layer_kind(i) for i in range(self.num_hidden_layers))

    def is_hash_layer(self, i: int) -> bool:
        return i < self.num_hash_layers

    @property
    def n_moe_layers(self) -> int:
        """Every main layer is MoE (no dense FFN layers); MTP layers are counted separately."""
        return self.num_hidden_layers

    @property
    def shared_intermediate_size(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    # ------------------------------------------------------------------ presets
    @classmethod
    def flash(cls) -> "DSV4Config":
        """The released DeepSeek-V4-Flash config (284.3B total / 13.3B active parameters)."""
        return cls(quantization_config={
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        })

    @classmethod
    def tiny(cls, **overrides) -> "DSV4Config":
        """Every component active (sliding, CSA m=4 with indexer top-3, HCA m=8, hash MoE, MTP); spec §11."""
        base = dict(
            vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
            qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
            compress_ratios=(0, 4, 8, 4, 0), index_n_heads=16, index_head_dim=16, index_topk=3,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
            num_hash_layers=1, expert_dtype=None, torch_dtype="float32",
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def small(cls, **overrides) -> "DSV4Config":
        """About 85M parameters, every component active: for CPU benchmarks."""
        base = dict(
            vocab_size=8192, hidden_size=512, num_hidden_layers=6, num_attention_heads=8, head_dim=64,
            qk_rope_head_dim=16, q_lora_rank=256, o_groups=2, o_lora_rank=256, sliding_window=64,
            compress_ratios=(0, 4, 16, 4, 16, 4, 0), index_n_heads=8, index_head_dim=32, index_topk=16,
            n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=512,
            num_hash_layers=1, expert_dtype=None, torch_dtype="bfloat16",
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def preset(cls, name: str) -> "DSV4Config":
        presets = {"flash": cls.flash, "tiny": cls.tiny, "small": cls.small}
        if name not in presets:
            raise ConfigError(f"unknown config preset {name!r}; expected one of {sorted(presets)} or a config.json path")
        return presets[name]()

    # ------------------------------------------------------------------ HF / official conversion
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> "DSV4Config":
        """Read an official DeepSeek-V4 `config.json` or a transformers `DeepseekV4Config` dict.

        Accepts a path to a file, a directory holding `config.json`, or a dict. Official keys (`compress_ratios`
        incl. the MTP entries, `num_hash_layers`, `rope_scaling`) and transformers' native keys (`layer_types`,
        `compress_rates`, `mlp_layer_types`, `rope_parameters`) are both understood.

        Raises:
            ConfigError: a required key is missing (named), a value is impossible, or the file is unreadable.
        Warns (logging): keys that are neither known nor ignorable, by name.
        """
        src = "<dict>"
        if not isinstance(path_or_dict, Mapping):
            p = os.fspath(path_or_dict)
            if os.path.isdir(p):
                p = os.path.join(p, "config.json")
            src = p
            try:
                with open(p) as f:
                    d = json.load(f)
            except FileNotFoundError as e:
                raise ConfigError(f"config file not found: {p}") from e
            except json.JSONDecodeError as e:
                raise ConfigError(f"{p}: not valid JSON ({e})") from e
        else:
            d = dict(path_or_dict)
        if not isinstance(d, Mapping):
            raise ConfigError(f"{src}: expected a JSON object")
        d = dict(d)
        fields = {f.name for f in dataclasses.fields(cls)}
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim")
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"{src}: missing required key(s) {missing}")
        kw: dict[str, Any] = {}
        n_layers = int(d["num_hidden_layers"])
        n_mtp = int(d.get("num_nextn_predict_layers", 1))
        # transformers' native schedule keys take precedence over the official list.
        layer_types = d.pop("layer_types", None)
        compress_rates = d.pop("compress_rates", None)
        mlp_layer_types = d.pop("mlp_layer_types", None)
        if layer_types is not None:
            rates = dict(compress_rates or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
            ratios = []
            for i, t in enumerate(layer_types[:n_layers]):
                if t not in _FROM_HF_LAYER_TYPE:
                    raise ConfigError(f"{src}: layer_types[{i}]={t!r} is not one of {sorted(_FROM_HF_LAYER_TYPE)}")
                ratios.append(0 if t == "sliding_attention" else int(rates[t]))
            if len(ratios) != n_layers:
                raise ConfigError(f"{src}: layer_types has {len(layer_types)} entries, num_hidden_layers={n_layers}")
            kw["compress_ratios"] = tuple(ratios) + (0,) * n_mtp
            kw["csa_compress_ratio"] = int(rates.get("compressed_sparse_attention", 4))
            csa_r, hca_r = kw["csa_compress_ratio"], rates.get("heavily_compressed_attention")
            if csa_r == hca_r and "heavily_compressed_attention" in layer_types:
                raise ConfigError(f"{src}: compress_rates: CSA and HCA ratios must differ, got {rates}")
            d.pop("compress_ratios", None)
        if mlp_layer_types is not None:
            n_hash = 0
            for t in mlp_layer_types:
                if t != "hash_moe":
                    break
                n_hash += 1
            if any(t == "hash_moe" for t in mlp_layer_types[n_hash:]):
                raise ConfigError(f"{src}: mlp_layer_types: hash_moe layers must come first, got {mlp_layer_types}")
            kw["num_hash_layers"] = n_hash
            d.pop("num_hash_layers", None)
        if "compress_rate_csa" in d:
            kw["csa_compress_ratio"] = int(d.pop("compress_rate_csa"))
        d.pop("compress_rate_hca", None)
        rp = d.pop("rope_parameters", None)
        if "rope_scaling" in d:
            rs = d.pop("rope_scaling")
            kw["rope_scaling"] = None if rs is None else _rope_scaling_from_dict(rs)
        elif isinstance(rp, Mapping) and isinstance(rp.get("compress"), Mapping):
            c = rp["compress"]
            if c.get("rope_type", c.get("type")) == "yarn":
                kw["rope_scaling"] = _rope_scaling_from_dict(c)
            else:
                kw["rope_scaling"] = None
            kw.setdefault("compress_rope_theta", c.get("rope_theta", 160000.0))
            if isinstance(rp.get("main"), Mapping):
                kw.setdefault("rope_theta", rp["main"].get("rope_theta", 10000.0))
        if "partial_rotary_factor" in d and "qk_rope_head_dim" not in d:
            prf = d.pop("partial_rotary_factor")
            if prf is not None:
                kw["qk_rope_head_dim"] = int(round(float(prf) * int(d["head_dim"])))
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = d["eos_token_id"][0] if d["eos_token_id"] else None
        if isinstance(d.get("compress_ratios"), list):
            d["compress_ratios"] = tuple(d["compress_ratios"])
        ignorable = {
            "architectures", "model_type", "transformers_version", "auto_map", "pad_token_id", "output_router_logits",
            "router_aux_loss_coef", "router_jitter_noise", "mlp_bias", "partial_rotary_factor", "dtype",
            "num_local_experts", "intermediate_size", "_name_or_path", "name_or_path", "return_dict",
            "output_hidden_states", "output_attentions", "chunk_size_feed_forward", "is_encoder_decoder",
            "id2label", "label2id", "problem_type", "tokenizer_class", "torchscript", "use_return_dict",
            "_attn_implementation_autoset", "keys_to_ignore_at_inference", "topk_group", "n_group",
        }
        unknown = sorted(k for k in d if k not in fields and k not in ignorable)
        if unknown:
            log.warning("%s: ignoring unknown DeepSeek-V4 config key(s): %s", src, ", ".join(unknown))
        # storage metadata: a file without the key (transformers, our unquantised exports) has no FP4 experts
        kw["expert_dtype"] = d.get("expert_dtype")
        if "dtype" in d and "torch_dtype" not in d and isinstance(d["dtype"], str):
            kw["torch_dtype"] = d["dtype"]
        for k, v in d.items():
            if k in fields and k not in kw:
                kw[k] = v
        try:
            return cls(**kw)
        except TypeError as e:
            raise ConfigError(f"{src}: {e}") from e

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        d["rope_scaling"] = self.rope_scaling.to_dict() if self.rope_scaling else None
        d["quantization_config"] = dict(self.quantization_config) if self.quantization_config else None
        return d

    def to_hf_dict(self, *, quantized: bool = False) -> dict:
        """The `config.json` we write: official keys plus transformers' native schedule keys.

        transformers folds the official `compress_ratios` only for ratios 0/4/128, so `layer_types`,
        `compress_rates` and `mlp_layer_types` are written too (they take precedence in transformers).

        Raises:
            ConfigError: HCA layers with different ratios (transformers' schema has one HCA ratio).
        """
        d = self.to_dict()
        d.pop("csa_compress_ratio")
        if not quantized:
            d.pop("quantization_config")
            d["expert_dtype"] = None
        d.pop("expert_dtype") if d.get("expert_dtype") is None else None
        hca = {self.compress_ratios[i] for i in range(self.num_hidden_layers) if self.layer_kind(i) == HCA}
        if len(hca) > 1:
            raise ConfigError(f"compress_ratios: HCA layers use several ratios {sorted(hca)}; transformers needs one")
        d["architectures"] = ["DeepseekV4ForCausalLM"]
        d["model_type"] = "deepseek_v4"
        d["layer_types"] = [HF_LAYER_TYPES[k] for k in self.layer_kinds]
        d["compress_rates"] = {
            "compressed_sparse_attention": self.csa_compress_ratio,
            "heavily_compressed_attention": hca.pop() if hca else 128,
        }
        d["mlp_layer_types"] = ["hash_moe"] * self.num_hash_layers + ["moe"] * (
            self.num_hidden_layers - self.num_hash_layers
        )
        if d["rope_scaling"] is not None:
            d["rope_scaling"] = {**d["rope_scaling"], "rope_type": "yarn"}
        return d


def _rope_scaling_from_dict(rs: Mapping[str, Any]) -> RopeScaling:
    t = rs.get("type", rs.get("rope_type", "yarn"))
    try:
        return RopeScaling(
            type=t,
            factor=float(rs.get("factor", 16.0)),
            original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 65536)),
            beta_fast=float(rs.get("beta_fast", 32.0)),
            beta_slow=float(rs.get("beta_slow", 1.0)),
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"rope_scaling: {e}") from e


def yarn_inv_freq(dim: int, base: float, scaling: RopeScaling | None) -> list[float]:
    """Per-pair inverse frequencies f'_i, i = 0..dim/2-1 (spec §5.2; transformers `_compute_yarn_parameters`).

    Without scaling f_i = base^(-2i/dim). With YaRN: lo/hi correction range from beta_fast/beta_slow, linear
    ramp between f_i (i <= lo) and f_i/factor (i >= hi). No attention (magnitude) factor.
    """
    f = [base ** (-(2 * i) / dim) for i in range(dim // 2)]
    if scaling is None:
        return f

    def corr(beta):
        return dim * math.log(scaling.original_max_position_embeddings / (beta * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(corr(scaling.beta_fast)), 0)
    hi = min(math.ceil(corr(scaling.beta_slow)), dim - 1)
    if lo == hi:
        hi += 0.001
    out = []
    for i, fi in enumerate(f):
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        out.append(fi * (1 - ramp) + (fi / scaling.factor) * ramp)
    return out
