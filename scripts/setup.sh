#!/usr/bin/env bash
# scripts/setup.sh — install everything the tests need (scripts/test-all.sh runs it; the demo, scripts/demo.sh,
# installs only its own part), on a fresh Debian machine or this one.
# Idempotent: a second run only checks. Needs: a Rust toolchain (cargo), python3 ≥ 3.10, and root for apt.
#
#   .venv/gixl   gixl installed from this checkout (`pip install .`), plus pytest, numpy, mypy
#   .venv/nixl   the real NVIDIA NIXL 1.5.1 (nixl-cu12, CPU/UCX is enough), the oracle the tests compare with
#   .venv/torch  torch 2.15.0 from PyPI, test-only: the torch.distributed.TCPStore master of the TCPStore tests
#                (python/tests/test_tcpstore.py, ffi-tests/cpp/t_tcpstore.cpp). PyPI has no CPU-only torch for
#                x86-64 and `import torch` needs the CUDA libraries it depends on, so this is the whole thing:
#                about 3 GB downloaded, 5.3 GB on disk, under 2 minutes here; once per machine.
#   garage       Garage 2.5.0, the S3 server of the OBJ backend's tests, built once per machine into
#                ~/.cache/gixl/garage-2.5.0-lmdb: only the LMDB metadata engine, against Debian's libsodium and
#                libzstd, at opt-level 1 (about 8 minutes on 2 cores, half of a default build; the benchmark
#                figures in benches/README.md came from a default build). $GIXL_GARAGE names another binary.
#   rdma-core    Debian's libibverbs (header and library, with libnl) unpacked into ~/.cache/gixl/rdma-core and
#                NOT installed: the `rdma` feature's tests check gixl's bindings against the header and open the
#                library by path. Installed system-wide, it would change the oracle: NIXL 1.5.1's bundled UCX loads
#                the system libibverbs, which brings a second libnl, and NIXL then segfaults at exit.
#   libfabric    Debian's libfabric 1.17 (library, headers, fi_info/fi_pingpong) and what it loads (rdma-core's
#                libibverbs, librdmacm and libefa, libnl, libpsm2, libpsm-infinipath) unpacked into
#                ~/.cache/gixl/libfabric and NOT installed, for the same reason: gixl opens it by path
#                (GIXL_LIBFABRIC) in the processes that use it, with LD_LIBRARY_PATH set to its folders there only
#                (docs/libfabric.md).
#   libfabric 2.1  libfabric 2.1.0 built from Debian's source by scripts/build-libfabric.sh (trixie's original tarball,
#                its SHA-256 checked)
#                into ~/.cache/gixl/libfabric-2.1.0 with the same layout: the tcp, udp, shm and utility (rxm, rxd)
#                providers only, about a minute on 2 cores (autoconf, automake and libtool from apt). The
#                libfabric tests run again over it: a library as new as those EFA's installer ships, and the first
#                here that takes dma-buf registrations (FI_MR_DMABUF, API 1.20). Debian's own 2.1 package needs
#                glibc 2.38, newer than bookworm's.
#
# Each phase prints how long it took, so a slow CI machine shows where its time went.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
t0=$SECONDS
took() { echo "setup: $1 ($((SECONDS - t0)) s since setup began)"; }

apt_missing=()
command -v cc >/dev/null || apt_missing+=(build-essential)
command -v g++ >/dev/null || apt_missing+=(g++)
# bindgen (used by the nixl-sys consumer test) loads libclang at build time.
ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/x86_64-linux-gnu/libclang*.so* >/dev/null 2>&1 || apt_missing+=(libclang-dev)
command -v etcd >/dev/null || apt_missing+=(etcd-server)
command -v ip >/dev/null || apt_missing+=(iproute2)
command -v valgrind >/dev/null || apt_missing+=(valgrind)
# tests/telemetry.rs scrapes gixl with a real Prometheus server.
command -v prometheus >/dev/null || apt_missing+=(prometheus)
# Garage's build links Debian's libsodium and libzstd (found with pkg-config) instead of compiling its own.
for lib in libsodium libzstd; do
    pkg-config --exists "$lib" 2>/dev/null || apt_missing+=("$lib-dev")
done
command -v pkg-config >/dev/null || apt_missing+=(pkg-config)
# libfabric 2.1 is built from its source tarball (autogen.sh).
command -v autoreconf >/dev/null || apt_missing+=(autoconf)
command -v automake >/dev/null || apt_missing+=(automake)
command -v libtoolize >/dev/null || apt_missing+=(libtool)
if ((${#apt_missing[@]})); then
    echo "setup: apt-get install ${apt_missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${apt_missing[@]}" >/dev/null
    took "apt packages installed"
fi

py=${PYTHON:-python3}
# scripts/demo.sh may have made either venv with less in it (what the demo needs): complete it.
if [ ! -x .venv/nixl/bin/python ] || ! .venv/nixl/bin/python -c "import pytest, numpy, nixl_cu12._api" 2>/dev/null; then
    echo "setup: .venv/nixl (nixl-cu12==1.5.1, the reference implementation)"
    [ -x .venv/nixl/bin/python ] || "$py" -m venv .venv/nixl
    .venv/nixl/bin/pip install -q pytest numpy
    .venv/nixl/bin/pip install -q --no-deps nixl-cu12==1.5.1
    took ".venv/nixl ready"
fi
# boto3: the independent S3 client that checks what the OBJ tests leave on the server.
for v in .venv/nixl .venv/gixl; do
    if [ -x $v/bin/python ] && ! $v/bin/python -c "import boto3" 2>/dev/null; then
        $v/bin/pip install -q boto3
    fi
done
if [ ! -x .venv/gixl/bin/python ] || ! .venv/gixl/bin/python -c "import pytest, numpy, mypy, maturin, boto3" 2>/dev/null; then
    echo "setup: .venv/gixl"
    [ -x .venv/gixl/bin/python ] || "$py" -m venv .venv/gixl
    .venv/gixl/bin/pip install -q pytest numpy mypy maturin boto3
    took ".venv/gixl ready"
fi
if [ ! -e .venv/torch/.ready ]; then
    echo "setup: .venv/torch (torch 2.15.0, test-only: the TCPStore master)"
    rm -rf .venv/torch
    "$py" -m venv .venv/torch
    .venv/torch/bin/pip install -q torch==2.15.0 numpy
    .venv/torch/bin/python -c "import torch.distributed as d; assert d.is_available()"
    touch .venv/torch/.ready
    took ".venv/torch ready"
fi
garage_root="$HOME/.cache/gixl/garage-2.5.0-lmdb"
if [ -z "${GIXL_GARAGE:-}" ] && [ ! -x "$garage_root/bin/garage" ]; then
    echo "setup: cargo install garage 2.5.0 into $garage_root (once per machine; about 8 minutes on 2 cores)"
    CARGO_TARGET_DIR="$HOME/.cache/gixl/garage-build" CARGO_PROFILE_RELEASE_OPT_LEVEL=1 \
        CARGO_PROFILE_RELEASE_DEBUG=0 cargo install -q garage --version 2.5.0 --locked \
        --no-default-features --features lmdb,system-libs --root "$garage_root"
    rm -rf "$HOME/.cache/gixl/garage-build"
    took "garage built"
fi
rdma_core="$HOME/.cache/gixl/rdma-core"
if [ ! -e "$rdma_core/usr/include/infiniband/verbs.h" ]; then
    echo "setup: rdma-core unpacked into $rdma_core (not installed)"
    debs=$(mktemp -d)
    pkgs=(libibverbs-dev libibverbs1 libnl-3-200 libnl-route-3-200)
    (cd "$debs" && { apt-get download "${pkgs[@]}" >/dev/null 2>&1 ||
        { apt-get update -qq && apt-get download "${pkgs[@]}" >/dev/null; }; })
    for d in "$debs"/*.deb; do dpkg -x "$d" "$rdma_core"; done
    rm -rf "$debs"
    took "rdma-core unpacked"
fi
libfabric="$HOME/.cache/gixl/libfabric"
if [ ! -e "$libfabric/usr/include/rdma/fabric.h" ] || [ ! -e "$libfabric/usr/bin/fi_info" ]; then
    echo "setup: libfabric unpacked into $libfabric (not installed)"
    debs=$(mktemp -d)
    pkgs=(libfabric1 libfabric-dev libfabric-bin libibverbs1 ibverbs-providers librdmacm1 libnl-3-200
        libnl-route-3-200 libpsm2-2 libpsm-infinipath1)
    (cd "$debs" && { apt-get download "${pkgs[@]}" >/dev/null 2>&1 ||
        { apt-get update -qq && apt-get download "${pkgs[@]}" >/dev/null; }; })
    for d in "$debs"/*.deb; do dpkg -x "$d" "$libfabric"; done
    rm -rf "$debs"
    # Debian points libpsm_infinipath.so.1 at /usr/lib/libpsm1 with update-alternatives; unpacked, a link does.
    ln -sf ../libpsm1/libpsm_infinipath.so.1.16 "$libfabric/usr/lib/x86_64-linux-gnu/libpsm_infinipath.so.1"
    lf_path="$libfabric/usr/lib/x86_64-linux-gnu:$libfabric/lib/x86_64-linux-gnu"
    LD_LIBRARY_PATH="$lf_path" "$libfabric/usr/bin/fi_info" -l >/dev/null
    took "libfabric unpacked"
fi
libfabric2="$HOME/.cache/gixl/libfabric-2.1.0"
if [ ! -e "$libfabric2/usr/include/rdma/fi_domain.h" ] || [ ! -e "$libfabric2/usr/bin/fi_info" ]; then
    echo "setup: libfabric 2.1.0 built from Debian's source into $libfabric2 (not installed)"
    scripts/build-libfabric.sh "$libfabric2"
    took "libfabric 2.1.0 built"
fi
# Always reinstall gixl itself so the venv matches the checkout.
echo "setup: pip install . (builds the gixl wheel)"
.venv/gixl/bin/pip install -q --force-reinstall --no-deps .
.venv/gixl/bin/python -c "import nixl._api, nixl._bindings, gixl._gixl"
took "done"
