# Reads a column that does not exist: crashes.
import csv

rows = list(csv.DictReader(open("data/train.csv")))
print(sum(float(r["age"]) for r in rows))
