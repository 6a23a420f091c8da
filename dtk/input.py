"""Deprecated: moved to ``dtk.data.input`` (dtk._moved); this path goes in the next release."""
from dtk import _moved

_moved.redirect(__name__, __spec__ and __spec__.name)
