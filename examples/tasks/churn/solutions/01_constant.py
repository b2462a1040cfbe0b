# The same probability for everyone: ranks nobody (AUC 0.5).
import csv

with open("submission.csv", "w") as f:
    f.write("id,churned\n")
    for r in csv.DictReader(open("data/test.csv")):
        f.write(f"{r['id']},0.5\n")
