#!/usr/bin/env bash
# On the GPU machine, which reaches no package registry, from the repository's root with .gl/
# and .whl/ beside it (tests/gpu/prepare.sh fills them where the registries are reachable):
# unpack the Vulkan loader, install the carried wheels and ggwgpu, name the NVIDIA driver if
# Vulkan finds no hardware adapter, and run tests/gpu/check.py, its output also written to
# the log file given (default gpu-check.log) as it comes, within the seconds given (default
# 480: the table prints before a 10-minute call ends), each bench's JSON report kept in
# gpu-reports.json beside the log. Exit code: the check's.
#
#     bash tests/gpu/run.sh "$OUT/gpu-check.log" 480
set -uo pipefail
cd "$(dirname "$0")/../.."
log=${1:-gpu-check.log}
budget=${2:-480}
start=$SECONDS
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . || exit 1
hardware() {
    python3 -c "import sys, wgpu; sys.exit(not any(a.info['adapter_type'] != 'CPU'
                for a in wgpu.gpu.enumerate_adapters_sync()))" 2>/dev/null
}
if ! hardware; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    echo "no hardware adapter found: VK_DRIVER_FILES=$VK_DRIVER_FILES"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$log"
PYTHONUNBUFFERED=1 python3 tests/gpu/check.py --budget $((budget - SECONDS + start)) \
    --reports "$(dirname "$log")/gpu-reports.json" 2>&1 | tee -a "$log"
