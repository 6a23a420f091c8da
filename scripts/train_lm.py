"""Train a byte-level transformer language model on a mesh: ``python scripts/train_lm.py --help``.

The code is ``dtk.apps.train_lm`` (installed with dtk as the console script ``dtk-train-lm``); this file
keeps ``python scripts/train_lm.py`` working from a checkout, with the same flags and behaviour.
"""
from dtk.apps.train_lm import entry

if __name__ == "__main__":
    entry()
