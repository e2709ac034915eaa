"""C extensions built with the package (see setup.py): one module per ``<name>.c``."""
