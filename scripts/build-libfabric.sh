#!/usr/bin/env bash
# scripts/build-libfabric.sh PREFIX [CUDA_DIR] — libfabric 2.1.0 from Debian's source tarball (trixie's original
# tarball, its SHA-256 checked, kept in ~/.cache/gixl/src), built into PREFIX/usr with the library under
# PREFIX/usr/lib/x86_64-linux-gnu (the layout of Debian's unpacked packages, which tests/common/fabric.rs reads):
# the tcp, udp, shm and utility (rxm, rxd) providers only. With CUDA_DIR (a folder holding include/cuda.h and
# include/cuda_runtime.h), libfabric's CUDA memory support too, CUDA opened at run time (--enable-cuda-dlopen:
# libcudart.so, libcuda.so.1 and libnvidia-ml.so.1 where it runs). Needs autoconf, automake, libtool, a C compiler
# (scripts/setup.sh installs them). About a minute on 2 cores.
set -euo pipefail
prefix=${1:?usage: scripts/build-libfabric.sh PREFIX [CUDA_DIR]}
cuda=${2:-}
src_dir="$HOME/.cache/gixl/src"
tarball="$src_dir/libfabric_2.1.0.orig.tar.xz"
mkdir -p "$src_dir"
if [ ! -f "$tarball" ]; then
    python3 - "$tarball" <<'PY'
import hashlib, sys, urllib.request
url = "https://deb.debian.org/debian/pool/main/libf/libfabric/libfabric_2.1.0.orig.tar.xz"
want = "1a66369772d5bb151737214af1c478993e969cf298e8f9ed369e7a2ab8d8c6df"
data = urllib.request.urlopen(url, timeout=120).read()
got = hashlib.sha256(data).hexdigest()
if got != want:
    sys.exit(f"{url}: sha256 {got}, expected {want}")
open(sys.argv[1] + ".part", "wb").write(data)
PY
    mv "$tarball.part" "$tarball"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xJf "$tarball" -C "$work"
cuda_args=()
[ -n "$cuda" ] && cuda_args=(--with-cuda="$cuda" --enable-cuda-dlopen)
cd "$work/libfabric-2.1.0"
if ! { ./autogen.sh && ./configure --prefix="$prefix/usr" --libdir="$prefix/usr/lib/x86_64-linux-gnu" --disable-static \
    --enable-only --enable-tcp --enable-udp --enable-shm --enable-rxm --enable-rxd "${cuda_args[@]}" &&
    make -j"$(nproc)" && make install; } >"$work/build.log" 2>&1; then
    tail -n 30 "$work/build.log"
    echo "build-libfabric: building libfabric 2.1.0 into $prefix failed"
    exit 1
fi
if [ -n "$cuda" ] && ! grep -q '^#define HAVE_CUDA 1' config.h; then
    echo "build-libfabric: configured without CUDA although $cuda was given (config.log in $work)"
    trap - EXIT
    exit 1
fi
LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu" "$prefix/usr/bin/fi_info" -l >/dev/null
