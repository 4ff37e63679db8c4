"""Tests for rl/data/prompts.py (records, prompt dataset, grain iterator) and rl/data/tokenizer.py (HF tokenizer.json
wrapper).

The tokenizer tests live here because the prompt dataset is their only caller in the RL stack.
"""

import json
import logging

import numpy as np
import pytest

from rl.data.prompts import (DataError, PromptDataset, gsm8k_final_answer, load_records, make_prompt_iterator,
                             prompt_pipeline)
from rl.data.tasks import DigitTask
from rl.data.tokenizer import HFTokenizer, TokenizerError, TokenizerLike, check_vocab, load_tokenizer

SENTENCES = [
    "Question: how many eggs does Janet sell?",
    "Answer: she sells 9 eggs a day.",
    "The robe takes 2 bolts of blue fiber and half that much white fiber.",
    "How many bolts in total does it take?",
]


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A tiny byte-level BPE trained on a few sentences, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 4, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tok(tokenizer_file):
    return load_tokenizer(tokenizer_file)


# -- tokenizer ------------------------------------------------------------------------------------

def test_tokenizer_round_trip_and_specials(tok, tokenizer_file):
    assert isinstance(tok, TokenizerLike) and isinstance(tok, HFTokenizer)
    for text in SENTENCES + ["unseen words: zebra 42!"]:
        assert tok.decode(tok.encode(text)) == text
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)  # found by name: <pad>, <s>, </s>
    assert tok.decode([tok.bos_id, *tok.encode("How many"), tok.eos_id, 10**6]) == "How many"
    assert load_tokenizer(tokenizer_file.parent).vocab_size == tok.vocab_size  # a folder works too
    assert load_tokenizer(tokenizer_file, eos_token="<s>").eos_id == 1


def test_tokenizer_config_and_template(tokenizer_file, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(tokenizer_file.read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    t = load_tokenizer(folder, chat_template="Question: {question}\nAnswer:")
    assert t.eos_id == 0  # tokenizer_config.json wins over the name list
    assert t.format_prompt("2+2?", question="2+2?") == "Question: 2+2?\nAnswer:"
    with pytest.raises(TokenizerError, match="no field"):
        load_tokenizer(folder, chat_template="no fields here")
    with pytest.raises(TokenizerError, match="not a valid format string"):
        load_tokenizer(folder, chat_template="{question")


def test_tokenizer_errors(tok, tmp_path):
    with pytest.raises(TokenizerError, match="not found: .*missing.json"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="bad.json"):
        load_tokenizer(bad)
    with pytest.raises(TokenizerError, match="'<nope>' is not in the vocabulary"):
        load_tokenizer(tok.path, eos_token="<nope>")
    check_vocab(tok, tok.vocab_size)
    too_big = f"vocabulary \\({tok.vocab_size} ids\\) is larger than the model's \\(256\\)"
    with pytest.raises(TokenizerError, match=too_big):
        check_vocab(tok, 256)


# -- records --------------------------------------------------------------------------------------

def test_load_records_jsonl_and_bad_lines(tmp_path):
    good = '{"question": "q", "answer": "a #### 1"}'
    path = write_lines(tmp_path / "file.jsonl", [good, "", "{broken", good, "[1, 2]"])
    with pytest.raises(DataError, match="file.jsonl:3: invalid JSON"):
        load_records(path)
    records = load_records(path, on_bad_record="skip")
    assert len(records) == 2 and records.skipped == 2
    assert records.locations == [f"{path}:1", f"{path}:4"]


def test_load_records_empty_missing_and_parquet(tmp_path):
    empty = write_lines(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DataError, match="empty.jsonl: no records"):
        load_records(empty)
    with pytest.raises(DataError, match="nothere.jsonl: no such file"):
        load_records(tmp_path / "nothere.jsonl")
    with pytest.raises(DataError, match="unsupported format"):
        load_records(write_lines(tmp_path / "x.csv", ["a,b"]))
    (tmp_path / "x.parquet").write_bytes(b"PAR1")  # pyarrow is a dependency: a broken file is a one-line error
    with pytest.raises(DataError, match="x.parquet: cannot read parquet"):
        load_records(tmp_path / "x.parquet")


# -- prompt dataset -------------------------------------------------------------------------------

def test_prompt_dataset_gsm8k(tok, shared_dir):
    lines = [json.loads(line) for line in (shared_dir / "data/gsm8k/test.jsonl").read_text().splitlines()[:8]]
    ds = PromptDataset.from_records(lines, tok, template="Question: {question}\nAnswer:", max_prompt_len=512)
    assert len(ds) == 8 and ds.references[0] == "18"
    ex = ds[0]
    assert ex["prompt_ids"].shape == (512,) and ex["prompt_ids"].dtype == np.int32
    n = int(ex["prompt_len"])
    assert ex["prompt_ids"][0] == tok.bos_id and (ex["prompt_ids"][n:] == tok.pad_id).all()
    assert tok.decode(ds.prompt(0)) == f"Question: {lines[0]['question']}\nAnswer:"


def test_prompt_dataset_errors(tok, tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [
        '{"question": "how many?", "answer": "#### 3"}',
        '{"question": "how many more?", "solution": "#### 4"}',
        '{"question": "' + "very long " * 200 + '", "answer": "#### 5"}',
        '{"question": "no final answer", "answer": "5"}',
    ])
    records = load_records(path)
    with pytest.raises(DataError, match=r"d.jsonl:2: missing field 'answer'"):
        PromptDataset.from_records(records, tok)
    with pytest.raises(DataError, match=r"d.jsonl:3: prompt is \d+ tokens, more than max_prompt_len=64"):
        PromptDataset.from_records(records, tok, answer_field=None, max_prompt_len=64)
    with pytest.raises(DataError, match=r"d.jsonl:4: field 'answer': answer has no '####"):
        PromptDataset.from_records(records.take([0, 3]), tok)
    with pytest.raises(DataError, match="missing field 'context'"):
        PromptDataset.from_records(records[:1], tok, template="{context} {question}")
    ds = PromptDataset.from_records(records, tok, max_prompt_len=64, on_bad_record="skip")
    assert len(ds) == 1 and ds.skipped == 3 and ds.locations == [f"{path}:1"]
    assert gsm8k_final_answer("work\n#### 1,000 ") == "1,000"


# -- grain iterator -------------------------------------------------------------------------------

def test_batches_and_exact_resume():
    task = DigitTask(kind="reverse")
    kw = {"batch_size": 32, "seed": 5, "shard_index": 0, "shard_count": 1}
    it = make_prompt_iterator(task, **kw)
    first = [next(it) for _ in range(3)]
    b = first[0]
    assert b["prompt_ids"].shape == (32, task.prompt_len) and b["prompt_ids"].dtype == np.int32
    assert b["prompt_len"].tolist() == [task.prompt_len] * 32 and len(b["reference"]) == 32
    tok = task.tokenizer
    for row, ref in zip(b["prompt_ids"], b["reference"]):  # the reference is the prompt's digits reversed
        assert tok.decode(row)[1:4][::-1] == ref
    state = it.get_state()
    assert json.loads(json.dumps(state)) == state
    expected = next(it)
    fresh = make_prompt_iterator(task, **kw)
    fresh.set_state(state)
    resumed = next(fresh)
    np.testing.assert_array_equal(resumed["index"], expected["index"])
    assert resumed["reference"] == expected["reference"]
    again = make_prompt_iterator(task, **kw)
    assert [next(again)["index"].tolist() for _ in range(3)] == [x["index"].tolist() for x in first]


def test_epochs_cover_every_prompt_and_reshuffle():
    ds = PromptDataset.from_task(DigitTask(), "eval")  # 100 prompts
    pipe = prompt_pipeline(ds, batch_size=10, seed=0, shard_index=0, shard_count=1)
    epoch0 = np.concatenate([pipe[k]["index"] for k in range(10)])
    epoch1 = np.concatenate([pipe[k]["index"] for k in range(10, 20)])
    assert sorted(epoch0) == sorted(epoch1) == list(range(100))
    assert epoch0.tolist() != epoch1.tolist()
    plain = prompt_pipeline(ds, batch_size=10, shuffle=False, shard_index=0, shard_count=1)
    assert plain[0]["index"].tolist() == list(range(10))


def test_host_shards_are_disjoint():
    ds = PromptDataset.from_task(DigitTask(), "eval")
    seen = []
    for shard in (0, 1):
        pipe = prompt_pipeline(ds, batch_size=10, seed=3, shard_index=shard, shard_count=2)
        for epoch in range(2):
            seen.append(set(np.concatenate([pipe[k]["index"] for k in range(5 * epoch, 5 * epoch + 5)]).tolist()))
    shard0_e0, shard0_e1, shard1_e0, shard1_e1 = seen
    assert len(shard0_e0) == len(shard1_e0) == 50
    assert not shard0_e0 & shard1_e0 and not shard0_e1 & shard1_e1
    with pytest.raises(ValueError, match="shard_index"):
        prompt_pipeline(ds, batch_size=10, shard_index=2, shard_count=2)


def test_default_shard_is_this_process():
    it = make_prompt_iterator(DigitTask(), batch_size=4)  # jax.process_index() / process_count() = 0 / 1
    assert next(it)["prompt_ids"].shape == (4, 6)


def test_dropped_and_skipped_records_are_metrics(tmp_path, tok):
    # Issue 15 class 8: what --on-bad-record skip drops reaches the step metrics, split by cause:
    # data/skipped_records (malformed: line 2 lacks "answer", line 4 has no final answer) and
    # data/dropped_overlong (line 3 is longer than max_prompt_len), summed over the train and eval sets.
    from rl.run.wiring import data_metrics

    path = write_lines(tmp_path / "d.jsonl", [
        '{"question": "how many?", "answer": "#### 3"}',
        '{"question": "how many more?", "solution": "#### 4"}',
        '{"question": "' + "very long " * 200 + '", "answer": "#### 5"}',
        '{"question": "no final answer", "answer": "5"}',
        'not json',
    ])
    records = load_records(path, on_bad_record="skip")
    ds = PromptDataset.from_records(records, tok, max_prompt_len=64, on_bad_record="skip")
    assert len(ds) == 1 and ds.skipped == 4 and ds.dropped_overlong == 1
    assert data_metrics(ds) == {"data/skipped_records": 3.0, "data/dropped_overlong": 1.0}
    assert data_metrics(ds, ds) == {"data/skipped_records": 6.0, "data/dropped_overlong": 2.0}


def test_fewer_prompts_than_a_batch_warns_with_the_repeat_factor(caplog):
    ds = PromptDataset([[3, 4], [5], [6, 7]], ["1", "2", "3"], max_prompt_len=4, pad_id=0, source="tiny.jsonl")
    with caplog.at_level(logging.WARNING, logger="rl.data.prompts"):
        batch = next(make_prompt_iterator(ds, batch_size=8, shard_index=0, shard_count=1))
    assert sorted(batch["index"].tolist()).count(0) >= 2  # prompts do repeat within the batch
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("tiny.jsonl: 3 prompts" in m and "--prompts-per-step 8" in m and "2.7x" in m and "8/3" in m
               for m in msgs), msgs
    caplog.clear()
    make_prompt_iterator(ds, batch_size=3, shard_index=0, shard_count=1)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
