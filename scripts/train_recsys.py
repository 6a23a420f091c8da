"""Train a DLRM-style recommender on a generated click log, its largest tables sharded on their rows.

    python scripts/train_recsys.py              # batch=8: AUC within 0.01 of the best, 87 s on 2 cores
    python scripts/train_recsys.py --mesh batch=4,model=2 --table_sizes 1048576,4096,256,16

The data is ``dtk.data.clicks``: a click log generated from ``--data_seed`` one chunk at a time (ids
with Zipf popularity, labels from a hidden model), so its best achievable AUC (the hidden model's own
AUC on the held-out split) is known. The model (``dtk.models.dlrm``) reads 8 dense features through a
bottom MLP and one id per table through ``table{t}``, takes the pairwise dot products and reads them
with a top MLP. Without ``--layout``, the mesh picks the table: ``layouts/recsys_batch_rows.toml``
shards the two largest tables' rows over ``batch`` (every device), and on a mesh with a ``model``
axis ``recsys`` shards them over ``model``. Prints the mesh, the layout summary, the held-out log loss
and AUC every epoch, and at the end the AUC against the best achievable. ``--summary_json`` writes
them. Re-running with the same ``--checkpoint_dir`` resumes. Errors are one ``error:`` line, exit
status 2.
"""
# The code lives in dtk.apps.train_recsys (installed with dtk as the console script ``dtk-train-recsys``); this file
# keeps ``python scripts/train_recsys.py`` working from a checkout, with the same flags and behaviour.
from dtk.apps.train_recsys import entry

if __name__ == "__main__":
    entry()
