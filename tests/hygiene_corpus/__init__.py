"""Labelled hygiene corpus: generated positives and negatives per family, plus hand-written
tricky negatives (see `cases.py`). Used by tests/test_hygiene_corpus.py and the benchmark."""
