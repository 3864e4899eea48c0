"""Applications on top of the library: the ``jquant`` command (demo, bench, ledger) and its text data."""
