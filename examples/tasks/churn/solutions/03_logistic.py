# Logistic regression on the features and the tenure x discount
# interaction, fitted by gradient descent.
import csv
import math


def features(r):
    t, c, d = float(r["tenure"]), float(r["complaints"]), float(r["discount"])
    return [1.0, t, c, d, t * d]


train = list(csv.DictReader(open("data/train.csv")))
X = [features(r) for r in train]
y = [float(r["churned"]) for r in train]
w = [0.0] * len(X[0])
for _ in range(400):
    grad = [0.0] * len(w)
    for xi, yi in zip(X, y):
        p = 1 / (1 + math.exp(-sum(a * b for a, b in zip(w, xi))))
        for j, v in enumerate(xi):
            grad[j] += (p - yi) * v
    w = [a - 0.5 * g / len(X) for a, g in zip(w, grad)]
with open("submission.csv", "w") as f:
    f.write("id,churned\n")
    for r in csv.DictReader(open("data/test.csv")):
        z = sum(a * b for a, b in zip(w, features(r)))
        f.write(f"{r['id']},{1 / (1 + math.exp(-z))}\n")
