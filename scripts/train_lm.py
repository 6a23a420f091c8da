"""Train a byte-level transformer language model with data x model parallelism, on any machine.

    python scripts/train_lm.py --mesh batch=2,model=4            # Python's stdlib source, no download
    python scripts/train_lm.py --mesh batch=8 --text_file book.txt --steps 2000

The corpus is the Python standard library's own ``.py`` files (split into training and held-out
text by file) or ``--text_file``. Prints the mesh, the layout summary with weights and optimizer
state per device, a progress bar, the held-out loss in bits per byte every ``--eval_every`` steps
next to the corpus's byte-unigram entropy, and at the end a sample generated from ``--prompt``
on the laid-out model. ``--summary_json`` writes ``train_loss`` (one entry per evaluation
interval), ``heldout_bits_per_byte``, ``unigram_bits_per_byte`` and the rest. Re-running with the
same ``--checkpoint_dir`` resumes. Errors are one ``error:`` line, exit status 2.
"""
# The code lives in dtk.apps.train_lm (installed with dtk as the console script ``dtk-train-lm``); this file
# keeps ``python scripts/train_lm.py`` working from a checkout, with the same flags and behaviour.
from dtk.apps.train_lm import entry

if __name__ == "__main__":
    entry()
