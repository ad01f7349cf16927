"""The one thing pyproject.toml cannot say: an optional C helper (``kvdepot.transfer._native``).

It is built where a C compiler and CPython >= 3.11 are at hand, against the limited API (one
abi3 binary for 3.11 on), and skipped with a warning where the build fails: ``pip install``
never needs a compiler, and kvdepot does the same work in Python without it (a few microseconds
more per window of copies; on an H100, 0.5-1.7 points of a 256 KiB-block move against memcpy:
docs/perf-notes.md, issue 19, twenty-fifth pass).
"""

import sys

from setuptools import Extension, setup

native = sys.implementation.name == "cpython" and sys.version_info >= (3, 11)
setup(
    ext_modules=[Extension("kvdepot.transfer._native", ["src/kvdepot/transfer/_native.c"],
                           py_limited_api=True, optional=True)] if native else [],
    options={"bdist_wheel": {"py_limited_api": "cp311"}} if native else {},
)
