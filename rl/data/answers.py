"""Final answers out of model text: the one parser of the math rewards (`rl/data/rewards.py`,
`rl/data/math_rewards.py`).

- `last_boxed(text)`: the content of the last `\\boxed{...}` (braces balanced).
- `clean_answer(text)`: an extracted answer without the wrapping a model adds (`$...$`, `\\(...\\)`, a trailing
  period, an inner `\\boxed{}` or `\\text{}`); every extraction below and every reference goes through it.
- `boxed_answer(text)` / `answer_line(text)`: the last `\\boxed{}` / the last "Answer: ..." line, cleaned.
- `extract_final_answer(text)`: GSM8K's order: the text after the last `####`, else the last `\\boxed{}` (both
  cleaned), else the last number.
- `reference_answer(reference)`: a dataset's reference as an answer (the text after its last `####`, cleaned).
- `plain_decimal(text)`: an answer as an exact `decimal.Decimal` when it is a plain number (after normalising
  signs, currency, thousands separators, scientific notation and trailing units), else None (then math-verify
  decides). Nothing is evaluated.
- `math_verify_equal(pred, gold)`: math-verify's equivalence of two answer texts (LaTeX parsed by latex2sympy /
  sympy), with its signal timeouts off: the callers run it in the reward worker, whose deadline replaces them
  (rl/data/rewards.py's docstring).
- `answers_equal(pred, gold)`: the one comparison of every math reward: plain numbers exactly, equal texts (spaces
  aside) as equal, else math-verify on both as `\\boxed{}` answers; False past `MAX_ANSWER_CHARS`.
"""

from __future__ import annotations

import decimal
import re

# Answers longer than this are not worth parsing: GSM8K answers are short integers, and long
# expressions are where sympy spends seconds (300 nested parentheses take ~2.5 s).
MAX_ANSWER_CHARS = 200

_ANSWER_LINE_RE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")
_NUMBER_RE = re.compile(r"[-\u2212]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")
# Answer normalisation (`plain_decimal`): minus-like characters -> "-", thousands separators (comma, space,
# thin / narrow no-break / no-break space) in groups of three, scientific notation, trailing unit words or %.
_MINUS_TABLE = str.maketrans({c: "-" for c in "\u2212\u2012\u2013\u2014\u2015\ufe63\uff0d"})
_GROUPED_RE = re.compile(r"\d{1,3}(?:([, \u2009\u202f\u00a0])\d{3})(?:\1\d{3})*(?:\.\d+)?")
_PLAIN_NUMBER_RE = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,6})?")
_UNIT_TAIL_RE = re.compile(r"(?<=[\d.])\s*(?:%|[^\W\d_]+\.?(?:\s+[^\W\d_]+\.?)*)\Z")


# -- answer extraction ------------------------------------------------------------------------------

def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def clean_answer(answer: str) -> str:
    """An extracted answer without the wrapping a model adds: `$...$`, `\\(...\\)`, `\\[...\\]`, a trailing
    period, an inner `\\boxed{}` or `\\text{}` ("Answer: $\\boxed{34}$." -> "34", "\\text{18 apples}" ->
    "18 apples")."""
    s = answer.strip().rstrip(".").strip()
    inner = last_boxed(s)
    if inner is not None:
        s = inner.strip()
    for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left):len(s) - len(right)].strip()
    s = s.rstrip(".").strip()
    m = re.fullmatch(r"\\text\{(.*)\}", s)
    return m.group(1).strip() if m else s


def boxed_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` of `text`, cleaned (`clean_answer`); None if absent or empty."""
    b = last_boxed(text)
    return (clean_answer(b) or None) if b is not None else None


def answer_line(text: str) -> str | None:
    """The text after the last "Answer:" (case-insensitive) up to the end of its line, cleaned; None if absent."""
    found = _ANSWER_LINE_RE.findall(text)
    return (clean_answer(found[-1]) or None) if found else None


def reference_answer(reference: str) -> str:
    """A dataset's reference as an answer: the text after its last `####` (a whole GSM8K answer field), else all of
    it, cleaned (`clean_answer`). Raises TypeError if `reference` is not a string."""
    if not isinstance(reference, str):
        raise TypeError(f"reference must be a string, got {type(reference).__name__}")
    if "####" in reference:
        reference = reference[reference.rfind("####") + 4:]
    return clean_answer(reference)


def extract_final_answer(text: str) -> tuple[str, str] | None:
    """-> (answer text, how) with how in {"####", "boxed", "number"}, or None if there is none.

    "####": the rest of the line after the last `####`, cleaned. "boxed": the last `\\boxed{...}`, cleaned
    (`boxed_answer`). "number": the last number in the text (e.g. "The answer is 18." -> "18").
    """
    if "####" in text:
        tail = clean_answer(text[text.rfind("####") + 4:].strip().split("\n", 1)[0])
        if tail:
            return tail, "####"
    boxed = boxed_answer(text)
    if boxed is not None:
        return boxed, "boxed"
    numbers = _NUMBER_RE.findall(text)
    if numbers:
        return numbers[-1].rstrip(".,"), "number"
    return None


def plain_decimal(text: str) -> decimal.Decimal | None:
    """`text` as an exact decimal if it is a plain number, else None (then math-verify decides).

    Accepted (normalised before an exact `decimal.Decimal` comparison; nothing is evaluated): an optional sign,
    also Unicode minus / dashes and spaced ("- 5"); a currency sign ($ EUR GBP); thousands separators in groups of
    three (comma, space, thin or no-break space: "1,000", "1 000"); scientific notation ("1e3", "2.5E-2");
    a trailing period; trailing unit words or % ("18 apples", "5 km", "50%"). Examples: "18", "-3.5",
    "\u22125", "- 5", "$1,000.00", "1e3", "12 dollars".
    """
    s = text.strip().translate(_MINUS_TABLE).rstrip(".").strip()
    sign = ""
    for _ in range(2):  # sign and currency in either order: "-$5", "$-5"
        if s[:1] in ("-", "+"):
            sign, s = ("-" if s[0] == "-" else ""), s[1:].lstrip()
        if s[:1] in ("$", "\u20ac", "\u00a3"):
            s = s[1:].lstrip()
    s = _UNIT_TAIL_RE.sub("", s).rstrip(".")
    if _GROUPED_RE.fullmatch(s):
        s = re.sub(r"[, \u2009\u202f\u00a0]", "", s)
    if not _PLAIN_NUMBER_RE.fullmatch(s):
        return None
    return decimal.Decimal(sign + s)


def math_verify_equal(pred: str, gold: str) -> bool:
    """math-verify's `verify(parse(gold), parse(pred))`, both texts parsed as given (wrap one in `\\boxed{}` to
    parse it as a boxed answer); False when either side does not parse. Signal timeouts off (see the module
    docstring); sympy can take unbounded time on hostile input, so call it under a deadline."""
    import math_verify  # sympy is heavy: imported on first use (the reward worker preloads it)

    g = math_verify.parse(gold, parsing_timeout=None)
    p = math_verify.parse(pred, parsing_timeout=None)
    if not g or not p:
        return False
    return bool(math_verify.verify(g, p, timeout_seconds=None))


def answers_equal(pred: str, gold: str) -> bool:
    """Whether the extracted answer `pred` equals the reference answer `gold` (both already extracted: no `####`,
    no `\\boxed{}` wrapper): exact `decimal.Decimal` equality when both are plain numbers (`plain_decimal`), True
    when neither is and the texts are equal but for spaces, else math-verify with both parsed as `\\boxed{...}`
    LaTeX. False for a `pred` longer than `MAX_ANSWER_CHARS`. Unbounded time on hostile input: call it under a
    deadline (the reward worker)."""
    if len(pred) > MAX_ANSWER_CHARS:
        return False
    p, g = plain_decimal(pred), plain_decimal(gold)
    if p is not None and g is not None:
        return p == g
    if p is None and g is None and pred.replace(" ", "") == gold.replace(" ", ""):
        return True
    return math_verify_equal(f"\\boxed{{{pred}}}", f"\\boxed{{{gold}}}")
