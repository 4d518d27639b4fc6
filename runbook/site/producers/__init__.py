"""The data producers that `nox` runs and the site reads: the version matrix (``nox -s
versions``: `runbook.site.producers.matrix`), real GPU peaks (``nox -s gpu``:
`runbook.site.producers.gpu`) and the build benchmark (``nox -s bench``:
`runbook.site.producers.bench`). Each writes a JSON file under ``docs/_data/``, with its
provenance; the docs build only reads them."""
