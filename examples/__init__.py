"""The example plans, models and data that ship with meshplan (package data of the wheel)."""

from pathlib import Path

CORPUS = Path(__file__).parent / "data" / "corpus.txt"  # the text `meshplan run` trains on by default
