#!/bin/bash
# Build tma_probe.cu and run each variant in its own process (see the file's header).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${TMPDIR:-/tmp}/tma_probe
nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o "$BIN" "$HERE/tma_probe.cu" 2>&1 | grep -v -i deprecat | grep -i error
for v in 0 1 2 3 4; do timeout 60 "$BIN" $v; echo "variant $v exit $?"; done
