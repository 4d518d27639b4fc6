"""One module per case: the reproduction, its fixes and their inputs, which a reader copies.

A case module imports JAX, NumPy (optax where needed) and `runbook._case_types`, nothing else of
the package; its page's claims and experiments are in ``runbook.site.<case>``.
"""
