"""`PieceTokenizer`: whole markup pieces + single characters, for tasks a tiny model learns from random init.

A BPE trained on a task's transcripts would merge its fixed markup (DeepSeek-V4's `<｜User｜>`, the tools section,
the DSML call block) into few tokens; this tokenizer states those merges: `pieces` (multi-character strings, matched
longest first) and `chars` (one id each). So the key-lookup task's prompt is 4 ids and a whole tool call 2 (the
call's piece, EOS) instead of ~150 characters (rl/agent/key_lookup.py). Satisfies
`rl.data.tokenizer.TokenizerLike`.

Ids: 0 <pad>, 1 <｜begin▁of▁sentence｜>, 2 <｜end▁of▁sentence｜>, then the pieces, then the characters, in order.
`encode` never emits BOS / EOS for their text unless they are in the text (the chat renderer writes them);
`decode` drops the specials (the `TokenizerLike` rule); `decode_with_specials` keeps BOS / EOS text (what the tool
call parser reads). Unknown ids decode as U+FFFD, never an error (a model's vocabulary may be larger). A character
outside the pieces and characters is an error, or, with `unknown` (one of `chars`), encodes as that character: an
environment's text (a tool error quoting a broken call) must always encode, or the rollout would stop.
"""

from __future__ import annotations

from collections.abc import Sequence

from rl.data.chat_dsv4 import BOS, EOS


class PieceTokenizer:
    """See the module docstring. Raises ValueError for duplicate pieces / characters, or an `unknown` that is not
    one of `chars`."""

    PAD, BOS_ID, EOS_ID = 0, 1, 2

    def __init__(self, pieces: Sequence[str], chars: str, unknown: str | None = None):
        table = ["<pad>", BOS, EOS, *pieces, *chars]
        if len(set(table)) != len(table) or any(not p for p in pieces):
            raise ValueError("PieceTokenizer: pieces and characters must be distinct and non-empty")
        if unknown is not None and (len(unknown) != 1 or unknown not in chars):
            raise ValueError(f"PieceTokenizer: unknown must be one of its characters, got {unknown!r}")
        self.table = tuple(table)
        self._ids = {p: i for i, p in enumerate(table) if i}  # <pad> is never matched from text
        self._by_len = sorted({len(p) for p in self._ids}, reverse=True)
        self.chat_template = None
        self._unknown = None if unknown is None else self._ids[unknown]

    @property
    def vocab_size(self) -> int:
        return len(self.table)

    @property
    def eos_id(self) -> int:
        return self.EOS_ID

    @property
    def bos_id(self) -> int:
        return self.BOS_ID

    @property
    def pad_id(self) -> int:
        return self.PAD

    def encode(self, text: str) -> list[int]:
        """text -> ids, longest piece first at each position; a character no piece covers -> the `unknown`
        character's id, or ValueError naming it (no `unknown`)."""
        out, i = [], 0
        while i < len(text):
            for n in self._by_len:
                tid = self._ids.get(text[i:i + n])
                if tid is not None:
                    out.append(tid)
                    i += n
                    break
            else:
                if self._unknown is None:
                    raise ValueError(f"PieceTokenizer: character {text[i]!r} at {i} is not in its pieces or "
                                     f"characters")
                out.append(self._unknown)
                i += 1
        return out

    def decode_with_specials(self, ids: Sequence[int]) -> str:
        """ids -> text with BOS / EOS written out; <pad> dropped, unknown ids U+FFFD."""
        return "".join(self.table[i] if 0 < i < len(self.table) else ("" if i == 0 else "\ufffd")
                       for i in map(int, ids))

    def decode(self, ids: Sequence[int]) -> str:
        """ids -> text without the special tokens (the `TokenizerLike` rule)."""
        return self.decode_with_specials([i for i in map(int, ids) if i not in (self.BOS_ID, self.EOS_ID)])
