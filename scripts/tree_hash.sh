#!/usr/bin/env bash
# A hash of the code a device call ran (mini/, scripts/, tools/ and tests/, by content and path), printed by
# scripts/gpu.sh's env phase: run it on this machine to name the commit a call's tree was (no git needed there).
cd "$(dirname "$0")/.."
find mini scripts tools tests -type f \( -name '*.py' -o -name '*.sh' \) -not -path '*/__pycache__/*' | LC_ALL=C sort \
    | while read -r f; do printf '%s %s\n' "$(sha1sum < "$f" | cut -c1-40)" "$f"; done | sha1sum | cut -c1-12
