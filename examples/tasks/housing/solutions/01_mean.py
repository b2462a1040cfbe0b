# Predicts the training mean for every house.
import csv

prices = [float(r["price"]) for r in csv.DictReader(open("data/train.csv"))]
mean = sum(prices) / len(prices)
with open("submission.csv", "w") as f:
    f.write("id,price\n")
    for r in csv.DictReader(open("data/test.csv")):
        f.write(f"{r['id']},{mean}\n")
