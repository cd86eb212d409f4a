#!/usr/bin/env bash
# scripts/gpu-check.sh — VRAM on a machine with a GPU, in one call of a few minutes.
#
#   scripts/gpu-check.sh --prepare [--with-nixl]   on the build machine (needs cargo and the crates):
#       builds examples/gpu_check with --features cuda,rdma into target/gpu-check/ (stripped), copies the
#       libfabric scripts/setup.sh unpacked (~/.cache/gixl/libfabric: Debian's 1.17 with rdma-core's
#       libibverbs and providers, fi_info, fi_pingpong; shared libraries only) into target/gpu-check/libfabric
#       where there is one, and with --with-nixl packs NIXL 1.5.1 (nixl_cu12 + numpy from .venv/nixl) into target/gpu-check/nixl.tar.zst;
#       builds libfabric 2.1.0 with CUDA into ~/.cache/gixl/libfabric-2.1.0-cuda (once) and copies it with the
#       CUDA runtime it opens into target/gpu-check/libfabric-cuda (step 3b below);
#       prints the sizes (the device tool carries at most 64 MiB).
#   scripts/gpu-check.sh                           on the GPU machine (carry target/gpu-check):
#       1. nvidia-smi, driver version;
#       2. gixl: target/gpu-check/gpu_check (built here with cargo if missing and cargo works offline):
#          cross-process VRAM->VRAM READ and WRITE (1 x 64 MiB, 1024 x 16 KiB), remote VRAM <-> local DRAM,
#          local VRAM <-> remote DRAM (staged), a VMM (POSIX-fd) allocation, the peer killed with the IPC
#          handle open and restarted (old handle refused, new memory unchanged), the same transfers over the
#          TCP route (loopback, transport=tcp: both sides staged through pinned buffers), and, where the host
#          has an active RDMA port, over the RDMA route (transport=rdma: GPU-direct where the NIC reaches the
#          memory, which the log says per region), bandwidth beside the device's own D2D copy rate; before it,
#          the RDMA devices the host has (sysfs, ibv_devices) and, where perftest is installed, ib_write_bw and
#          ib_read_bw between two processes on the first device as the NIC's own figure; where there is none it
#          says so; then the GDS and GDS_MT backends: VRAM -> FILE -> VRAM (1 x 64 MiB, 1024 x 16 KiB scattered),
#          page cache and O_DIRECT, in $GIXL_GDS_DIR (default /tmp), data checked, each beside the POSIX
#          backend's DRAM rate on the same file, after a line saying which path they take here (staged through
#          pinned buffers, or cuFile, where libcufile is installed and gixl's self-test of it passed) and why
#          (docs/gds.md); where the direct path was taken, the GDS cases run again with GIXL_CUFILE=off for the
#          staged figures beside them; a machine without cuFile runs them staged and does not fail for it; the
#          same binary runs over the fake device with GIXL_FAKE_DEVICE=1;
#       3. libfabric: the library this host has (/opt/amazon/efa/lib, the system's), else the carried one, and
#          its providers (fi_info -l); then gpu_check again with GIXL_GPU_CHECK=fabric: the devices libfabric
#          offers, each NIC provider's (efa, verbs…: not tcp, udp, sockets, net or shm) self-test, then DRAM
#          READ/WRITE and a VRAM READ of 64 MiB over the libfabric route on the first that passed (through
#          FI_HMEM where the provider offers it and the GPU-memory self-test passed, else staged: it says which),
#          data checked,
#          the route's own self-test (examples/gpu_check.rs, fabric_cases); where there is none, one line
#          saying so;
#       3b. libfabric 2.1.0 built with CUDA (carried: --prepare builds it with scripts/build-libfabric.sh against
#          the headers of NVIDIA's nvidia-cuda-runtime-cu12 wheel and carries its libcudart.so.12): gpu_check
#          with GIXL_GPU_CHECK=fabric forced onto shm between two processes of the host, so that real GPU memory
#          goes through libfabric (FI_HMEM_CUDA: as a dma-buf, else by interface; the self-test records say
#          which way passed), data checked; where no GPU is, one line saying so;
#       4. NIXL 1.5.1 on the same cases (scripts/gpu_check_nixl.py --impl nixl_cu12) if it can be imported
#          (installed, or unpacked from target/gpu-check/nixl.tar.zst; needs python3.11); otherwise says so.
# Exit status: non-zero if any gixl case failed.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="$root/target/gpu-check"

if [ "${1:-}" = "--prepare" ]; then
    set -e
    mkdir -p "$out"
    cargo build --release --features cuda,rdma --example gpu_check
    cp target/release/examples/gpu_check "$out/gpu_check"
    strip "$out/gpu_check" 2>/dev/null || true
    fl="$HOME/.cache/gixl/libfabric"
    if [ -f "$fl/usr/lib/x86_64-linux-gnu/libfabric.so.1" ]; then
        rm -rf "$out/libfabric"
        mkdir -p "$out/libfabric/usr/lib/x86_64-linux-gnu" "$out/libfabric/lib" "$out/libfabric/usr/bin"
        (cd "$fl/usr/lib/x86_64-linux-gnu" && cp -rL ./*.so.1 ./*.so.2 ./*.so.4 ./*.so.200 libibverbs "$out/libfabric/usr/lib/x86_64-linux-gnu/")
        cp -rL "$fl/lib/." "$out/libfabric/lib/"
        cp -L "$fl/usr/bin/fi_info" "$fl/usr/bin/fi_pingpong" "$out/libfabric/usr/bin/" 2>/dev/null || true
    else
        echo "no libfabric under $fl (scripts/setup.sh unpacks it): the device machine's own is used, if any"
    fi
    # libfabric 2.1.0 with CUDA memory support (CUDA opened at run time), and the CUDA runtime it opens: shm
    # between two processes over real GPU memory (FI_HMEM_CUDA, by interface and as dma-buf) on the device. The
    # headers it is built against and libcudart.so.12 come from NVIDIA's wheels (nvidia-cuda-runtime-cu12; the
    # crt/ headers cuda_runtime.h includes, from nvidia-cuda-nvcc-cu12, a 40 MB download; nvml.h from
    # nvidia-nvml-dev-cu12), downloaded once into ~/.cache/gixl.
    cu="$HOME/.cache/gixl/cuda-12.9"
    if [ ! -f "$cu/include/crt/host_config.h" ] || [ ! -f "$cu/include/nvml.h" ] || [ ! -f "$cu/lib/libcudart.so.12" ]; then
        wheels=$(mktemp -d)
        python3 -m pip download -q --no-deps -d "$wheels" nvidia-cuda-runtime-cu12==12.9.79 \
            nvidia-cuda-nvcc-cu12==12.9.86 nvidia-nvml-dev-cu12==12.9.79
        python3 - "$wheels" "$cu" <<'PY'
import glob, os, sys, zipfile
wheels, cu = sys.argv[1:]
want = {"nvidia/cuda_runtime/include/": "include/", "nvidia/cuda_runtime/lib/libcudart.so.12": "lib/libcudart.so.12",
        "nvidia/cuda_nvcc/include/crt/": "include/crt/", "nvidia/nvml_dev/include/nvml.h": "include/nvml.h"}
for whl in glob.glob(wheels + "/*.whl"):
    z = zipfile.ZipFile(whl)
    for name in z.namelist():
        for src, dst in want.items():
            if name.startswith(src) and not name.endswith("/"):
                out = os.path.join(cu, dst + name[len(src):]) if src.endswith("/") else os.path.join(cu, dst)
                os.makedirs(os.path.dirname(out), exist_ok=True)
                open(out, "wb").write(z.read(name))
PY
        rm -rf "$wheels"
    fi
    flc="$HOME/.cache/gixl/libfabric-2.1.0-cuda"
    [ -f "$flc/usr/lib/x86_64-linux-gnu/libfabric.so.1" ] || scripts/build-libfabric.sh "$flc" "$cu"
    rm -rf "$out/libfabric-cuda"
    mkdir -p "$out/libfabric-cuda/lib" "$out/libfabric-cuda/bin"
    cp -L "$flc/usr/lib/x86_64-linux-gnu/libfabric.so.1" "$cu/lib/libcudart.so.12" \
        "$out/libfabric-cuda/lib/"
    ln -sf libcudart.so.12 "$out/libfabric-cuda/lib/libcudart.so"
    cp -L "$flc/usr/bin/fi_info" "$out/libfabric-cuda/bin/"
    if [ "${2:-}" = "--with-nixl" ]; then
        site=$(ls -d .venv/nixl/lib/python3*/site-packages | head -n 1)
        tar -C "$site" -cf - nixl_cu12 nixl_cu12.libs numpy numpy.libs | zstd -q -12 -T0 -o "$out/nixl.tar.zst" -f
    fi
    du -ah "$out"
    du -sh "$out"
    exit 0
fi

echo "=== gpu-check on $(hostname) at $(date -u +%FT%TZ)"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
else
    echo "nvidia-smi not found"
fi

# RDMA: what the host has, and the NIC's own figure beside gixl's (perftest), where it has one.
rdma_devs=$(ls /sys/class/infiniband 2>/dev/null | tr '\n' ' ')
if [ -z "$rdma_devs" ]; then
    echo "=== RDMA: no RDMA device on this host (/sys/class/infiniband is empty or absent): RDMA cases will not run"
else
    echo "=== RDMA devices: $rdma_devs"
    command -v ibv_devices >/dev/null && ibv_devices
    dev=${rdma_devs%% *}
    for t in ib_write_bw ib_read_bw; do
        if command -v $t >/dev/null; then
            echo "=== $t on $dev, 64 MiB messages, two processes on this host"
            timeout 60 $t -d "$dev" -s 67108864 -n 50 -F >/tmp/gpu-check-$t.log 2>&1 &
            sleep 1
            timeout 60 $t -d "$dev" -s 67108864 -n 50 -F 127.0.0.1 | tail -n 3
            wait
        else
            echo "=== $t: not installed (perftest): no NIC reference figure"
        fi
    done
fi

bin="$out/gpu_check"
if [ ! -x "$bin" ]; then
    echo "=== building gpu_check (cargo build --release --features cuda --example gpu_check)"
    cargo build --release --offline --features cuda,rdma --example gpu_check && bin=target/release/examples/gpu_check
fi
status=0
if [ -x "$bin" ]; then
    # GPUDirect Storage: is cuFile here at all (gixl opens it at run time and self-tests it before use)?
    cufile=$(ldconfig -p 2>/dev/null | grep -o '/[^ ]*libcufile\.so\.0$' | head -n 1)
    if [ -n "${GIXL_CUFILE_LIB:-}" ]; then cufile="$GIXL_CUFILE_LIB (GIXL_CUFILE_LIB)"; fi
    echo "=== GPUDirect Storage: libcufile: ${cufile:-not installed (the GDS cases run staged)}"
    [ -e /proc/driver/nvidia-fs/stats ] && echo "=== nvidia-fs kernel module loaded" \
        || echo "=== nvidia-fs kernel module not loaded (cuFile, if present, runs in compatibility mode)"
    echo "=== gixl (engine 'UCX' over the CUDA driver)"
    timeout 300 "$bin" | tee /tmp/gpu-check-gixl.log
    status=${PIPESTATUS[0]}
    echo "=== gixl: exit $status"
    if grep -q "GDS: cuFile self-test PASSED" /tmp/gpu-check-gixl.log; then
        echo "=== GDS: the cuFile self-test passed: the cases above ran direct; now the same cases staged (GIXL_CUFILE=off)"
        GIXL_CUFILE=off GIXL_GPU_CHECK_ONLY=gds timeout 200 "$bin"
        s=$?
        echo "=== gixl GDS staged: exit $s"
        [ $s -ne 0 ] && status=$s
    else
        echo "=== GDS: $(grep -m1 '^GDS: ' /tmp/gpu-check-gixl.log || echo 'no GDS line in the output')"
    fi
else
    echo "=== gixl: no gpu_check binary and no offline build possible: NOT RUN"
    status=1
fi

# libfabric: the host's own (EFA installer, system), else the one carried by --prepare; the route over a NIC
# provider where it has one (gpu_check lists the devices libfabric offers and says which it takes, or none).
fi_lib=""
fi_env=()
sys_fi=$(ldconfig -p 2>/dev/null | awk '$1 == "libfabric.so.1" {print $NF; exit}')
for c in /opt/amazon/efa/lib/libfabric.so.1 /opt/amazon/efa/lib64/libfabric.so.1 "$sys_fi"; do
    if [ -n "$c" ] && [ -f "$c" ]; then
        fi_lib=$c
        break
    fi
done
fi_bin=""
if [ -n "$fi_lib" ]; then
    fi_bin="$(dirname "$fi_lib")/../bin/fi_info"
    [ -x "$fi_bin" ] || fi_bin=$(command -v fi_info || true)
elif [ -f "$out/libfabric/usr/lib/x86_64-linux-gnu/libfabric.so.1" ]; then
    fi_lib="$out/libfabric/usr/lib/x86_64-linux-gnu/libfabric.so.1"
    fi_env=("LD_LIBRARY_PATH=$out/libfabric/usr/lib/x86_64-linux-gnu:$out/libfabric/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}")
    fi_bin="$out/libfabric/usr/bin/fi_info"
fi
if [ -z "$fi_lib" ]; then
    echo "=== libfabric: not on this host and not carried (scripts/gpu-check.sh --prepare): libfabric cases will not run"
else
    echo "=== libfabric: $fi_lib"
    if [ -n "$fi_bin" ] && [ -x "$fi_bin" ]; then
        echo "    providers built in (fi_info -l): $(env "${fi_env[@]}" "$fi_bin" -l 2>/dev/null | grep -v version | tr -d ':' | tr '\n' ' ')"
    fi
    if [ -x "$bin" ]; then
        echo "=== gixl over libfabric (GIXL_GPU_CHECK=fabric: NIC providers only, efa, verbs…; none: it says so)"
        env "${fi_env[@]}" GIXL_LIBFABRIC="$fi_lib" GIXL_GPU_CHECK=fabric timeout 300 "$bin"
        fs=$?
        echo "=== gixl over libfabric: exit $fs"
        [ $fs -eq 0 ] || status=1
    fi
fi

# GPU memory through libfabric for real: the carried libfabric 2.1.0 built with CUDA, shm between two processes
# of this host (forced: GIXL_GPU_CHECK_FABRIC_PROVIDER=shm), the VRAM regions registered with FI_HMEM_CUDA, as a
# dma-buf first (API 1.20) and by interface where that way's self-test fails; the self-test records say which.
flc="$out/libfabric-cuda/lib"
if [ -f "$flc/libfabric.so.1" ] && [ -x "$bin" ] && command -v nvidia-smi >/dev/null; then
    echo "=== libfabric 2.1.0 with CUDA (carried), shm: GPU memory through FI_HMEM_CUDA"
    echo "    providers built in (fi_info -l): $(LD_LIBRARY_PATH="$flc" "$out/libfabric-cuda/bin/fi_info" -l 2>/dev/null | grep -v version | tr -d ':' | tr '\n' ' ')"
    echo "    shm with FI_HMEM (fi_info -p shm -c FI_HMEM): $(LD_LIBRARY_PATH="$flc" "$out/libfabric-cuda/bin/fi_info" -p shm -c FI_HMEM 2>&1 | grep -m1 -E 'domain|No data' | tr -s ' ')"
    LD_LIBRARY_PATH="$flc:${LD_LIBRARY_PATH:-}" GIXL_LIBFABRIC="$flc/libfabric.so.1" GIXL_GPU_CHECK=fabric \
        GIXL_GPU_CHECK_FABRIC_PROVIDER=shm timeout 300 "$bin"
    fs=$?
    echo "=== libfabric with CUDA over shm: exit $fs"
    [ $fs -eq 0 ] || status=1
else
    echo "=== libfabric with CUDA over shm: not run (no carried target/gpu-check/libfabric-cuda, no gpu_check, or no GPU)"
fi

py=""
if [ -f "$out/nixl.tar.zst" ]; then
    mkdir -p /tmp/gpu-check-site
    zstd -dc "$out/nixl.tar.zst" | tar -C /tmp/gpu-check-site -xf -
    for p in python3.11 python3; do
        if command -v $p >/dev/null && PYTHONPATH=/tmp/gpu-check-site $p -c "import nixl_cu12._api" 2>/dev/null; then
            py="env PYTHONPATH=/tmp/gpu-check-site $p"
            break
        fi
    done
fi
if [ -z "$py" ] && [ -x .venv/nixl/bin/python ] && .venv/nixl/bin/python -c "import nixl_cu12._api" 2>/dev/null; then
    py=.venv/nixl/bin/python
fi
if [ -z "$py" ] && command -v python3 >/dev/null && python3 -c "import nixl_cu12._api" 2>/dev/null; then
    py=python3
fi
if [ -n "$py" ]; then
    echo "=== NIXL 1.5.1 (nixl-cu12, UCX) on the same cases"
    timeout 240 $py scripts/gpu_check_nixl.py --impl nixl_cu12
    echo "=== NIXL: exit $?"
else
    echo "=== NIXL 1.5.1: cannot import nixl_cu12 here (not installed, no network, no carried archive): NOT RUN"
fi
exit $status
