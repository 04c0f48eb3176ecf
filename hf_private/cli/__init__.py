"""Applications on top of the library: the `hf-private-audit` command."""
