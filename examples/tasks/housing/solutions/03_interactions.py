# Least squares on x1..x4 and the x3*x4 interaction (normal equations).
import csv

def feats(r):
    x = [float(r[k]) for k in ("x1", "x2", "x3", "x4")]
    return [1.0] + x + [x[2] * x[3]]

train = list(csv.DictReader(open("data/train.csv")))
X = [feats(r) for r in train]
y = [float(r["price"]) for r in train]
k = len(X[0])
A = [[sum(row[i] * row[j] for row in X) for j in range(k)] + [sum(row[i] * t for row, t in zip(X, y))] for i in range(k)]
for i in range(k):
    p = max(range(i, k), key=lambda r: abs(A[r][i]))
    A[i], A[p] = A[p], A[i]
    for r in range(k):
        if r != i:
            f = A[r][i] / A[i][i]
            A[r] = [a - f * b for a, b in zip(A[r], A[i])]
beta = [A[i][k] / A[i][i] for i in range(k)]
with open("submission.csv", "w") as f:
    f.write("id,price\n")
    for r in csv.DictReader(open("data/test.csv")):
        f.write(f"{r['id']},{sum(b * v for b, v in zip(beta, feats(r)))}\n")
