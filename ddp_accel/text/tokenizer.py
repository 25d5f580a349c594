"""torchtext's `basic_english` tokenizer, re-implemented (torchtext no longer imports with current torch).

Same rules as torchtext.data.utils._basic_english_normalize: lower-case, `<br />` to a space, split off
quotes and punctuation. Unicode letters and digits pass through unchanged.
"""

from __future__ import annotations

import re

_PATTERNS = [
    (re.compile(r"\'"), " '  "),
    (re.compile(r"\""), ""),
    (re.compile(r"\."), " . "),
    (re.compile(r"<br \/>"), " "),
    (re.compile(r","), " , "),
    (re.compile(r"\("), " ( "),
    (re.compile(r"\)"), " ) "),
    (re.compile(r"\!"), " ! "),
    (re.compile(r"\?"), " ? "),
    (re.compile(r"\;"), " "),
    (re.compile(r"\:"), " "),
    (re.compile(r"\s+"), " "),
]


def basic_english(text: str) -> list[str]:
    text = text.lower()
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text.split()
