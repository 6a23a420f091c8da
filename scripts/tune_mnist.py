"""Search MNIST hyper-parameters with Ray Tune over dtk runs (``pip install 'dtk-dtensor[ray]'``).

    python scripts/tune_mnist.py --trials 4 --epochs 3                 # single-process trials, batch=4
    python scripts/tune_mnist.py --trials 4 --workers 2 --mesh batch=8  # each trial: 2 Ray Train workers
    python scripts/tune_mnist.py --address auto ...                     # on a running Ray cluster

Searches the learning rate (log-uniform) and the global batch size with ASHA (early stopping on
validation accuracy, the last 5,000 training images held out); every trial reports per-epoch
metrics to Tune through ``dtk.cluster.ray.ReportCallback``. With ``--workers 1`` a trial is one process
(``tune.with_resources``); with ``--workers N`` it drives a ``dtk.cluster.ray.DTensorTrainer`` of N DTensor
clients whose reports reach Tune via Ray's ``TuneReportCallback``. Prints the results table and
the best trial's test accuracy (the whole test set, every example counted).
"""
# The code lives in dtk.apps.tune_mnist (installed with dtk as the console script ``dtk-tune-mnist``); this file
# keeps ``python scripts/tune_mnist.py`` working from a checkout, with the same flags and behaviour.
from dtk.apps.tune_mnist import entry

if __name__ == "__main__":
    entry()
