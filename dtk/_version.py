"""The one place dtk's version is written (read by setup.cfg and ``dtk.__version__``)."""

__version__ = "0.2.0"
