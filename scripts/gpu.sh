#!/usr/bin/env bash
# The one device script: `bash scripts/gpu.sh PHASE[:SECONDS] ...` runs the named phases in order on the GPU
# machine, each under its own time cap, and leaves everything under $OUT (one bundle.tgz plus log.txt: at most
# 8 files come back from a device call). Carry `.whl` (the optional wheels: `bash scripts/wheels.sh`) with the call.
#
# This file is the driver; the phases live by area in scripts/gpu/*.sh (general, fidelity, rank4, kernels, serving,
# parallel, determinism). A phase is a shell function `phase_NAME` there that writes its results under
# "$OUT/NAME/"; it sees $OUT, $PHASE_DIR (= $OUT/NAME) and the installed wheels. Add a phase next to the others of
# its area. Durations in the phases' comments were measured on the H200 (reports in docs/perf/); give each phase a
# cap above them (`NAME:SECONDS`). Knobs are environment variables with the defaults shown, e.g.
# `AB_REPEAT=2 bash scripts/gpu.sh rank4_ab:500`.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HUMMING_CACHE_DIR=/tmp/humming_cache PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
log="$OUT/log.txt"
DEADLINE=${DEADLINE:-580}  # seconds for the whole script, under the call's 600 s limit

install_wheels() {  # carried wheels: the server's pure-Python deps, grammar engine, optional GPU libraries
    local wheels
    wheels=$(ls .whl/serve/*.whl .whl/gpu/*.whl 2>/dev/null)
    if [ -n "$wheels" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $wheels >>"$log" 2>&1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    # the `mini` command for the phases that call it (no deps: the image has torch; the wheels above bring the rest)
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$log" 2>&1
    mkdir -p "$HUMMING_CACHE_DIR"
    [ -f .whl/humming_cache.tgz ] && tar xzf .whl/humming_cache.tgz -C "$HUMMING_CACHE_DIR"
}

bundle() {
    (cd "$OUT" && tar czf bundle.tgz --exclude bundle.tgz --exclude '*.gz' . 2>/dev/null)
}

# ---------------------------------------------------------------- driver

for area in scripts/gpu/*.sh; do
    source "$area"
done
for arg in "${@:-env gpu_tests}"; do  # every name must be a phase before anything runs
    for item in $arg; do
        declare -F "phase_${item%%:*}" >/dev/null \
            || { echo "gpu.sh: no phase ${item%%:*} (scripts/gpu/*.sh)" >&2; exit 2; }
    done
done
install_wheels
for arg in "${@:-env gpu_tests}"; do
    for item in $arg; do
        name=${item%%:*}; cap=${item#*:}; [ "$cap" = "$item" ] && cap=300
        left=$((DEADLINE - SECONDS)); [ "$left" -lt "$cap" ] && cap=$left
        if [ "$cap" -le 5 ]; then echo "$name skipped (deadline)" >>"$log"; continue; fi
        export PHASE_DIR="$OUT/$name" PHASE_CAP="$cap"; mkdir -p "$PHASE_DIR"
        timeout "$cap" bash -c "$(declare -f); phase_$name" >"$PHASE_DIR/out.log" 2>&1
        echo "== $name rc=$? (${SECONDS}s)" >>"$log"; tail -6 "$PHASE_DIR/out.log" >>"$log"; bundle
    done
done
bundle
cat "$log"
