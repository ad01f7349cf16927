#!/usr/bin/env bash
# A digest of src/'s Python and C sources, the same on the device machine and here: which tree a
# device run ran (its checkout's HEAD may name an older commit than the working tree carried).
# Usage, from the repository root: bash src/kvdepot/bench/src_digest.sh
find src -type f \( -name '*.py' -o -name '*.c' -o -name '*.sh' \) -not -path '*/__pycache__/*' | LC_ALL=C sort \
  | xargs sha1sum | sha1sum | cut -c1-12
