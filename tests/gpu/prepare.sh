#!/usr/bin/env bash
# Where the package registries are reachable (this machine, not the GPU one): fetch what
# tests/gpu/check.py needs on a GPU machine that reaches none, into the repository's .gl/
# (the Vulkan loader and the GL/EGL libraries beside it, Debian packages for amd64) and
# .whl/ (wheels for CPython 3.12 on x86-64 that such a machine lacks: wgpu and its cffi,
# gguf). Both folders are git-ignored through .git/info/exclude and travel with the run.
set -euo pipefail
cd "$(dirname "$0")/../.."
for d in .gl .whl; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
mkdir -p .gl .whl /tmp/amd64/partial
o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
apt-get $o update -qq
(cd .gl && apt-get $o download -qq libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
platforms=""
for n in 2_39 2_35 2_34 2_31 2_28 2_27 2_24 2_17; do platforms+=" --platform manylinux_${n}_x86_64"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .whl "wgpu>=0.32,<0.33" "gguf>=0.17" "cffi>=1.15" pycparser
ls .gl .whl
