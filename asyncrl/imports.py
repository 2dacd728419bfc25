"""Importing a third-party module without one of its optional imports (start-up time).

Some dependencies import a heavy package they do not need for what asyncrl uses them for
(tensorboardX imports torch for a type alias; flax imports IPython to ask whether a notebook
runs). :func:`import_without` imports such a module once, with ``import <blocked>`` failing
for it (``sys.modules[blocked] = None`` makes the import raise ImportError, which those
modules catch); afterwards ``blocked`` imports normally. Call it only where no other thread
may be importing ``blocked`` at the same moment (at start-up, before any thread starts).
"""

from __future__ import annotations

import importlib
import sys


def import_without(module: str, blocked: str) -> None:
    """Import ``module`` with ``import blocked`` failing for it; nothing when either is already imported."""
    if module in sys.modules or blocked in sys.modules:
        return
    sys.modules[blocked] = None  # type: ignore[assignment]  # makes `import <blocked>` raise ImportError
    try:
        importlib.import_module(module)
    finally:
        if blocked in sys.modules and sys.modules[blocked] is None:
            del sys.modules[blocked]
