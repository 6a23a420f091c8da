"""Train an MNIST model with dtk on a mesh: ``python scripts/train_mnist.py --help``.

The code is ``dtk.apps.train_mnist`` (installed with dtk as the console script ``dtk-train-mnist``); this file
keeps ``python scripts/train_mnist.py`` working from a checkout, with the same flags and behaviour.
"""
from dtk.apps.train_mnist import entry

if __name__ == "__main__":
    entry()
