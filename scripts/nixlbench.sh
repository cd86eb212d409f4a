#!/usr/bin/env bash
# scripts/nixlbench.sh NIXL_SRC [build|run] [nixlbench flags...]
#
# NIXL's own benchmark, nixlbench (benchmark/nixlbench in a checkout of ai-dynamo/nixl: NIXL_SRC; it is not
# part of this repository and CI cannot fetch it), built UNCHANGED twice with meson:
#   target/nixlbench/gixl   against gixl: -Dnixl_path=target/capi/nixl, the NIXL install prefix that
#                           scripts/build-capi.sh lays out (gixl's headers, libnixl.so = gixl)
#   target/nixlbench/nixl   against NVIDIA's NIXL 1.5.1 (.venv/nixl's libnixl.so), through gixl's headers
#                           in their declare-only mode (-DGIXL_NIXL_ORACLE, NIXL 1.5.1's layouts), as the C++
#                           tests run against NIXL; the wheel carries libraries, not headers
# and then (run, the default) runs each on this host: two processes over nixlbench's ASIO runtime (no etcd),
# backend UCX, DRAM to DRAM, READ and WRITE, with --check_consistency, block sizes 4 KiB to 64 MiB, the
# implementations alternating per operation (medians over many sweeps: scripts/nixlbench_rounds.py, after a build).
# Extra arguments go to nixlbench. Needs: meson, ninja, Debian's
# libgflags-dev, libasio-dev, libtomlplusplus-dev (installed here if missing), and scripts/setup.sh's venvs.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
[ $# -ge 1 ] || { echo "usage: $0 NIXL_SRC [build|run] [nixlbench flags...]" >&2; exit 2; }
src="$(cd "$1" && pwd)"
shift
what="${1:-run}"
[ $# -eq 0 ] || shift
bench="$src/benchmark/nixlbench"
[ -e "$bench/meson.build" ] || { echo "error: $bench/meson.build not found" >&2; exit 2; }
out="$root/target/nixlbench"
mkdir -p "$out"

missing=()
command -v meson >/dev/null || missing+=(meson)
command -v ninja >/dev/null || missing+=(ninja-build)
for h in gflags/gflags.h asio.hpp toml++/toml.hpp; do
    [ -e "/usr/include/$h" ] || case $h in
        gflags*) missing+=(libgflags-dev) ;;
        asio*) missing+=(libasio-dev) ;;
        toml*) missing+=(libtomlplusplus-dev) ;;
    esac
done
if ((${#missing[@]})); then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

nixl_libs="$root/$(ls -d .venv/nixl/lib/python3*/site-packages/.nixl_cu12.mesonpy.libs | head -n 1)"
# Debian's asio is header-only and ships no pkg-config file; meson would try to download one.
mkdir -p "$out/pkgconfig"
cat >"$out/pkgconfig/asio.pc" <<'PC'
Name: asio
Description: Debian's libasio-dev (header-only)
Version: 1.22.1
Cflags: -I/usr/include
PC
# Debian 12's toml++ (3.3) names its header toml++/toml.h; nixlbench includes the single header toml++/toml.hpp.
mkdir -p "$out/shim/toml++"
[ -e /usr/include/toml++/toml.hpp ] || echo '#include <toml++/toml.h>' >"$out/shim/toml++/toml.hpp"
sed "s|^Cflags: |Cflags: -I$out/shim |" "$(pkg-config --variable=pcfiledir tomlplusplus)/tomlplusplus.pc" \
    >"$out/pkgconfig/tomlplusplus.pc"
export PKG_CONFIG_PATH="$out/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"

build() {
    scripts/build-capi.sh --release >/dev/null
    # NVIDIA's NIXL as an install prefix: gixl's headers (declare-only) over the wheel's libraries.
    local p="$out/nixl-prefix"
    rm -rf "$p"
    mkdir -p "$p/lib"
    cp -r target/capi/nixl/include "$p/include"
    for l in libnixl.so libnixl_build.so libserdes.so; do ln -sf "$nixl_libs/$l" "$p/lib/$l"; done
    local multiarch
    multiarch=$(cc -print-multiarch 2>/dev/null || true)
    [ -z "$multiarch" ] || ln -sfn . "$p/lib/$multiarch"
    local impl prefix flags ldflags
    for impl in gixl nixl; do
        if [ $impl = gixl ]; then
            prefix="$root/target/capi/nixl" flags="" ldflags="-Wl,-rpath,$prefix/lib"
        else
            # NIXL's libraries find theirs next to them and in the wheel's nixl_cu12.libs.
            prefix="$p" flags="-DGIXL_NIXL_ORACLE"
            ldflags="-Wl,-rpath,$nixl_libs -Wl,-rpath-link,$nixl_libs:$nixl_libs/../nixl_cu12.libs"
        fi
        rm -rf "$out/$impl"
        echo "nixlbench.sh: building nixlbench against $impl ($prefix)"
        CXXFLAGS="$flags" LDFLAGS="$ldflags" meson setup "$out/$impl" "$bench" \
            -Dnixl_path="$prefix" -Dbuildtype=release --wrap-mode=nodownload >"$out/$impl.setup.log" 2>&1 \
            || { tail -n 30 "$out/$impl.setup.log"; return 1; }
        ninja -C "$out/$impl" >"$out/$impl.build.log" 2>&1 || { grep -m 20 -A 5 "error" "$out/$impl.build.log"; return 1; }
    done
    echo "nixlbench.sh: built $out/gixl/nixlbench and $out/nixl/nixlbench"
}

# One nixlbench run of two processes (initiator and target) over the ASIO runtime on a free port.
run_one() {
    local impl="$1" op="$2"
    shift 2
    local port
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    local exe="$out/$impl/nixlbench"
    local args=(--runtime_type ASIO --asio_port "$port" --backend UCX --initiator_seg_type DRAM
        --target_seg_type DRAM --op_type "$op" --check_consistency --total_buffer_size 268435456
        --start_block_size 4096 --max_block_size 67108864 --start_batch_size 1 --max_batch_size 1 "$@")
    local log="$out/$impl.$op.log"
    local env=(UCX_TLS=tcp,self,sm)
    [ "$impl" = nixl ] && env+=(NIXL_PLUGIN_DIR="$nixl_libs/plugins")
    env "${env[@]}" "$exe" "${args[@]}" >"$log.rank0" 2>&1 &
    local a=$!
    sleep 1
    env "${env[@]}" "$exe" "${args[@]}" >"$log.rank1" 2>&1 &
    local b=$!
    local rc=0
    wait $a || rc=$?
    wait $b || rc=$?
    cat "$log.rank0" "$log.rank1" >"$log"
    [ $rc -eq 0 ] || { echo "nixlbench ($impl, $op) failed: $rc"; tail -n 20 "$log"; return 1; }
}

case "$what" in
    build) build ;;
    run)
        [ -x "$out/gixl/nixlbench" ] && [ -x "$out/nixl/nixlbench" ] || build
        for op in WRITE READ; do
            for impl in nixl gixl; do
                run_one "$impl" "$op" "$@"
            done
        done
        python3 "$root/scripts/nixlbench_table.py" "$out"
        ;;
    *) echo "usage: $0 NIXL_SRC [build|run] [nixlbench flags...]" >&2; exit 2 ;;
esac
