"""A tokenizer folder with a Jinja chat template, as checkpoints ship it (tokenizer.json + tokenizer_config.json),
made in a test from a small BPE: used by tests/rl/test_chat.py, tests/rl/test_data_formats.py and
tests/launch/test_seed_workflow.py."""

from __future__ import annotations

import json
import pathlib

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
SPECIALS = ["<|pad|>", BOS, EOS, USER, ASSISTANT, "<think>", "</think>", "<unk>"]

# A DeepSeek-style template (system text first, User / Assistant markers, a `thinking` switch read by V3.1-style
# templates, `enable_thinking` by Qwen3-style ones), using namespace, loop.last, tojson and raise_exception.
TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system='') %}"
    "{%- for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = ns.system + m['content'] %}"
    "{% endif %}{% endfor -%}"
    "{{ bos_token }}{{ ns.system }}\n"
    "{%- for m in messages %}\n"
    "  {%- if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}\n"
    "  {%- elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + m['content'] + eos_token }}\n"
    "  {%- elif m['role'] != 'system' %}{{ raise_exception('unknown role ' + m['role'] | tojson) }}\n"
    "  {%- endif %}\n"
    "  {%- if loop.last and m.get('meta') %}{{ m['meta'] | tojson }}{% endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}<｜Assistant｜>"
    "{%- if (thinking is defined and thinking) or (enable_thinking is defined and enable_thinking) %}<think>\n"
    "{%- else %}</think>{% endif %}{% endif %}"
)


def train_bpe(folder: pathlib.Path, texts: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))


def make_chat_tokenizer(folder: pathlib.Path, template: str = TEMPLATE, texts: list[str] | None = None) -> pathlib.Path:
    """A tokenizer folder as checkpoints ship it: tokenizer.json + tokenizer_config.json with a chat template.
    The BPE (<= 200 ids) is trained on `texts` (default: two short math sentences)."""
    train_bpe(folder, texts or ["What is 3 + 4? Answer: 7", "Please reason step by step. The answer is 12."] * 4)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": "<|pad|>",
        "unk_token": "<unk>", "chat_template": template}, ensure_ascii=False))
    return folder


DAPO_INSTRUCTION = ("Solve the following math problem step by step. The last line of your response should be of the "
                    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")


def verl_records(n: int, start: int = 0) -> list[dict]:
    """DAPO-Math-17K as veRL's recipe stores it: chat messages, rule reward with a ground truth, data_source."""
    return [{"data_source": "math_dapo", "ability": "MATH",
             "prompt": [{"role": "user", "content": DAPO_INSTRUCTION + f"What is {i} + {i + 3}?\n\n"
                         "Remember to put your answer on its own line after \"Answer:\"."}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * i + 3)},
             "extra_info": {"index": i}} for i in range(start, start + n)]


def write_parquet(path: pathlib.Path, records: list[dict]) -> pathlib.Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), str(path))
    return path
