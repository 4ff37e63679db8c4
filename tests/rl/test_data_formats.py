"""rl/data/formats.py + rl/data/prompts.py: the layouts users bring (veRL parquet with chat messages and
reward_model.ground_truth, Miles/slime jsonl, GSM8K), dotted field paths, chat-templated prompts, and prompts
longer than --max-prompt-len (drop and count, or fail naming the flag). Small files made here.

    .venv/bin/python -m pytest -q tests/rl/test_data_formats.py
"""

from __future__ import annotations

import json
import logging

import pytest

from rl.config.run import RunConfig
from rl.data.prompts import DataError, get_field
from rl.data.formats import build_datasets, load_prompt_dataset, plain_answer, resolve_format, resolve_reward_name
from rl.data.tokenizer import load_tokenizer

from chat_fixtures import BOS, make_chat_tokenizer, verl_records, write_parquet  # noqa: E402  (tests/rl on sys.path)

@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return make_chat_tokenizer(tmp_path_factory.mktemp("chat_tok"))


def cfg_for(path, chat_dir, **kw) -> RunConfig:
    return RunConfig(**kw, **{"data.dataset": str(path), "data.tokenizer": str(chat_dir / "tokenizer.json")})


def test_get_field_and_plain_answer():
    r = {"a.b": 1, "reward_model": {"ground_truth": "7"}, "prompt": [{"content": "hi"}]}
    assert get_field(r, "a.b") == 1 and get_field(r, "reward_model.ground_truth") == "7"
    assert get_field(r, "prompt.0.content") == "hi"
    for missing in ("reward_model.style", "prompt.3.content", "nope"):
        with pytest.raises(KeyError, match=missing):
            get_field(r, missing)
    assert plain_answer(204) == "204" and plain_answer(3.0) == "3" and plain_answer(" 0.5 ") == "0.5"
    with pytest.raises(ValueError):
        plain_answer(["1"])


def test_presets_resolve():
    assert resolve_format(RunConfig())[:2] == ("question", "answer")
    assert resolve_format(RunConfig(**{"data.data_format": "verl"}))[:2] == ("prompt", "reward_model.ground_truth")
    miles = RunConfig(**{"data.data_format": "miles", "data.answer_field": "answer"})
    assert resolve_format(miles)[:2] == ("prompt", "answer")
    assert resolve_reward_name(RunConfig(**{"data.data_format": "verl"})) == "dapo"
    assert resolve_reward_name(RunConfig(**{"data.data_format": "gsm8k"})) == "gsm8k"
    assert resolve_reward_name(RunConfig(**{"data.data_format": "verl", "data.reward": "aime"})) == "aime"


def test_verl_parquet_with_chat_template(tmp_path, chat_dir, caplog):
    path = write_parquet(tmp_path / "dapo.parquet", verl_records(6))
    cfg = cfg_for(path, chat_dir, **{"data.data_format": "verl", "data.apply_chat_template": True,
                                     "data.system_prompt": "Be careful.", "data.thinking": "off",
                                     "data.max_prompt_len": 512})
    tok = load_tokenizer(cfg.data.tokenizer)
    with caplog.at_level(logging.INFO, logger="dsv4rl"):
        train, ev = build_datasets(cfg, tok)
    assert ev is train and len(train) == 6 and train.references[:2] == ["3", "5"]
    text = train.first_text
    assert text.startswith(BOS + "Be careful.<｜User｜>Solve the following") and text.endswith("<｜Assistant｜></think>")
    assert train.prompt(0) == tok.encode(text)  # the template wrote BOS; none added twice
    assert train.prompt(0)[0] == tok.token_id(BOS) and train.prompt(0)[1] != tok.token_id(BOS)
    assert any("first prompt as the model sees it" in r.getMessage() and "Be careful." in r.getMessage()
               for r in caplog.records)


def test_miles_jsonl_string_prompt_with_instruction(tmp_path, chat_dir):
    path = tmp_path / "aime.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"Find {i}.", "label": i}) for i in (204, 7)) + "\n")
    cfg = cfg_for(path, chat_dir, **{"data.data_format": "miles", "data.apply_chat_template": True,
                                     "data.thinking": "on",
                                     "data.chat_template": "{prompt} Put the answer in \\boxed{{}}."})
    ds = load_prompt_dataset(str(path), load_tokenizer(cfg.data.tokenizer), cfg)
    assert ds.references == ["204", "7"]
    assert ds.first_text == BOS + "<｜User｜>Find 204. Put the answer in \\boxed{}.<｜Assistant｜><think>"
    aime = tmp_path / "aime24.jsonl"  # AIME-24/25 jsonl with their own names: the preset's fields overridden
    aime.write_text(json.dumps({"id": 60, "problem": "Find the remainder.", "answer": 204}) + "\n")
    cfg = cfg_for(aime, chat_dir, **{"data.data_format": "miles", "data.prompt_field": "problem",
                                     "data.answer_field": "answer", "data.apply_chat_template": True})
    ds = load_prompt_dataset(str(aime), load_tokenizer(cfg.data.tokenizer), cfg)
    assert ds.references == ["204"] and ds.first_text == BOS + "<｜User｜>Find the remainder.<｜Assistant｜></think>"


def test_gsm8k_default_unchanged(tmp_path, chat_dir):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"question": "What is 3 + 4?", "answer": "3 + 4 = 7 #### 7"}) + "\n")
    tok = load_tokenizer(chat_dir / "tokenizer.json")
    ds = load_prompt_dataset(str(path), tok, cfg_for(path, chat_dir, **{"data.chat_template": "Q: {prompt}\nA:"}))
    assert ds.references == ["7"] and ds.first_text == "Q: What is 3 + 4?\nA:"
    assert ds.prompt(0)[0] == tok.bos_id  # no chat template: BOS added as before


def test_list_prompt_needs_the_chat_template(tmp_path, chat_dir):
    path = write_parquet(tmp_path / "v.parquet", verl_records(2))
    with pytest.raises(DataError, match=r"v.parquet\[row 0\].*--apply-chat-template"):
        load_prompt_dataset(str(path), load_tokenizer(chat_dir / "tokenizer.json"),
                            cfg_for(path, chat_dir, **{"data.data_format": "verl"}))


def test_overlong_prompts_drop_or_fail(tmp_path, chat_dir, caplog):
    records = verl_records(4)
    records[1]["prompt"][0]["content"] += " padding" * 300
    records[3]["prompt"][0]["content"] += " padding" * 300
    path = write_parquet(tmp_path / "v.parquet", records)
    tok = load_tokenizer(chat_dir / "tokenizer.json")
    cfg = cfg_for(path, chat_dir, **{"data.data_format": "verl", "data.apply_chat_template": True,
                                     "data.max_prompt_len": 200})
    with caplog.at_level(logging.WARNING):
        ds = load_prompt_dataset(str(path), tok, cfg)
    assert len(ds) == 2 and ds.dropped_overlong == 2 and ds.references == ["3", "7"]
    assert any("dropped 2 prompt(s)" in r.getMessage() and "--max-prompt-len=200" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(DataError, match=r"v.parquet\[row 1\]: prompt is \d+ tokens, .*--max-prompt-len"):
        load_prompt_dataset(str(path), tok, cfg_for(path, chat_dir, **{"data.data_format": "verl",
                                                                       "data.apply_chat_template": True,
                                                                       "data.max_prompt_len": 200,
                                                                       "data.on_overlong_prompt": "fail"}))
    with pytest.raises(DataError, match=r"4 of 4 prompts are longer than max_prompt_len=20 .*--max-prompt-len"):
        load_prompt_dataset(str(path), tok, cfg_for(path, chat_dir, **{"data.data_format": "verl",
                                                                       "data.apply_chat_template": True,
                                                                       "data.max_prompt_len": 20}))


def test_config_errors_name_the_flags(chat_dir):
    with pytest.raises(ValueError, match="--apply-chat-template"):
        RunConfig(**{"data.dataset": "x.jsonl", "data.tokenizer": "t.json", "data.system_prompt": "s"})
    with pytest.raises(ValueError, match="--data.data_format"):  # the dotted flag (the CLI names --data-format)
        RunConfig(**{"data.data_format": "hf"})
    with pytest.raises(ValueError, match="--data.on_overlong_prompt"):
        RunConfig(**{"data.on_overlong_prompt": "truncate"})
    with pytest.raises(ValueError, match="--reward"):
        RunConfig(**{"data.reward": "boxed"})
    with pytest.raises(ValueError, match="--eval-only"):
        RunConfig(**{"data.eval_dataset": "a.jsonl", "data.tokenizer": "t.json"})
    with pytest.raises(ValueError, match="--tokenizer"):
        RunConfig(**{"data.eval_dataset": "a.jsonl", "eval.only": True})
