"""hf_private's version, in a module of its own so that the card can name it without importing the package.

`hf_private/__init__.py` imports the trainer; a module the trainer uses (the model card) importing the package back,
even inside a function, would close an import circle through the trainer (tests/project/test_import_graph.py).
"""

__version__ = "0.1.0"
