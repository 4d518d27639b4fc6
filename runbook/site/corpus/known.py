"""What `diagnose` misses and names falsely on the corpus, per JAX release, with reasons.

`tests/test_corpus.py` pins these exactly: a miss that starts passing, or a new miss or
false alarm, fails it; the diagnose page lists them with their reasons. A release not
listed has no pins (its outcomes are shown, not checked).
"""

from __future__ import annotations

# Expected cases the detectors do not name, per program, with the reason.
MISSES: dict[str, dict[str, str]] = {
    "per-example-grads": {
        "vmap-materialize": "the whole batch of per-example gradients is materialised by the "
        "squared norm outside vmap (op jit/integer_pow), not by an operation named vmap(...)",
    },
}
# Cases named on programs that do not exhibit them, with the reason.
FALSE_ALARMS: dict[str, dict[str, str]] = {
    "gram-per-group": {
        "attention-scores": "exp of a Gram matrix (N x N from an N x d input) has the shape "
        "and the exponential of attention scores",
    },
    "dropout-mask": {
        "donation": "the mask's output is computed from the activation, of its shape, and "
        "both are held: diagnose, compiling once, names donating it. On XLA:CPU donating "
        "frees nothing, as the output's buffer first holds the random bits; for the H100 and "
        "the v5e it frees the whole activation (tests/test_donation.py measures both)",
    },
}
KNOWN_MISSES: dict[str, dict[str, dict[str, str]]] = {"0.10.2": MISSES, "0.12.0.1": MISSES}
KNOWN_FALSE_ALARMS: dict[str, dict[str, dict[str, str]]] = {
    "0.10.2": FALSE_ALARMS,
    "0.12.0.1": FALSE_ALARMS,
}


def reason(table: dict[str, dict[str, dict[str, str]]], release: str, name: str, case: str) -> str:
    """The pinned reason for `name` and `case` on `release`, or "" where none is pinned."""
    return table.get(release, {}).get(name, {}).get(case, "")
