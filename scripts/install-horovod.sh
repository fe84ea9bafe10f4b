#!/usr/bin/env bash
# Build and install Horovod 0.28.1 (PyTorch + Gloo) against the torch already installed.
#
# Why this script exists: Horovod's last release, 0.28.1, does not build against torch >= 2.1
# as published. This script downloads the release from the package index, applies the build
# fixes at build time (the Horovod sources are never committed here), builds a wheel against the
# installed torch, caches that wheel, installs it and checks it with `horovodrun --check-build`.
#
# The build fixes:
#   1. torch's headers require C++17 ("C++17 or later compatible compiler is required to use
#      PyTorch"); Horovod asks for C++14 (top-level CMakeLists.txt, horovod/torch/CMakeLists.txt).
#      Both are set to 17.
#   2. With only (1), linking mpi_lib_v2 fails with "multiple definition of
#      gloo::rendezvous::Store::kDefaultTimeout": the bundled gloo is compiled as C++11/14, where
#      store.cc holds a strong out-of-line definition of that static constexpr member, while the
#      Horovod sources, now C++17, emit it as an inline (STB_GNU_UNIQUE, COMDAT) variable. Instead
#      of hiding every duplicate symbol with -Wl,--allow-multiple-definition, the bundled gloo is
#      compiled as C++17 as well (third_party/gloo/CMakeLists.txt: -std=c++11 -> -std=c++17), so all
#      objects agree and the linker merges the one inline definition. Horovod itself builds gloo
#      as C++17 for TensorFlow (its "compatible17_gloo"), so gloo is known to compile that way.
#   3. CMake asks distutils for the Python include dir; distutils is gone in Python 3.12, so the
#      query uses sysconfig, which gives the same path.
#
# Build: Gloo controller and CPU operations always; NCCL GPU operations only where nvcc is on PATH
# and torch is a CUDA build. MPI, TensorFlow and MXNet are left out. pip builds with
# --no-build-isolation --no-deps, so the installed torch is used and no other torch is downloaded;
# Horovod's runtime dependencies are installed under a constraints file that pins the installed
# torch version, so they can never upgrade it.
#
# Cache: ${DISTDOCTOR_CACHE:-$HOME/.cache/distdoctor}/wheels/<key>/, where the key holds the Horovod
# version, the torch version, the Python tag, the GPU operations and the revision of the fixes
# above. A second run installs the cached wheel in seconds.
#
# Usage: scripts/install-horovod.sh [--rebuild] [--python PYTHON]
#   --rebuild        ignore the cached wheel and build again
#   --python PYTHON  interpreter to build for and install into (default: $PYTHON or python3)
# Environment: MAKEFLAGS (default -j<number of cores>), DISTDOCTOR_CACHE.
# Exit status: 0 installed and verified, 1 failure (the message says which step and where the log is).
set -euo pipefail

HOROVOD_VERSION=0.28.1
FIXES_REVISION=1   # bump when the patches below change, so cached wheels are rebuilt
PYTHON_BIN=${PYTHON:-python3}
REBUILD=0

while [[ $# -gt 0 ]]; do
    case "$1" in
        --rebuild) REBUILD=1; shift ;;
        --python) PYTHON_BIN=$2; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "install-horovod: unknown argument '$1' (try --help)" >&2; exit 1 ;;
    esac
done

say() { echo "install-horovod: $*"; }
die() { echo "install-horovod: ERROR: $*" >&2; exit 1; }

command -v "$PYTHON_BIN" >/dev/null || die "no Python interpreter '$PYTHON_BIN'"
TORCH_VERSION=$("$PYTHON_BIN" -c 'import torch; print(torch.__version__)' 2>/dev/null) \
    || die "torch is not importable by $PYTHON_BIN: install torch first (Horovod is built against it)"
PY_TAG=$("$PYTHON_BIN" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
TORCH_CUDA=$("$PYTHON_BIN" -c 'import torch; print(torch.version.cuda or "")')

GPU_OPERATIONS=""
if [[ -n "$TORCH_CUDA" ]] && command -v nvcc >/dev/null; then
    GPU_OPERATIONS=NCCL
fi

CACHE_ROOT=${DISTDOCTOR_CACHE:-$HOME/.cache/distdoctor}
CACHE_KEY="horovod-${HOROVOD_VERSION}_torch-${TORCH_VERSION}_${PY_TAG}_${GPU_OPERATIONS:-cpu}_fixes-${FIXES_REVISION}"
WHEEL_DIR="$CACHE_ROOT/wheels/$CACHE_KEY"
say "torch $TORCH_VERSION, $PY_TAG, GPU operations: ${GPU_OPERATIONS:-none (CPU, Gloo)}"
say "wheel cache: $WHEEL_DIR"

WORK_DIR=$(mktemp -d "${TMPDIR:-/tmp}/install-horovod.XXXXXX")
trap 'rm -rf "$WORK_DIR"' EXIT

# Pin the installed torch so that nothing pip installs here can replace it.
CONSTRAINTS="$WORK_DIR/constraints.txt"
echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"

# Replace a literal string in a file, failing loudly if the release no longer contains it.
patch_file() {
    local file=$1 from=$2 to=$3
    grep -qF -- "$from" "$file" || die "build fix not applicable: '$from' not found in $file"
    FROM="$from" TO="$to" "$PYTHON_BIN" - "$file" <<'EOF'
import os, sys
path = sys.argv[1]
text = open(path).read()
open(path, "w").write(text.replace(os.environ["FROM"], os.environ["TO"]))
EOF
}

build_wheel() {
    say "downloading the horovod $HOROVOD_VERSION source release"
    (cd "$WORK_DIR" && "$PYTHON_BIN" -m pip download --quiet --no-deps --no-binary :all: \
        "horovod==$HOROVOD_VERSION" -d .) || die "could not download horovod==$HOROVOD_VERSION"
    tar -xzf "$WORK_DIR/horovod-$HOROVOD_VERSION.tar.gz" -C "$WORK_DIR"
    local src="$WORK_DIR/horovod-$HOROVOD_VERSION"

    say "applying the build fixes (C++17 for Horovod, its torch extension and its bundled gloo)"
    patch_file "$src/CMakeLists.txt" 'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 17)'
    patch_file "$src/horovod/torch/CMakeLists.txt" 'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 17)'
    patch_file "$src/third_party/gloo/CMakeLists.txt" '-std=c++11 -fPIC' '-std=c++17 -fPIC'
    patch_file "$src/horovod/torch/CMakeLists.txt" \
        'from distutils.sysconfig import get_python_inc; print(get_python_inc())' \
        "import sysconfig; print(sysconfig.get_paths()['include'])"

    local log="$CACHE_ROOT/logs/build-$CACHE_KEY.log"
    mkdir -p "$(dirname "$log")" "$WORK_DIR/wheel"
    say "building the wheel (several minutes; log: $log)"
    local started=$SECONDS
    if ! env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
            HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
            ${GPU_OPERATIONS:+HOROVOD_GPU_OPERATIONS=$GPU_OPERATIONS} \
            MAKEFLAGS="${MAKEFLAGS:--j$(nproc)}" \
            "$PYTHON_BIN" -m pip wheel --verbose --no-build-isolation --no-deps \
            -w "$WORK_DIR/wheel" "$src" > "$log" 2>&1; then
        tail -n 30 "$log" >&2
        die "the Horovod build failed after $((SECONDS - started)) s; full log: $log"
    fi
    say "built in $((SECONDS - started)) s"
    mkdir -p "$WHEEL_DIR"
    mv "$WORK_DIR"/wheel/horovod-*.whl "$WHEEL_DIR/"
}

if [[ $REBUILD == 1 ]]; then
    rm -rf "$WHEEL_DIR"
fi
if ! compgen -G "$WHEEL_DIR/horovod-*.whl" >/dev/null; then
    build_wheel
else
    say "using the cached wheel"
fi
WHEEL=$(compgen -G "$WHEEL_DIR/horovod-*.whl" | head -n 1)

# The sha256 pip recorded when it installed horovod from a wheel file (empty if not so installed).
installed_wheel_hash() {
    "$PYTHON_BIN" - <<'PY' 2>/dev/null || true
import importlib.metadata, json
info = json.loads(importlib.metadata.distribution("horovod").read_text("direct_url.json") or "{}")
print(info.get("archive_info", {}).get("hashes", {}).get("sha256", ""))
PY
}

WHEEL_HASH=$(sha256sum "$WHEEL" | cut -d' ' -f1)
if [[ $(installed_wheel_hash) == "$WHEEL_HASH" ]]; then
    say "$(basename "$WHEEL") is already installed"
else
    say "installing $(basename "$WHEEL")"
    "$PYTHON_BIN" -m pip install --quiet --force-reinstall --no-deps "$WHEEL" \
        || die "pip could not install $WHEEL"
    # Horovod's runtime dependencies (cloudpickle, psutil, pyyaml, packaging), never a new torch.
    "$PYTHON_BIN" -m pip install --quiet -c "$CONSTRAINTS" "$WHEEL" \
        || die "pip could not install Horovod's runtime dependencies"
fi
[[ $("$PYTHON_BIN" -c 'import torch; print(torch.__version__)') == "$TORCH_VERSION" ]] \
    || die "torch changed during the install; expected $TORCH_VERSION"

say "verifying with horovodrun --check-build"
HOROVODRUN="$(dirname "$(command -v "$PYTHON_BIN")")/horovodrun"
[[ -x $HOROVODRUN ]] || HOROVODRUN=horovodrun
CHECK=$("$HOROVODRUN" --check-build 2>&1) || { echo "$CHECK" >&2; die "horovodrun --check-build failed"; }
echo "$CHECK"
grep -qE '\[X\] PyTorch' <<<"$CHECK" || die "Horovod was installed without PyTorch support"
grep -qE '\[X\] Gloo' <<<"$CHECK" || die "Horovod was installed without the Gloo controller"
"$PYTHON_BIN" -c 'import horovod.torch as hvd; hvd.init(); assert hvd.size() == 1' \
    || die "import horovod.torch failed after the install"
say "Horovod $HOROVOD_VERSION is installed with PyTorch and Gloo"
