"""Train the DLRM-style recommender on a mesh: ``python scripts/train_recsys.py --help``.

The code is ``dtk.apps.train_recsys`` (installed with dtk as the console script ``dtk-train-recsys``); this file
keeps ``python scripts/train_recsys.py`` working from a checkout, with the same flags and behaviour.
"""
from dtk.apps.train_recsys import entry

if __name__ == "__main__":
    entry()
