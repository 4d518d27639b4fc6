import sys

try:
    from ._cli import main
except ImportError as e:  # an unsupported Python or JAX, or JAX missing: one line
    sys.exit(f"runbook: error: {e}")

sys.exit(main())
