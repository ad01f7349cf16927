"""The optional C helper, ``_native`` (``_native.c``), or None where it was not built.

``setup.py`` builds it where a C compiler and CPython >= 3.11 are at hand and skips it where they
are not, so ``pip install`` never needs a compiler. Where it is None, ``plan`` and ``cuda_batch``
do the same work in Python: the same copy lists (tests compare the two), slower by a few
microseconds per window of copies, which is what a 256 KiB-block move's first copies wait for on
a GPU host (issue 19).
"""

from __future__ import annotations

from types import ModuleType

NATIVE: ModuleType | None
try:
    from kvdepot.transfer import _native as NATIVE
except ImportError:  # not built: no compiler at install time, or Python < 3.11
    NATIVE = None
