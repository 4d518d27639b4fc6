"""Doctests run over the package (``--doctest-modules``); these modules are not for import."""

collect_ignore = ["runbook/__main__.py", "noxfile.py", "docs"]
