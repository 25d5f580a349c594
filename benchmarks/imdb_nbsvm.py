"""NBSVM (Mesnil et al.'s logistic-regression variant of Wang & Manning 2012) on imdb.py's own folds: a reference
whose official test figures are published (uni+bigrams 91.22%, uni+bi+trigrams 91.87%), so that the held-out
figures of the two fold protocols (random folds, `--group-size` runs) can be read against the test split.

    python benchmarks/imdb_nbsvm.py --train-file imdb_train.jsonl.gz --folds 5 --ngrams 2 3 \\
        --group-size 1 50 --out kfold_nbsvm.json

The folds are imdb.py's (`--fold I/K --seed 0`, with and without `--group-size`: the same reviews held out). The
model: the reviews tokenised as imdb.py does (torchtext's basic_english), n-grams as binary features scaled by the
training part's log-count ratio r = log((p/|p|)/(q/|q|)) with add-one counts, then L2 logistic regression (C=1,
liblinear), as Mesnil's nbsvm.py. Needs scikit-learn (not one of the project's requirements).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import datasets
import numpy as np

from ddp_accel.text.pipeline import _fold_split
from ddp_accel.text.sources import load_file
from ddp_accel.text.tokenizer import basic_english


def fold_indices(count: int, fold: str, seed: int, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The training and held-out review indices of imdb.py's `--fold fold --seed seed --group-size group_size`."""
    positions = datasets.Dataset.from_dict({"position": list(range(count))})
    train, held = _fold_split(positions, fold, seed, "reviews", group_size)
    return np.array(train["position"]), np.array(held["position"])


def nbsvm_accuracy(features, labels: np.ndarray, train: np.ndarray, held: np.ndarray) -> float:
    from sklearn.linear_model import LogisticRegression

    binary = features[train]
    positive = np.asarray(binary[labels[train] == 1].sum(axis=0)).ravel() + 1.0
    negative = np.asarray(binary[labels[train] == 0].sum(axis=0)).ravel() + 1.0
    ratio = np.log((positive / positive.sum()) / (negative / negative.sum()))
    ratio[positive + negative == 2.0] = 0.0  # n-grams only the held-out part has (add-one counts on both sides)
    model = LogisticRegression(C=1.0, solver="liblinear")
    model.fit(binary.multiply(ratio).tocsr(), labels[train])
    predicted = model.predict(features[held].multiply(ratio).tocsr())
    return float((predicted == labels[held]).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-file", required=True, help="the train split as imdb.py reads it, hub order")
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ngrams", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--group-size", type=int, nargs="+", default=[1, 50])
    parser.add_argument("--out", default="kfold_nbsvm.json")
    args = parser.parse_args()
    if args.folds < 2 or min(args.ngrams) < 1 or min(args.group_size) < 1:
        parser.error("--folds needs at least 2; --ngrams and --group-size at least 1")
    from sklearn.feature_extraction.text import CountVectorizer

    reviews = load_file(args.train_file)
    texts, labels = reviews["text"], np.array(reviews["label"])
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    setup = {"train_file": Path(args.train_file).name, "reviews": len(texts), "seed": args.seed, "folds": args.folds}
    if results.setdefault("setup", setup) != setup:  # its folds would hold out other reviews
        parser.error(f"{out} holds runs of another setup ({results['setup']}); give another --out")
    for ngrams in args.ngrams:
        started = time.monotonic()
        vectorizer = CountVectorizer(tokenizer=basic_english, lowercase=False, token_pattern=None, binary=True)
        vectorizer.set_params(ngram_range=(1, ngrams))
        features = vectorizer.fit_transform(texts).tocsr()
        print(f"n-grams up to {ngrams}: {features.shape[1]:,} features in {time.monotonic() - started:.0f} s")
        for group_size in args.group_size:
            name = f"NBSVM, n-grams up to {ngrams}, " + ("random folds" if group_size == 1 else f"runs of {group_size}")
            scores = results.setdefault(name, {})
            for index in range(1, args.folds + 1):
                fold = f"{index}/{args.folds}"
                if fold not in scores:
                    train, held = fold_indices(len(texts), fold, args.seed, group_size)
                    scores[fold] = round(nbsvm_accuracy(features, labels, train, held) * 100, 2)
                    out.write_text(json.dumps(results, indent=1) + "\n")
                print(f"{name}, fold {fold}: {scores[fold]:.2f}%", flush=True)
            mean = statistics.mean(scores.values())
            print(f"{name}: mean {mean:.2f}% (std {statistics.stdev(scores.values()):.2f})", flush=True)


if __name__ == "__main__":
    main()
