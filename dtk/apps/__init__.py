"""dtk's applications: the training programs behind the console scripts.

``dtk-train-mnist`` (``train_mnist``), ``dtk-train-lm`` (``train_lm``), ``dtk-train-recsys``
(``train_recsys``) and ``dtk-tune-mnist`` (``tune_mnist``), installed with the package; in a
checkout ``python scripts/<name>.py`` runs the same code. Each binds its command line (absl
flags, ``dtk.cli``) to the library; nothing in the library imports them.
"""
