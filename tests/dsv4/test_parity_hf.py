"""Numerical parity with transformers 5.23 `DeepseekV4ForCausalLM` (the executable reference), fp32.

The tiny config activates every component: sliding, CSA (m=4, 16 indexer heads, top-3 < #entries), HCA (m=8),
a hash-routed layer with a random distinct-expert tid2eid, mHC, sinks, YaRN. Weights are randomised in
transformers (non-trivial sinks, ape, mHC base/scale, router bias, norm weights), saved with its own
`save_pretrained`, and loaded through `dsv4.load_hf_checkpoint`.
"""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dsv4 import DSV4Config, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from flax import nnx  # noqa: E402
from hf_ref import hf_logits, hf_model  # noqa: E402


@nnx.jit
def _logits(model, ids, mask=None):
    """Logits [B, S, V] of the full forward of `ids` [B, S] int32 (mask [B, S] or None), jitted: op by op, a
    forward of the tiny model costs several times the CPU of its compile."""
    return model(ids, attention_mask=mask).logits


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    cfg = DSV4Config.tiny()
    hf = hf_model(cfg, seed=0)
    d = tmp_path_factory.mktemp("hf_tiny")
    hf.save_pretrained(d)
    ours = load_hf_checkpoint(d, dtype=jnp.float32)
    return cfg, hf, ours


@pytest.mark.parametrize("seq", [37, 64])
def test_logits_match_transformers(pair, seq):
    cfg, hf, ours = pair
    ids = np.random.RandomState(seq).randint(0, cfg.vocab_size, (2, seq))
    ref = hf_logits(hf, ids)
    got = np.asarray(jax.jit(lambda i: ours(i).logits)(jnp.asarray(ids, jnp.int32)))
    delta = np.abs(got - ref).max()
    assert delta <= 1e-4, f"max |delta logits| = {delta:.3e} at S={seq}"
    # the comparison is not vacuous: logits vary across positions and vocabulary
    assert np.abs(ref).max() > 1.0 and ref.std() > 0.1


def test_greedy_continuation_matches_transformers(pair):
    import torch

    cfg, hf, ours = pair
    prompt = np.random.RandomState(7).randint(0, cfg.vocab_size, (1, 21))
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt), max_new_tokens=16, do_sample=False, use_cache=True,
                          pad_token_id=0, eos_token_id=None)[0, 21:].numpy()
    # One compile: a fixed-length buffer, right-padded with token 0, read at the current position. The model is
    # causal (window, complete compressed windows, indexer over visible entries, per-token MoE), so the padding
    # after the current position does not change its logits.
    n_prompt, n_new = prompt.shape[1], 16
    fwd = jax.jit(lambda ids, pos: jnp.argmax(ours(ids).logits[0, pos]))
    buf = np.zeros((1, n_prompt + n_new), np.int32)
    buf[:, :n_prompt] = prompt
    for cur in range(n_prompt, n_prompt + n_new):
        buf[0, cur] = int(fwd(jnp.asarray(buf), cur - 1))
    got = buf[0, n_prompt:]
    assert got.tolist() == ref.tolist()


def test_export_roundtrip_through_transformers(pair, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg, _, ours = pair
    out = save_hf_checkpoint(ours, tmp_path / "export")
    reloaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype="float32")
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    reloaded.config._attn_implementation = "eager"
    ids = np.random.RandomState(3).randint(0, cfg.vocab_size, (2, 37))
    ref = hf_logits(reloaded.eval(), ids)
    got = np.asarray(_logits(ours, jnp.asarray(ids, jnp.int32)))
    assert np.abs(got - ref).max() <= 1e-4


def test_transformers_mixes_left_padding_into_compressed_entries_we_do_not(pair):
    """transformers 5.23 pools left-pad tokens into its compressed entries; our model right-aligns rows."""
    cfg, hf, ours = pair
    rs = np.random.RandomState(11)
    row = rs.randint(2, cfg.vocab_size, (1, 32))
    pad = 5
    padded = np.concatenate([np.zeros((1, pad), row.dtype), row], axis=1)
    mask = np.concatenate([np.zeros((1, pad), np.int64), np.ones_like(row)], axis=1)
    alone = hf_logits(hf, row)[0]
    hf_padded = hf_logits(hf, padded, mask)[0, pad:]
    ours_alone = np.asarray(_logits(ours, jnp.asarray(row, jnp.int32)))[0]
    ours_padded = np.asarray(_logits(ours, jnp.asarray(padded, jnp.int32), jnp.asarray(mask)))[0, pad:]
    assert np.abs(ours_alone - alone).max() <= 1e-4
    assert np.abs(ours_padded - ours_alone).max() <= 1e-5
    assert np.abs(hf_padded - alone).max() > 1e-2, "transformers is expected to be wrong under left padding"
