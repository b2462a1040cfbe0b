"""Generates the churn task: public train/test data, private answers and a
leaderboard of reference scores. A binary classification task scored by AUC,
beside housing's regression, so that a run over examples/tasks has two tasks
of different kinds. Standard library only; fixed seed, so the files are the
same on every machine. Run it before using the task:

    python3 examples/tasks/churn/generate.py
"""

import csv
import math
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
rng = random.Random(20261204)


def logit(x):
    return -0.3 + 1.4 * x[0] - 0.9 * x[1] + 0.8 * x[0] * x[2]


def rows(n, start):
    out = []
    for i in range(n):
        x = [rng.gauss(0, 1) for _ in range(3)]
        p = 1 / (1 + math.exp(-logit(x)))
        out.append((start + i, x, 1 if rng.random() < p else 0))
    return out


def auc(scores, labels):
    """The probability that a positive outranks a negative (ties count half)."""
    pairs = sorted(zip(scores, labels))
    pos = sum(labels)
    neg = len(labels) - pos
    rank_sum, i = 0.0, 0
    while i < len(pairs):
        j = i
        while j < len(pairs) and pairs[j][0] == pairs[i][0]:
            j += 1
        avg_rank = (i + j + 1) / 2
        rank_sum += avg_rank * sum(l for _, l in pairs[i:j])
        i = j
    return (rank_sum - pos * (pos + 1) / 2) / (pos * neg)


def main():
    train, test = rows(600, 0), rows(300, 5000)
    os.makedirs(os.path.join(HERE, "public"), exist_ok=True)
    os.makedirs(os.path.join(HERE, "private"), exist_ok=True)
    os.chmod(os.path.join(HERE, "private"), 0o700)  # the code never runs as the owner
    with open(os.path.join(HERE, "public", "train.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "tenure", "complaints", "discount", "churned"])
        for i, x, y in train:
            w.writerow([i] + [f"{v:.5f}" for v in x] + [y])
    with open(os.path.join(HERE, "public", "test.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "tenure", "complaints", "discount"])
        for i, x, _ in test:
            w.writerow([i] + [f"{v:.5f}" for v in x])
    with open(os.path.join(HERE, "private", "answers.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "target", "board"])
        for n, (i, _, y) in enumerate(test):
            w.writerow([i, y, "public" if n % 2 == 0 else "private"])
    # Reference entries: scorers of increasing quality, each with some
    # noise, scored on both boards.
    boards = [[t for n, t in enumerate(test) if n % 2 == 0], [t for n, t in enumerate(test) if n % 2 == 1]]
    scorers = [lambda x: 0.0, lambda x: x[0], lambda x: x[0] - 0.6 * x[1], logit]
    entries = []
    for f in scorers:
        for noise in [0, 0.5, 1.5]:
            entries.append([auc([f(r[1]) + rng.gauss(0, noise) for r in b], [r[2] for r in b]) for b in boards])
    with open(os.path.join(HERE, "leaderboard.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["public_score", "private_score"])
        for s in sorted(entries):
            w.writerow([f"{s[0]:.4f}", f"{s[1]:.4f}"])
    print(f"churn: {len(train)} train rows, {len(test)} test rows, {len(entries)} leaderboard entries")


if __name__ == "__main__":
    main()
