// cpp_dlist: what C++ programs pay to hand big descriptor lists to the agent (nixl.h), built unchanged
// against gixl (-I target/capi/include -lgixl) and against NVIDIA NIXL's libnixl.so (-DGIXL_NIXL_ORACLE
// -I include/nixl -lnixl -lnixl_build -lserdes). Two agents in one process over UCX: a target that
// registered one buffer and an initiator that loaded its metadata.
//
// Prints one line per figure: "<case> <median ms> <min ms> <reps>". Driven by benches/cpp_side_by_side.py.
//   cpp_dlist [--quick]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <nixl.h>

namespace {

using clk = std::chrono::steady_clock;

double
ms(clk::duration d) {
    return std::chrono::duration<double, std::milli>(d).count();
}

void
report(const std::string &what, std::vector<double> v) {
    std::sort(v.begin(), v.end());
    printf("%s %.3f %.3f %zu\n", what.c_str(), v[v.size() / 2], v[0], v.size());
    fflush(stdout);
}

[[noreturn]] void
die(const std::string &what, nixl_status_t s) {
    fprintf(stderr, "cpp_dlist: %s: %s\n", what.c_str(), nixlEnumStrings::statusStr(s).c_str());
    exit(1);
}

void
ok(const std::string &what, nixl_status_t s) {
    if (s != NIXL_SUCCESS) die(what, s);
}

nixlBackendH *
ucx(nixlAgent &a) {
    nixl_mem_list_t m;
    nixl_b_params_t p;
    nixlBackendH *b = nullptr;
    ok("getPluginParams", a.getPluginParams("UCX", m, p));
    ok("createBackend", a.createBackend("UCX", p, b));
    return b;
}

// `n` (a power of two) blocks of `block` bytes from `base`, in order or shuffled: entry i is block
// (i * 2654435761) mod n, a permutation that the Python side of the benchmark builds the same way.
nixl_xfer_dlist_t
blocks(uintptr_t base, size_t n, size_t block, bool shuffled) {
    nixl_xfer_dlist_t l(DRAM_SEG);
    l.reserve(n);
    for (size_t i = 0; i < n; i++) {
        const size_t b = shuffled ? (i * 2654435761u) & (n - 1) : i;
        l.addDesc(nixlBasicDesc(base + b * block, block, 0));
    }
    return l;
}

} // namespace

int
main(int argc, char **argv) {
    const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
    const int reps = quick ? 3 : 7;
    const size_t block = 64;
    const size_t max_n = size_t(1) << 21;
    std::vector<unsigned char> tbuf(max_n * block, 1), ibuf(max_n * block, 2);

    nixlAgentConfig cfg(true);
    nixlAgent T("cpp-bench-T", cfg);
    nixlAgent I("cpp-bench-I", cfg);
    ucx(T);
    ucx(I);
    nixl_reg_dlist_t treg(DRAM_SEG), ireg(DRAM_SEG);
    treg.addDesc(nixlBlobDesc((uintptr_t)tbuf.data(), tbuf.size(), 0, ""));
    ireg.addDesc(nixlBlobDesc((uintptr_t)ibuf.data(), ibuf.size(), 0, ""));
    ok("registerMem T", T.registerMem(treg));
    ok("registerMem I", I.registerMem(ireg));
    nixl_blob_t md;
    std::string name;
    ok("getLocalMD", T.getLocalMD(md));
    ok("loadRemoteMD", I.loadRemoteMD(md, name));

    // prepXferDlist, local and remote, of 2^20 and 2^21 blocks (in order, and shuffled).
    for (size_t n : {size_t(1) << 20, max_n}) {
        for (bool shuffled : {false, true}) {
            const nixl_xfer_dlist_t il = blocks((uintptr_t)ibuf.data(), n, block, shuffled);
            const nixl_xfer_dlist_t tl = blocks((uintptr_t)tbuf.data(), n, block, shuffled);
            const std::string tag = std::to_string(n) + (shuffled ? " shuffled" : " blocks");
            std::vector<double> local, remote;
            for (int r = 0; r < reps; r++) {
                nixlDlistH *h = nullptr;
                auto t0 = clk::now();
                ok("prepXferDlist local", I.prepXferDlist(NIXL_INIT_AGENT, il, h));
                local.push_back(ms(clk::now() - t0));
                ok("releasedDlistH", I.releasedDlistH(h));
                t0 = clk::now();
                ok("prepXferDlist remote", I.prepXferDlist("cpp-bench-T", tl, h));
                remote.push_back(ms(clk::now() - t0));
                ok("releasedDlistH", I.releasedDlistH(h));
            }
            report("prep_local " + tag, local);
            report("prep_remote " + tag, remote);
        }
    }

    // createXferReq of 2^16 blocks each side (both lists prepped, and the request made, in one call).
    {
        const size_t n = size_t(1) << 16;
        const nixl_xfer_dlist_t il = blocks((uintptr_t)ibuf.data(), n, block, true);
        const nixl_xfer_dlist_t tl = blocks((uintptr_t)tbuf.data(), n, block, true);
        std::vector<double> v;
        for (int r = 0; r < reps; r++) {
            nixlXferReqH *req = nullptr;
            const auto t0 = clk::now();
            ok("createXferReq", I.createXferReq(NIXL_READ, il, tl, "cpp-bench-T", req));
            v.push_back(ms(clk::now() - t0));
            ok("releaseXferReq", I.releaseXferReq(req));
        }
        report("create_xfer_req 65536 shuffled", v);
    }
    ok("invalidateRemoteMD", I.invalidateRemoteMD("cpp-bench-T"));
    ok("deregisterMem T", T.deregisterMem(treg));

    // registerMem (and deregisterMem) of 2^16 separate 4 KiB regions.
    {
        const size_t n = size_t(1) << 16, len = 4096;
        std::vector<unsigned char> regs(n * len, 3);
        nixl_reg_dlist_t rl(DRAM_SEG);
        for (size_t i = 0; i < n; i++) rl.addDesc(nixlBlobDesc((uintptr_t)regs.data() + i * len, len, 0, ""));
        std::vector<double> reg, dereg;
        for (int r = 0; r < reps; r++) {
            auto t0 = clk::now();
            ok("registerMem 2^16", T.registerMem(rl));
            reg.push_back(ms(clk::now() - t0));
            t0 = clk::now();
            ok("deregisterMem 2^16", T.deregisterMem(rl));
            dereg.push_back(ms(clk::now() - t0));
        }
        report("register_mem 65536", reg);
        report("deregister_mem 65536", dereg);
    }
    ok("deregisterMem I", I.deregisterMem(ireg));
    return 0;
}
