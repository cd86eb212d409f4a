#!/usr/bin/env bash
# scripts/build-capi.sh [--release]
#
# Builds gixl's C library and puts it in target/capi/:
#   libgixl.so        the shared library (cargo's cdylib)
#   libnixl_capi.so   the same library under NIXL's name, for programs and crates (nixl-sys with the
#                     `stub-api` feature dlopen()s "libnixl_capi.so") written against NVIDIA NIXL
#   libgixl.a         the static library
#   gixl.h            a copy of include/gixl.h
#   include/          NIXL's C++ API over gixl (nixl.h, nixl_types.h, nixl_params.h, nixl_descriptors.h,
#                     serdes/serdes.h, utils/: header-only) and gixl.h: c++ -std=c++17 -Itarget/capi/include ... -lgixl
#   nixl/             the same as a NIXL install prefix, for build systems that look for one (nixlbench's
#                     -Dnixl_path): include/ as above; lib/ and lib/<multiarch>/ with libnixl.so (gixl itself) and
#                     libnixl_build.so, libserdes.so (empty: gixl is one library; they exist for the link line)
# Link with: cc ... -Itarget/capi -Ltarget/capi -lnixl_capi   (or -lgixl); run with LD_LIBRARY_PATH=target/capi.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
profile=debug
args=()
case "${1:-}" in
    --release) profile=release; args=(--release) ;;
    "") ;;
    *) echo "usage: $0 [--release]" >&2; exit 2 ;;
esac

cd "$root"
cargo build --lib "${args[@]}"
target="${CARGO_TARGET_DIR:-$root/target}"
out="$target/capi"
mkdir -p "$out"
# Copy (not link) so the files stay what they were when this ran, whatever cargo rebuilds later.
cp -f "$target/$profile/libgixl.so" "$out/libgixl.so"
cp -f "$target/$profile/libgixl.so" "$out/libnixl_capi.so"
cp -f "$target/$profile/libgixl.a" "$out/libgixl.a"
cp -f "$root/include/gixl.h" "$out/gixl.h"
rm -rf "$out/include"
mkdir -p "$out/include"
cp -rf "$root/include/nixl/." "$out/include/"
cp -f "$root/include/gixl.h" "$out/include/gixl.h"
prefix="$out/nixl"
rm -rf "$prefix"
mkdir -p "$prefix/lib"
cp -r "$out/include" "$prefix/include"
cp -f "$target/$profile/libgixl.so" "$prefix/lib/libnixl.so"
cc -shared -fPIC -x c /dev/null -o "$prefix/lib/libnixl_build.so"
cc -shared -fPIC -x c /dev/null -o "$prefix/lib/libserdes.so"
multiarch=$(cc -print-multiarch 2>/dev/null || true)
[ -z "$multiarch" ] || ln -sfn . "$prefix/lib/$multiarch"
n=$(nm -D --defined-only "$out/libnixl_capi.so" | grep -c ' T nixl_capi_' || true)
echo "target/capi ($profile): libgixl.so, libnixl_capi.so, libgixl.a, gixl.h, include/ (C++), nixl/ (an install prefix); $n nixl_capi_* functions exported"
