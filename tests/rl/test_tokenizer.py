"""rl/data/tokenizer.py: a tokenizer without an EOS token is a one-line error that says how to name it (issue 28 §5).

    .venv/bin/python -m pytest -q tests/rl/test_tokenizer.py
"""

from __future__ import annotations

import json

import pytest

from rl.data.tokenizer import TokenizerError, load_tokenizer


def test_missing_eos_names_the_fix_and_the_fix_works(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[PAD]": 0, "[END]": 1, "[UNK]": 2, "one": 3, "two": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "--tokenizer" in msg and "pass eos_token=" not in msg
    assert str(tmp_path / "tokenizer_config.json") in msg and '"eos_token"' in msg and "names no eos_token" in msg
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[STOP]"}))
    with pytest.raises(TokenizerError, match="'\\[STOP\\]' is not in the vocabulary"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[END]"}))  # what the message says
    assert load_tokenizer(tmp_path).eos_id == 1
