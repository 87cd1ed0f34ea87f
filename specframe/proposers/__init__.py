"""Built-in proposers. They register through the same plugin hook as third-party ones (see `builtin.py`)."""
