# Writes predictions without the id column: an invalid submission.
import csv

with open("submission.csv", "w") as f:
    f.write("price\n")
    for r in csv.DictReader(open("data/test.csv")):
        f.write("200\n")
