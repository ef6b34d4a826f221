#!/usr/bin/env bash
# Set up a fresh CPU machine and run the whole test suite (what CI runs: .ci/run). The GPU image brings its own
# torch 2.11; see the README for which torch build these requirements install.
#
# First, the install check: these exact requirements must resolve from plain PyPI alone (`--isolated` ignores this
# machine's pip config, local wheels and find-links), so that a pin conflicting with torch's own requirements
# (as triton==3.6.0 did against torch 2.13's triton==3.7.1) fails here, not on a user's machine. Without PyPI
# (an offline machine) the check says so and is skipped. MINI_SKIP_INSTALL_CHECK=1 skips it too.
set -euo pipefail
cd "$(dirname "$0")/.."
REQUIREMENTS=(torch==2.13.0 -e '.[test]')

check_install() {
    if [[ "${MINI_SKIP_INSTALL_CHECK:-0}" == 1 ]]; then
        echo "install check: skipped (MINI_SKIP_INSTALL_CHECK=1)"
        return
    fi
    if ! python3 -c "import urllib.request as u; u.urlopen('https://pypi.org/simple/pip/', timeout=15)" 2>/dev/null; then
        echo "install check: skipped, PyPI is not reachable from here"
        return
    fi
    local log
    log=$(mktemp)
    if python3 -m pip install --dry-run --isolated --ignore-installed --disable-pip-version-check -q \
            "${REQUIREMENTS[@]}" >"$log" 2>&1; then
        echo "install check: ${REQUIREMENTS[*]} resolves from plain PyPI"
        rm -f "$log"
    else
        cat "$log"
        rm -f "$log"
        echo "install check FAILED: ${REQUIREMENTS[*]} does not resolve from plain PyPI" >&2
        return 1
    fi
}

check_install
python3 -m pip install -q "${REQUIREMENTS[@]}"
OMP_NUM_THREADS=1 python3 -m pytest -q -n 2 "$@"
