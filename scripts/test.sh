#!/usr/bin/env bash
# Set up a virtual environment of its own and run the whole CPU test suite in it (the README's test command; CI
# runs it from .ci/run). Nothing installed on the machine before can hide a missing or broken requirement: the
# environment holds only what the README's requirements bring. The GPU image brings its own torch 2.11; see the
# README for which torch build these requirements install.
#
#   bash scripts/test.sh [PYTEST ARGS...]
#
#   MINI_TEST_VENV=DIR      the environment (default .venv-test in the checkout); made when missing, reused after
#   MINI_TEST_FRESH=1       remove it first: a fresh environment (what CI does)
#   MINI_TEST_TRITON=X.Y.Z  install this Triton instead of the newest the requirements allow (CI's oldest-Triton job)
#   MINI_TEST_INSTALL_ONLY=1  set up the environment and stop (CI builds its oldest-Triton one while tests run)
#   MINI_TEST_NO_INSTALL=1  run the tests in the environment as it is, installing nothing (one set up just before)
#
# First, the install check: these exact requirements must resolve from plain PyPI alone (`--isolated` ignores this
# machine's pip config, local wheels and find-links), so that a pin conflicting with torch's own requirements
# (as triton==3.6.0 did against torch 2.13's triton==3.7.1) fails here, not on a user's machine. Without PyPI
# (an offline machine) the check says so and is skipped. MINI_SKIP_INSTALL_CHECK=1 skips it too.
set -euo pipefail
cd "$(dirname "$0")/.."
REQUIREMENTS=(torch==2.13.0 -e '.[test]')
VENV=${MINI_TEST_VENV:-.venv-test}

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

PY="$VENV/bin/python"
if [[ "${MINI_TEST_NO_INSTALL:-0}" == 1 ]]; then
    if [[ ! -x "$PY" ]]; then
        echo "MINI_TEST_NO_INSTALL=1 but there is no environment at $VENV" >&2
        exit 1
    fi
else
    check_install
    if [[ "${MINI_TEST_FRESH:-0}" == 1 ]]; then
        rm -rf "$VENV"
    fi
    if [[ ! -x "$PY" ]]; then
        python3 -m venv "$VENV"
    fi
    "$PY" -m pip install -q --disable-pip-version-check "${REQUIREMENTS[@]}" \
        ${MINI_TEST_TRITON:+"triton==$MINI_TEST_TRITON"}
fi
"$PY" -c "import sys, torch, triton; print('test environment', sys.prefix, '- python', sys.version.split()[0],
          '- torch', torch.__version__, '- triton', triton.__version__, '- cpu', torch.backends.cpu.get_cpu_capability())"
if [[ "${MINI_TEST_INSTALL_ONLY:-0}" == 1 ]]; then
    exit 0
fi
# the environment's own `mini` and tools first on PATH: tests that start `mini` as a command get this one; the 25
# slowest tests are listed at the end (CI's time is spent there: the aim is under 20 minutes)
PATH="$(cd "$VENV" && pwd)/bin:$PATH" OMP_NUM_THREADS=1 "$PY" -m pytest -q -n 2 --durations=25 "$@"
