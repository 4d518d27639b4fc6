"""The JAX releases the version matrix measures: the one list, read by noxfile.py too.

This module imports nothing, so that nox can read it without JAX installed. Each release
must have jax and jaxlib wheels of the same version on PyPI for this machine's Python.
"""

RELEASES = ("0.4.30", "0.4.35", "0.4.38", "0.5.3", "0.6.2", "0.7.2", "0.8.3", "0.9.2", "0.10.2")
