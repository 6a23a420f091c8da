"""Search MNIST hyper-parameters with Ray Tune over dtk runs: ``python scripts/tune_mnist.py --help``.

The code is ``dtk.apps.tune_mnist`` (installed with dtk as the console script ``dtk-tune-mnist``); this file
keeps ``python scripts/tune_mnist.py`` working from a checkout, with the same flags and behaviour.
"""
from dtk.apps.tune_mnist import entry

if __name__ == "__main__":
    entry()
