"""Text classifiers: the recipe's gated CNN (GCNN) and a fastText-style bag of (hashed) n-grams."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ddp_accel.errors import UserError


class GatedBlock(nn.Module):
    """A(x) * sigmoid(B(x)), A and B two Conv1d of the same shape (Dauphin et al. 2017)."""

    def __init__(self, channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv_a = nn.Conv1d(channels, channels, kernel_size, stride=stride)
        self.conv_b = nn.Conv1d(channels, channels, kernel_size, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_a(x) * torch.sigmoid(self.conv_b(x))


# the recipe's convolution: width 15, stride 7 (the defaults of GCNN and of scripts/imdb.py)
KERNEL_SIZE, STRIDE = 15, 7


@dataclass(frozen=True)
class TextModelConfig:
    """A text model's hyper-parameters as one typed object, from the command line to the model and to the run's
    identity (`options()`). `name`: bag (NgramBag) or gcnn (GCNN); each model takes the fields it has (the
    defaults are the recipe's)."""

    name: str
    dim: int = 64
    ngrams: int = 1
    buckets: int = 2_000_000
    pool: str = "mean"
    dropout: float = 0.0
    kernel_size: int = KERNEL_SIZE
    stride: int = STRIDE
    nb_weights: bool = False

    def options(self) -> dict[str, Any]:
        """Every hyper-parameter but the name (what shapes the model, compared on resume)."""
        return {key: value for key, value in asdict(self).items() if key != "name"}

    def build(self, vocab_size: int, pad_id: int, sparse: bool = False) -> nn.Module:
        if self.name == "gcnn":
            return GCNN(vocab_size, pad_id, self)
        if self.name == "bag":
            return NgramBag(vocab_size, pad_id, self, sparse=sparse)
        raise UserError(f"unknown --model {self.name}; choose gcnn or bag")


class GCNN(nn.Module):
    """Embedding -> 2 gated conv blocks -> pooling over time -> Linear -> Linear.

    Recipe: dim 64, kernel 15, stride 7, mean pooling, hidden 128, no dropout. `pool="max"` and
    `dropout` are our options.
    """

    def __init__(
        self,
        vocab_size: int,
        pad_id: int = 1,
        config: TextModelConfig = TextModelConfig("gcnn"),
        hidden: int = 128,
        num_classes: int = 2,
    ):
        super().__init__()
        dim, kernel_size, stride = config.dim, config.kernel_size, config.stride
        self.embedding = nn.Embedding(vocab_size, dim, padding_idx=pad_id)
        nn.init.xavier_uniform_(self.embedding.weight)
        with torch.no_grad():
            self.embedding.weight[pad_id].zero_()
        self.blocks = nn.Sequential(GatedBlock(dim, kernel_size, stride), GatedBlock(dim, kernel_size, stride))
        self.pool, self.dropout = config.pool, nn.Dropout(config.dropout)
        self.head = nn.Sequential(nn.Linear(dim, hidden), nn.Linear(hidden, num_classes))
        # shortest input both convolutions accept: pad batches to at least this many tokens
        self.min_length = kernel_size + (kernel_size - 1) * stride

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.dropout(self.embedding(input_ids)).transpose(1, 2))
        x = x.amax(dim=2) if self.pool == "max" else x.mean(dim=2)
        return self.head(self.dropout(x))


# 2**64 / golden ratio as a signed int64. A small multiplier such as 1,000,003 is 3 modulo 10**k, so the
# bigrams of a 50k vocabulary landed in only 19% of 1M buckets; this one spreads them over 86% (the ideal).
GOLDEN_RATIO_64 = -7046029254386353131


class NgramBag(nn.Module):
    """fastText: the mean of token (and hashed n-gram) embeddings -> Linear. `ngrams=1` is the recipe's model.

    N-gram ids are hashed on the fly from the padded token ids into `buckets` extra rows, so the data
    pipeline is the same for every model.
    """

    def __init__(
        self,
        vocab_size: int,
        pad_id: int = 1,
        config: TextModelConfig = TextModelConfig("bag"),
        sparse: bool = False,
        num_classes: int = 2,
    ):
        super().__init__()
        dim, ngrams, nb_weights = config.dim, config.ngrams, config.nb_weights
        self.vocab_size, self.pad_id, self.ngrams, self.sparse = vocab_size, pad_id, ngrams, sparse
        self.buckets = config.buckets if ngrams > 1 else 0
        rows = vocab_size + self.buckets
        # sparse: the gradient holds only the rows of the batch (about 21,000 of 1.05M for 128 reviews)
        self.embedding = nn.EmbeddingBag(
            rows, dim, mode="sum" if nb_weights else "mean", padding_idx=pad_id, sparse=sparse
        )
        # NBSVM's weighting (Wang & Manning 2012): each feature's embedding scaled by |log-count ratio| of the
        # classes, fitted on the training part (fit_nb_weights). A frozen parameter, not a buffer: saved with the
        # model, but DDP does not broadcast it every step as it would a buffer.
        self.nb_weights = nn.Parameter(torch.ones(rows), requires_grad=False) if nb_weights else None
        self.dropout = nn.Dropout(config.dropout)
        self.fc = nn.Linear(dim, num_classes)
        nn.init.uniform_(self.embedding.weight, -0.5 / dim, 0.5 / dim)  # fastText's init
        with torch.no_grad():
            self.embedding.weight[pad_id].zero_()

    @torch.no_grad()
    def fit_nb_weights(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], alpha: float = 1.0) -> None:
        """|r|, r = log((p / |p|1) / (q / |q|1)): p and q count the positive and negative training reviews that
        contain each feature (binarised), smoothed by `alpha`; scaled so that a feature occurrence weighs 1 on
        average, so learning rate and weight decay keep their meaning."""
        assert self.nb_weights is not None, "built without nb_weights"
        rows = self.nb_weights.numel()
        counts = torch.full((2, rows), alpha, dtype=torch.float64)
        for input_ids, labels in batches:
            ids = self.ngram_ids(input_ids)
            pairs = (torch.arange(len(ids))[:, None] * rows + ids)[ids != self.pad_id].unique()  # (review, feature)
            review, feature = pairs // rows, pairs % rows
            counts.index_put_((labels[review], feature), torch.ones(len(pairs), dtype=torch.float64), accumulate=True)
        ratio = (counts[1] / counts[1].sum()).log() - (counts[0] / counts[0].sum()).log()
        occurrences = counts.sum(0) - 2 * alpha
        weights = ratio.abs()
        self.nb_weights.copy_(weights / ((weights * occurrences).sum() / occurrences.sum()))

    def ngram_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids followed by hashed 2..n-gram ids; n-grams touching padding become padding."""
        columns = [input_ids]
        for n in range(2, self.ngrams + 1):
            if input_ids.shape[1] < n:
                break
            windows = input_ids.unfold(1, n, 1)  # (batch, positions, n)
            hashed = torch.zeros_like(windows[..., 0])
            for k in range(n):  # multiply-and-mix with a 64-bit odd constant; int64 wraps deterministically
                hashed = (hashed + windows[..., k]) * GOLDEN_RATIO_64
            hashed = hashed ^ (hashed >> 31)
            ids = hashed.remainder(self.buckets) + self.vocab_size
            columns.append(torch.where((windows == self.pad_id).any(dim=2), self.pad_id, ids))
        return torch.cat(columns, dim=1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = self.ngram_ids(input_ids)
        if not self.sparse and self.nb_weights is None:  # the recipe's EmbeddingBag (mode "mean")
            return self.fc(self.dropout(self.embedding(ids)))
        present = ids != self.pad_id
        weights = present / present.sum(dim=1, keepdim=True).clamp(min=1)  # a mean over the real features
        if self.nb_weights is not None:
            weights = weights * self.nb_weights[ids]
        if not self.sparse:
            return self.fc(
                self.dropout(self.embedding(ids, per_sample_weights=weights.to(self.embedding.weight.dtype)))
            )
        # Look each distinct row up once: the table's sparse gradient then holds one row per distinct feature
        # instead of one per occurrence, so DDP's all-reduce and the optimizer coalesce far fewer rows.
        rows, position = torch.unique(ids, return_inverse=True)
        vectors = nn.functional.embedding(rows, self.embedding.weight, padding_idx=self.pad_id, sparse=True)
        bags = nn.functional.embedding_bag(position, vectors, per_sample_weights=weights.to(vectors.dtype), mode="sum")
        return self.fc(self.dropout(bags))
