"""Replay vs eager per graph key and, for a real model, batch invariance bit for bit:
`python -m graphexec determinism` (graphexec/app/determinism.py), run from a source checkout.

    python tools/determinism_check.py [--quick] [--model smollm2|PATH|CONFIG|tiny|table] ...
"""

from __future__ import annotations

import sys

from graphexec.app.determinism import fill_defaults, main, parse_args, parser  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
