"""Generates the housing task: public train/test data, private answers and a
leaderboard of reference scores. Standard library only; fixed seed, so the
files are the same on every machine. Run it before using the task:

    python3 examples/tasks/housing/generate.py
"""

import csv
import math
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
rng = random.Random(20261202)


def price(x):
    return 200 + 30 * x[0] - 20 * x[1] + 10 * x[2] * x[3] + 5 * math.sin(3 * x[0])


def rows(n, start):
    out = []
    for i in range(n):
        x = [rng.gauss(0, 1) for _ in range(4)]
        out.append((start + i, x, price(x) + rng.gauss(0, 8)))
    return out


def ols(train, cols):
    """Least squares on the chosen columns plus an intercept (normal equations)."""
    X = [[1.0] + [r[1][c] for c in cols] for r in train]
    y = [r[2] for r in train]
    k = len(X[0])
    A = [[sum(X[n][i] * X[n][j] for n in range(len(X))) for j in range(k)] + [sum(X[n][i] * y[n] for n in range(len(X)))] for i in range(k)]
    for i in range(k):
        p = max(range(i, k), key=lambda r: abs(A[r][i]))
        A[i], A[p] = A[p], A[i]
        for r in range(k):
            if r != i:
                f = A[r][i] / A[i][i]
                A[r] = [a - f * b for a, b in zip(A[r], A[i])]
    return [A[i][k] / A[i][i] for i in range(k)]


def rmse(pred, truth):
    return math.sqrt(sum((p - t) ** 2 for p, t in zip(pred, truth)) / len(truth))


def main():
    train, test = rows(400, 0), rows(200, 1000)
    os.makedirs(os.path.join(HERE, "public"), exist_ok=True)
    os.makedirs(os.path.join(HERE, "private"), exist_ok=True)
    os.chmod(os.path.join(HERE, "private"), 0o700)  # the code never runs as the owner
    with open(os.path.join(HERE, "public", "train.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "x1", "x2", "x3", "x4", "price"])
        for i, x, y in train:
            w.writerow([i] + [f"{v:.5f}" for v in x] + [f"{y:.3f}"])
    with open(os.path.join(HERE, "public", "test.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "x1", "x2", "x3", "x4"])
        for i, x, _ in test:
            w.writerow([i] + [f"{v:.5f}" for v in x])
    with open(os.path.join(HERE, "private", "answers.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "target", "board"])
        for n, (i, _, y) in enumerate(test):
            w.writerow([i, f"{y:.3f}", "public" if n % 2 == 0 else "private"])
    # Reference entries: models of increasing quality, each with some noise
    # in its predictions, scored on both boards.
    boards = [[t for n, t in enumerate(test) if n % 2 == 0], [t for n, t in enumerate(test) if n % 2 == 1]]
    entries = []
    for cols, noise in [([], 0), ([0], 0), ([0], 10), ([0, 1], 0), ([0, 1], 5), ([0, 1, 2, 3], 0), ([0, 1, 2, 3], 3),
                        ([0, 1, 2, 3], 8), ([0, 1], 15), ([0], 20)]:
        beta = ols(train, cols)
        scores = []
        for b in boards:
            pred = [beta[0] + sum(beta[j + 1] * r[1][c] for j, c in enumerate(cols)) + rng.gauss(0, noise) for r in b]
            scores.append(rmse(pred, [r[2] for r in b]))
        entries.append(scores)
    # The interaction x3*x4 is what separates the best entries.
    for noise in [0, 2, 4]:
        scores = []
        for b in boards:
            scores.append(rmse([price(r[1]) + rng.gauss(0, 8 + noise) for r in b], [r[2] for r in b]))
        entries.append(scores)
    with open(os.path.join(HERE, "leaderboard.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["public_score", "private_score"])
        for s in sorted(entries):
            w.writerow([f"{s[0]:.4f}", f"{s[1]:.4f}"])
    print(f"housing: {len(train)} train rows, {len(test)} test rows, {len(entries)} leaderboard entries")


if __name__ == "__main__":
    main()
