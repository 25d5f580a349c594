"""The classic IMDB recipe's data pipeline and loop, for benchmarks/imdb_pipeline.py to compare against.

What the classic recipe does: build the vocabulary from the tokenised training texts, then tokenise
again *inside collate_fn* for every batch, batches drawn at random and padded to their longest review,
Adam 1e-3, clip 0.1, BCE on sigmoid. Same model classes and the same train/held-out split as ours.
Prints one JSON line: preprocess_s (load + vocabulary), epoch_s, samples_per_s, data_wait_share, and the
held-out accuracy after the epoch.
"""

import argparse
import json
import time
from collections import Counter

import torch
from torch.utils.data import DataLoader

from ddp_accel.text import sources
from ddp_accel.text.models import build_model
from ddp_accel.text.tokenizer import basic_english


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-file", required=True)
    parser.add_argument("--model", choices=["bag", "gcnn"], default="bag")
    parser.add_argument("--ngrams", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--min-freq", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    start = time.perf_counter()
    split = sources.load_file(args.train_file).train_test_split(test_size=0.1, seed=args.seed)
    texts, labels = split["train"]["text"], split["train"]["label"]
    counts = Counter(token for text in texts for token in basic_english(text))
    # the recipe: <unk> = 0 is also the padding id
    itos = ["<unk>"] + [token for token, count in counts.most_common() if count >= args.min_freq]
    stoi = {token: index for index, token in enumerate(itos)}
    model = build_model(args.model, len(itos), 0, dim=64, ngrams=args.ngrams, buckets=100_000, pool="mean")
    min_length = getattr(model, "min_length", 1)

    def collate(batch):  # tokenise + encode + pad, per batch, in the training process
        encoded = [[stoi.get(token, 0) for token in basic_english(text)] for text, _ in batch]
        width = max(min_length, max(len(ids) for ids in encoded))
        input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids in encoded])
        return input_ids, torch.tensor([label for _, label in batch])

    loader = DataLoader(
        list(zip(texts, labels, strict=False)), batch_size=args.batch_size, shuffle=True, collate_fn=collate
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    preprocess_s = time.perf_counter() - start

    start = tick = time.perf_counter()
    data_wait, samples = 0.0, 0
    for input_ids, target in loader:
        data_wait += time.perf_counter() - tick
        logits = model(input_ids)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, torch.nn.functional.one_hot(target, 2).float()
        )
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        optimizer.step()
        samples += len(target)
        tick = time.perf_counter()
    epoch_s = time.perf_counter() - start

    model.eval()  # held-out accuracy (not timed), the same 10% ours evaluates
    held_out = DataLoader(
        list(zip(split["test"]["text"], split["test"]["label"], strict=False)), batch_size=256, collate_fn=collate
    )
    with torch.no_grad():
        correct = sum((model(ids).argmax(1) == target).sum().item() for ids, target in held_out)
    print(
        json.dumps(
            {
                "pipeline": "classic",
                "preprocess_s": preprocess_s,
                "epoch_s": epoch_s,
                "samples_per_s": samples / epoch_s,
                "data_wait_share": data_wait / epoch_s,
                "vocabulary": len(itos),
                "final_loss": loss.item(),
                "eval_accuracy": correct / len(split["test"]),
            }
        )
    )


if __name__ == "__main__":
    main()
