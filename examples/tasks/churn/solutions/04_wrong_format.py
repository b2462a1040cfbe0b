# Writes the wrong column name: an invalid submission.
import csv

with open("submission.csv", "w") as f:
    f.write("id,probability\n")
    for r in csv.DictReader(open("data/test.csv")):
        f.write(f"{r['id']},0.5\n")
