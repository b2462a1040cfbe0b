# Ranks customers by tenure alone, in the direction the training data says.
import csv

train = list(csv.DictReader(open("data/train.csv")))
x = [float(r["tenure"]) for r in train]
y = [float(r["churned"]) for r in train]
mx, my = sum(x) / len(x), sum(y) / len(y)
sign = 1 if sum((a - mx) * (b - my) for a, b in zip(x, y)) > 0 else -1
with open("submission.csv", "w") as f:
    f.write("id,churned\n")
    for r in csv.DictReader(open("data/test.csv")):
        f.write(f"{r['id']},{sign * float(r['tenure'])}\n")
