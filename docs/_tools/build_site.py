"""Build the site as every build does (`nox -s docs`, Read the Docs): Sphinx, run again once
only if a page's kernel could not bind its port.

    python docs/_tools/build_site.py OUTPUT_DIR

Each page executes in a Jupyter kernel, whose TCP ports jupyter_client picks free and then
releases for the kernel to bind. In a parallel build another kernel, starting at the same
moment, can take one in between (jupyter/jupyter_client#487): the kernel dies at start with
"Address already in use" and the build fails, though nothing was measured wrong. That
failure, and no other, is built again once; what the first attempt measured is in the
build's measurement cache and is not measured again.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPHINX = ["-m", "sphinx", "-j", "auto", "-n", "-T", "-W", "--keep-going", "-b", "html", "docs"]
PORT_TAKEN = "zmq.error.ZMQError: Address already in use"


def build(output: str) -> tuple[int, bool]:
    """Run Sphinx once, passing its output on: (exit status, whether a kernel lost a port)."""
    port_taken = False
    with subprocess.Popen(
        [sys.executable, *SPHINX, output],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            port_taken = port_taken or PORT_TAKEN in line
    return proc.returncode, port_taken


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit(__doc__)
    output = str(Path(args[0]).resolve())  # Sphinx runs from the repository's root
    status, port_taken = build(output)
    if status and port_taken:
        print("build_site: a page's kernel found its port taken at start "
              "(jupyter/jupyter_client#487); building again", flush=True)  # fmt: skip
        status, _ = build(output)
    return status


if __name__ == "__main__":
    sys.exit(main())
