#!/bin/bash
# FlashKDA's source (Moonshot AI's fused CUTLASS forward for chunked KDA, MIT) with the CUTLASS headers it
# pins, packed as .whl/flash_kda-src.tar.gz (ignored by git) for a device call to build (the H200 machine has
# nvcc but no network: `bash bench/gpu_session.sh flashkda` builds the wheel there and hands it back).
# Sources: local git mirrors when FLASH_KDA_GIT / CUTLASS_GIT name them (this workplace's fetch tool:
# /work/.mirror/MoonshotAI+FlashKDA/repo, /work/.mirror/NVIDIA+cutlass/repo), else GitHub.
# Only CUTLASS's headers the build includes travel (include/, tools/util/include/, examples/common/: ~28 MB
# unpacked, against the carry's 64 MiB).
set -eo pipefail
cd "$(dirname "$0")/.."
FLASH_KDA_GIT=${FLASH_KDA_GIT:-https://github.com/MoonshotAI/FlashKDA.git}
CUTLASS_GIT=${CUTLASS_GIT:-https://github.com/NVIDIA/cutlass.git}
FLASH_KDA_REV=${FLASH_KDA_REV:-1ce47ea}  # the revision RESULTS.md's figures were measured on
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone -q "$FLASH_KDA_GIT" "$work/flash-kda"
git -C "$work/flash-kda" checkout -q "$FLASH_KDA_REV"
pin=$(git -C "$work/flash-kda" ls-tree HEAD cutlass | awk '{print $3}')  # the submodule's commit
git clone -q --no-checkout "$CUTLASS_GIT" "$work/cutlass"
git -C "$work/cutlass" archive "$pin" include tools/util/include examples/common | tar -x -C "$work/flash-kda/cutlass"
# setup.py runs `git submodule update` and reads the revision: neither needs the network once cutlass/ is filled
mkdir -p .whl
tar -czf .whl/flash_kda-src.tar.gz -C "$work" --exclude=.git flash-kda
echo "FlashKDA $(git -C "$work/flash-kda" rev-parse --short HEAD), CUTLASS ${pin:0:10}: $(du -h .whl/flash_kda-src.tar.gz | cut -f1)"
