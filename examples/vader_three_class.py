"""Build a three-class sentiment CSV (negative / neutral / positive) from the crowd ratings shipped in
the vaderSentiment 3.3.2 source distribution (Hutto & Gilbert, ICWSM 2014; MIT licence), fetched
from PyPI with pip. docs/tasks.md trains `task=custom` on it:

    python examples/vader_three_class.py --set amazon --out data/amazon3.csv
    python -m distzo train task=custom task.path=data/amazon3.csv ...

Each line of the set's `*_GroundTruth.txt` is `id <TAB> mean rating in [-4, 4] <TAB> text`; the label
is negative below -0.5, positive above 0.5, neutral in between. Columns: text, rating, label.
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "vadersentiment==3.3.2"
SETS = {"amazon": "amazonReviewSnippets_GroundTruth.txt", "tweets": "tweets_GroundTruth.txt",
        "nyt": "nytEditorialSnippets_GroundTruth.txt", "movies": "movieReviewSnippets_GroundTruth.txt"}
THRESHOLD = 0.5


def label(rating: float) -> str:
    return "negative" if rating < -THRESHOLD else "positive" if rating > THRESHOLD else "neutral"


def ground_truth(name: str, cache: Path) -> str:
    """The text of one ground-truth file, from the sdist (downloaded into `cache` once)."""
    archives = sorted(cache.glob("vaderSentiment-*.tar.gz"))
    if not archives:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", SDIST,
                        "-d", str(cache)], check=True)
        archives = sorted(cache.glob("vaderSentiment-*.tar.gz"))
    with tarfile.open(archives[0]) as outer:
        inner_member = next(m for m in outer.getmembers() if m.name.endswith("hutto_ICWSM_2014.tar.gz"))
        inner = tarfile.open(fileobj=io.BytesIO(outer.extractfile(inner_member).read()))
        member = next(m for m in inner.getmembers() if m.name.endswith(name))
        return inner.extractfile(member).read().decode("utf-8", errors="replace")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=sorted(SETS), default="amazon")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "distzo-vader")
    ns = parser.parse_args()
    ns.cache.mkdir(parents=True, exist_ok=True)
    rows = []
    for line in ground_truth(SETS[ns.set], ns.cache).splitlines():
        parts = line.strip().split("\t", 2)
        if len(parts) == 3 and parts[2].strip():
            rows.append({"text": parts[2].strip(), "rating": float(parts[1]), "label": label(float(parts[1]))})
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    with open(ns.out, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, ["text", "rating", "label"])
        writer.writeheader()
        writer.writerows(rows)
    counts = {k: sum(r["label"] == k for r in rows) for k in ("negative", "neutral", "positive")}
    print(f"{ns.out}: {len(rows)} {ns.set} snippets, {counts}")


if __name__ == "__main__":
    main()
