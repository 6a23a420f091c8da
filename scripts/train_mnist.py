"""Train an MNIST model with dtk on a mesh: the command every dtk user runs first.

    python scripts/train_mnist.py --mesh batch=8                       # TFDS MNIST, else the bundled sample
    python scripts/train_mnist.py --mesh batch=8 --dataset idx --data_dir ../shared/data/mnist
    python scripts/train_mnist.py --mesh batch=4,model=2 --layout mlp_model_parallel ...

Prints the mesh, the layout summary, a progress bar per epoch, per-epoch train loss and accuracy,
then loss and accuracy on the whole test set (every example counted). ``--summary_json`` writes the
results as one JSON object. Re-running with the same ``--checkpoint_dir`` resumes.

Every user error (a bad flag, a layout table that does not fit the model, an unwritable output path,
a checkpoint of another model) is one ``error:`` line on stderr and exit status 2, found before
training where it can be. TensorFlow's start-up log lines are hidden unless ``--verbosity`` is given.
"""
# The code lives in dtk.apps.train_mnist (installed with dtk as the console script ``dtk-train-mnist``); this file
# keeps ``python scripts/train_mnist.py`` working from a checkout, with the same flags and behaviour.
from dtk.apps.train_mnist import entry

if __name__ == "__main__":
    entry()
