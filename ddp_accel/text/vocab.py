"""A token vocabulary (torchtext's build_vocab_from_iterator, without torchtext), saved as JSON."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

from ddp_accel.files import write_text

UNK, PAD = "<unk>", "<pad>"


class Vocab:
    """Tokens -> ids. `<unk>` is 0 (also what unknown tokens map to), `<pad>` is 1."""

    def __init__(self, tokens: list[str]):
        if tokens[:2] != [UNK, PAD]:
            raise ValueError("a vocabulary starts with <unk>, <pad>")
        self.itos = tokens
        self.stoi = {token: index for index, token in enumerate(tokens)}

    unk_id, pad_id = 0, 1

    @classmethod
    def build(cls, token_lists: Iterable[list[str]], min_freq: int = 1, max_size: int | None = None) -> Vocab:
        counts: Counter[str] = Counter()
        for tokens in token_lists:
            counts.update(tokens)
        return cls.from_counts(counts, min_freq, max_size)

    @classmethod
    def from_counts(cls, counts: Mapping[str, int], min_freq: int = 1, max_size: int | None = None) -> Vocab:
        # most frequent first, ties alphabetical: the same vocabulary on every machine and run
        kept = sorted((token for token, count in counts.items() if count >= min_freq), key=lambda t: (-counts[t], t))
        kept = [token for token in kept if token not in (UNK, PAD)]
        if max_size is not None:
            kept = kept[: max(0, max_size - 2)]
        return cls([UNK, PAD, *kept])

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, tokens: list[str]) -> list[int]:
        get = self.stoi.get
        return [get(token, 0) for token in tokens]

    def save(self, path: str | Path) -> None:
        write_text(path, json.dumps({"tokens": self.itos}, ensure_ascii=False))

    @classmethod
    def load(cls, path: str | Path) -> Vocab:
        return cls(json.loads(Path(path).read_text())["tokens"])
