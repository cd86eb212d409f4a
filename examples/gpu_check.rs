//! The GPU check behind `scripts/gpu-check.sh`: VRAM through gixl between two processes on one host, with
//! bandwidth beside the device's own device-to-device copy rate, data checked after every case, and a peer
//! restart with the old IPC handle.
//!
//! `cargo run --release --features cuda --example gpu_check` on a machine with a GPU. With
//! `GIXL_FAKE_DEVICE=1` it runs the same cases over the fake device layer (a dry run of the protocol and of
//! this program; the figures then mean nothing).
//!
//! Cases (decode = this process, prefill = a child, both on device `GIXL_GPU` (default 0)):
//! VRAM→VRAM READ and WRITE, 1 × 64 MiB and 1024 × 16 KiB (remote blocks in random order); remote VRAM ↔
//! local DRAM both ways (through the opened IPC handle); local VRAM ↔ remote DRAM both ways (staged through
//! pinned memory and cross-memory attach); a VMM allocation of 4 physical chunks mapped back to back (one
//! region, one POSIX-fd handle per chunk) READ; the prefill killed with
//! the handle open and restarted: old requests refused (REMOTE_DISCONNECT, then NOT_FOUND after reload), the
//! new incarnation's memory unchanged, a new request works.
//!
//! Then the same transfers over the TCP route (the route to another host): a second prefill, both engines
//! with transport=tcp on loopback, both sides staged through pinned buffers: VRAM→VRAM READ and WRITE
//! (64 MiB, 1024 × 16 KiB), remote VRAM → local DRAM, local VRAM ↔ remote DRAM.
//!
//! Then, where the build has the `rdma` feature and the host an active RDMA port (or the fake fabric is
//! configured, `GIXL_FAKE_VERBS`), the RDMA route: a third prefill, both engines with transport=rdma, VRAM→VRAM
//! READ and WRITE (64 MiB, 1024 × 16 KiB: GPU-direct where the NIC reaches the memory, else staged; each
//! engine's log says which per region) and DRAM→DRAM READ 64 MiB. Without a port it says so and runs none.
//!
//! With `GIXL_GPU_CHECK=fabric` it runs only the libfabric cases (`fabric_cases`; scripts/gpu-check.sh runs them
//! apart, with the libfabric it found in `GIXL_LIBFABRIC`): the devices libfabric offers, each NIC provider's
//! (efa, verbs…: not sockets or shared memory) self-test, and over the first that passed, a prefill and this
//! process both with transport=fabric on it: DRAM→DRAM READ and WRITE 64 MiB and a VRAM→VRAM READ 64 MiB
//! (through `FI_HMEM` where the provider offers it and its GPU-memory self-test passed, else staged over the TCP
//! link: it prints which), data checked, and the route's own self-test. Where there
//! is no such provider it says so and runs none (`GIXL_GPU_CHECK_FABRIC_PROVIDER` names one anyway, e.g.
//! `tcp;ofi_rxm` for a dry run).
//!
//! Last, the GDS and GDS_MT backends (`gds_cases`): VRAM → FILE → VRAM, 1 × 64 MiB and 1024 × 16 KiB, page
//! cache and O_DIRECT, in `GIXL_GDS_DIR` (default /tmp), beside the POSIX backend's DRAM ↔ FILE on the same file,
//! after a line saying whether they take cuFile (its self-test passed in this process) or stage, and why; each
//! figure names the path ("direct" or "staged"). `GIXL_GPU_CHECK_ONLY=gds` runs these cases alone.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use gixl::device::{self, fake, Copy};
use gixl::*;

const MIB: usize = 1 << 20;
const BULK: usize = 64 * MIB;
const BLOCKS: usize = 1024;
const BLOCK: usize = 16 << 10;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap_or(0)).collect()
}

fn gpu() -> u32 {
    std::env::var("GIXL_GPU").ok().and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// Device memory for the check itself: allocation, fill, checksum. Over the fake device or the real driver.
mod mem {
    use super::*;

    pub fn fake() -> bool {
        device::is_fake()
    }

    #[cfg(feature = "cuda")]
    mod real {
        use cudarc::driver::sys;
        use std::ffi::c_void;

        pub fn ok(r: sys::CUresult, what: &str) {
            assert!(r == sys::CUresult::CUDA_SUCCESS, "{what}: {r:?}");
        }

        /// Make the device's primary context current on this thread.
        pub fn current(dev: u32) {
            let mut d = 0;
            let mut c: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: valid out-pointers; the driver was initialised by gixl's device layer.
            unsafe {
                ok(sys::cuDeviceGet(&mut d, dev as i32), "cuDeviceGet");
                ok(sys::cuDevicePrimaryCtxRetain(&mut c, d), "cuDevicePrimaryCtxRetain");
                ok(sys::cuCtxSetCurrent(c), "cuCtxSetCurrent");
            }
        }

        pub fn alloc(dev: u32, size: usize, vmm: bool) -> Option<u64> {
            current(dev);
            let mut p = 0u64;
            if !vmm {
                // SAFETY: valid out-pointer.
                ok(unsafe { sys::cuMemAlloc_v2(&mut p, size) }, "cuMemAlloc");
                return Some(p);
            }
            // SAFETY: zeroed is valid for this plain struct; fields set below.
            let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
            prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            prop.location.id = dev as i32;
            let mut g = 0usize;
            let gflag = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
            // SAFETY: valid pointers.
            if unsafe { sys::cuMemGetAllocationGranularity(&mut g, &prop, gflag) } != sys::CUresult::CUDA_SUCCESS {
                return None;
            }
            // VMM_CHUNKS physical allocations mapped back to back in one reserved range, as PyTorch's
            // expandable segments grow: one registered region spans them all.
            let chunk = (size / super::VMM_CHUNKS).div_ceil(g) * g;
            let size = chunk * super::VMM_CHUNKS;
            // SAFETY: valid pointers; each step checked.
            unsafe {
                ok(sys::cuMemAddressReserve(&mut p, size, 0, 0, 0), "cuMemAddressReserve");
                for i in 0..super::VMM_CHUNKS {
                    let mut h = 0;
                    if sys::cuMemCreate(&mut h, chunk, &prop, 0) != sys::CUresult::CUDA_SUCCESS {
                        return None;
                    }
                    ok(sys::cuMemMap(p + (i * chunk) as u64, chunk, 0, h, 0), "cuMemMap");
                }
                let mut a: sys::CUmemAccessDesc = std::mem::zeroed();
                a.location = prop.location;
                a.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                ok(sys::cuMemSetAccess(p, size, &a, 1), "cuMemSetAccess");
            }
            Some(p)
        }

        pub fn fill(p: u64, size: usize, b: u8) {
            // SAFETY: a device range of ours.
            ok(unsafe { sys::cuMemsetD8_v2(p, b, size) }, "cuMemsetD8");
        }

        pub fn read(p: u64, out: &mut [u8]) {
            // SAFETY: a device range of ours, a host buffer of the same length.
            ok(unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut c_void, p, out.len()) }, "cuMemcpyDtoH");
        }

        pub fn write(p: u64, data: &[u8]) {
            // SAFETY: as above.
            ok(unsafe { sys::cuMemcpyHtoD_v2(p, data.as_ptr() as *const c_void, data.len()) }, "cuMemcpyHtoD");
        }
    }

    /// Physical chunks behind a VMM allocation (one region spans them all).
    pub const VMM_CHUNKS: usize = 4;

    pub fn alloc(dev: u32, size: usize, vmm: bool, at: Option<u64>) -> Option<u64> {
        if fake() && vmm {
            return fake::alloc_chunks(dev, &[size / VMM_CHUNKS; VMM_CHUNKS], vmm, at).ok();
        }
        if fake() {
            return fake::alloc(dev, size, vmm, at).ok();
        }
        #[cfg(feature = "cuda")]
        return real::alloc(dev, size, vmm);
        #[cfg(not(feature = "cuda"))]
        None
    }

    pub fn current(_dev: u32) {
        #[cfg(feature = "cuda")]
        if !fake() {
            real::current(_dev);
        }
    }

    fn slice(p: u64, len: usize) -> &'static mut [u8] {
        // SAFETY: fake device memory is host memory of this process, `len` bytes allocated by `alloc`.
        unsafe { std::slice::from_raw_parts_mut(p as usize as *mut u8, len) }
    }

    pub fn fill(p: u64, size: usize, b: u8) {
        if fake() {
            slice(p, size).fill(b);
            return;
        }
        #[cfg(feature = "cuda")]
        real::fill(p, size, b);
    }

    pub fn read(p: u64, out: &mut [u8]) {
        if fake() {
            out.copy_from_slice(slice(p, out.len()));
            return;
        }
        #[cfg(feature = "cuda")]
        real::read(p, out);
    }

    pub fn write(p: u64, data: &[u8]) {
        if fake() {
            slice(p, data.len()).copy_from_slice(data);
            return;
        }
        #[cfg(feature = "cuda")]
        real::write(p, data);
    }

    pub fn sum(p: u64, size: usize) -> u64 {
        let mut v = vec![0u8; size];
        read(p, &mut v);
        v.iter().map(|&b| b as u64).sum()
    }
}

fn agent(name: &str) -> Agent {
    agent_with(name, Params::new())
}

/// An agent whose engine reaches every peer over TCP on loopback (the route to another host).
fn tcp_agent(name: &str) -> Agent {
    agent_with(
        name,
        [("transport", "tcp"), ("tcp_addr", "127.0.0.1")].map(|(k, v)| (k.to_owned(), v.to_owned())).into(),
    )
}

fn agent_with(name: &str, p: Params) -> Agent {
    let a = Agent::new(name, AgentConfig::default()).expect("agent");
    a.create_backend("UCX", &p).expect("UCX backend");
    a
}

fn reg(a: &Agent, mem: MemType, addr: u64, len: usize, dev: u64) -> Result<RegDList> {
    let l = RegDList::with_descs(mem, vec![RegDesc { desc: Desc::new(addr, len as u64, dev), meta: vec![] }]);
    a.register_mem(&l, &[]).map(|_| l)
}

/// The prefill child: legacy VRAM, VMM VRAM (if the device supports it) and DRAM, `BULK` bytes each.
fn child() {
    let dev = gpu();
    device::get().expect("device layer");
    mem::current(dev);
    let fill: u8 = std::env::var("GIXL_FILL").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let at = std::env::var("GIXL_AT").ok().and_then(|v| v.parse().ok());
    let v = mem::alloc(dev, BULK, false, at).expect("VRAM allocation");
    mem::fill(v, BULK, fill);
    let vmm = mem::alloc(dev, BULK, true, None);
    if let Some(p) = vmm {
        mem::fill(p, BULK, fill ^ 0x0f);
    }
    let dram = vec![!fill; BULK];
    let a = agent("gpu-prefill");
    reg(&a, MemType::Vram, v, BULK, dev as u64).expect("register VRAM");
    let vmm = vmm.filter(|&p| match reg(&a, MemType::Vram, p, BULK, dev as u64) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("prefill: VMM allocation not registered: {e}");
            false
        }
    });
    reg(&a, MemType::Dram, dram.as_ptr() as u64, BULK, 0).expect("register DRAM");
    let out = std::io::stdout();
    let mut out = out.lock();
    let md = a.local_md().expect("metadata");
    writeln!(out, "\n@md {} {v} {} {}", hex(&md), vmm.unwrap_or(0), dram.as_ptr() as u64).ok();
    out.flush().ok();
    for line in std::io::stdin().lock().lines() {
        match line.as_deref().unwrap_or("") {
            "sum" => {
                let d: u64 = dram.iter().map(|&b| b as u64).sum();
                writeln!(out, "sum {} {d}", mem::sum(v, BULK)).ok();
            }
            _ => break,
        }
        out.flush().ok();
    }
}

struct Prefill {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    md: Vec<u8>,
    vram: u64,
    vmm: u64,
    dram: u64,
}

impl Prefill {
    fn start(fill: u8, at: Option<u64>) -> Prefill {
        Self::start_with(fill, at, None)
    }

    /// `transport`: "tcp" (the prefill's engine reaches every peer over TCP, its serving loops staging its
    /// VRAM), "rdma" (every peer with a port on its fabric over RDMA) or "fabric:<provider>" (the libfabric
    /// route on that provider).
    #[allow(clippy::zombie_processes)]
    fn start_with(fill: u8, at: Option<u64>, transport: Option<&str>) -> Prefill {
        let mut c = Command::new(std::env::current_exe().expect("own path"));
        match transport {
            Some("tcp") => {
                c.env("GIXL_TRANSPORT", "tcp").env("GIXL_TCP_ADDR", "127.0.0.1");
            }
            Some(t) => {
                // "fabric:<provider>": the libfabric route on that provider.
                match t.split_once(':') {
                    Some((t, prov)) => c.env("GIXL_TRANSPORT", t).env("GIXL_FABRIC_PROVIDER", prov),
                    None => c.env("GIXL_TRANSPORT", t),
                };
            }
            None => {}
        }
        c.env("GIXL_GPU_CHILD", "1").env("GIXL_FILL", fill.to_string()).stdin(Stdio::piped()).stdout(Stdio::piped());
        if let Some(at) = at {
            c.env("GIXL_AT", at.to_string());
        }
        let mut child = c.spawn().expect("spawn prefill");
        let stdin = child.stdin.take().expect("stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        loop {
            line.clear();
            assert!(stdout.read_line(&mut line).unwrap_or(0) > 0, "prefill exited before printing metadata");
            if let Some(rest) = line.trim().strip_prefix("@md ") {
                let f: Vec<&str> = rest.split(' ').collect();
                let n = |i: usize| f[i].parse::<u64>().unwrap_or(0);
                return Prefill { md: unhex(f[0]), vram: n(1), vmm: n(2), dram: n(3), child, stdin, stdout };
            }
        }
    }

    fn sums(&mut self) -> (u64, u64) {
        writeln!(self.stdin, "sum").ok();
        let mut l = String::new();
        self.stdout.read_line(&mut l).ok();
        let f: Vec<u64> = l.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
        (f[0], f[1])
    }

    fn kill(mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

fn run(a: &Agent, r: &XferReq) -> Result<Duration> {
    let t = Instant::now();
    let mut s = a.post_xfer_req(r, NotifUpdate::Keep)?;
    while s == Status::InProg {
        std::hint::spin_loop();
        s = a.xfer_status(r)?;
        if t.elapsed() > Duration::from_secs(60) {
            return Err(Error::new(Status::Backend, "timed out"));
        }
    }
    Ok(t.elapsed())
}

/// Median GB/s over `iters` posts of `r` moving `bytes`.
fn rate(a: &Agent, r: &XferReq, bytes: usize, iters: usize) -> Result<f64> {
    run(a, r)?; // warm-up (opens the handle)
    let mut v: Vec<f64> =
        (0..iters).map(|_| run(a, r).map(|d| bytes as f64 / d.as_secs_f64() / 1e9)).collect::<Result<_>>()?;
    v.sort_by(|x, y| x.total_cmp(y));
    Ok(v[v.len() / 2])
}

fn dl(mem: MemType, descs: Vec<(u64, usize)>, dev: u32) -> XferDList {
    XferDList::with_descs(mem, descs.into_iter().map(|(a, l)| Desc::new(a, l as u64, dev as u64)).collect())
}

/// A permutation of 0..n from a fixed seed (no rand crate).
fn shuffled(n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut x = 0x9e3779b97f4a7c15u64;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

fn main() {
    if std::env::var("GIXL_GPU_CHILD").is_ok() {
        child();
        return;
    }
    let iters: usize = std::env::var("GIXL_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
    let dev = gpu();
    let d = match device::get() {
        Ok(d) => d,
        Err(e) => {
            println!("gpu_check: no device layer: {e}");
            std::process::exit(2);
        }
    };
    println!("gpu_check: device layer '{}', GPU {dev}, {iters} iterations per figure (median)", d.kind());
    mem::current(dev);
    // GIXL_GPU_CHECK_ONLY=gds: the GDS cases alone (scripts/gpu-check.sh reruns them with GIXL_CUFILE=off
    // for the staged figures where the direct path was taken).
    if std::env::var("GIXL_GPU_CHECK_ONLY").is_ok_and(|v| v == "gds") {
        let failures = gds_cases(dev, iters);
        println!("\ngpu_check: {} failure(s)", failures);
        std::process::exit(if failures == 0 { 0 } else { 1 });
    }
    if std::env::var("GIXL_GPU_CHECK").as_deref() == Ok("fabric") {
        let failures = fabric_cases(dev, iters);
        println!("\ngpu_check (libfabric): {failures} failure(s)");
        std::process::exit(if failures == 0 { 0 } else { 1 });
    }
    let mut failures = 0;
    let mut check = |ok: bool, what: &str| {
        println!("  {} {what}", if ok { "ok  " } else { "FAIL" });
        if !ok {
            failures += 1;
        }
    };

    // The device's own device-to-device rate, through the same device layer.
    let (x, y) =
        (mem::alloc(dev, BULK, false, None).expect("alloc"), mem::alloc(dev, BULK, false, None).expect("alloc"));
    let mut d2d = Vec::new();
    for _ in 0..=iters {
        let t = Instant::now();
        d.copy(dev, &[Copy { dst: y, src: x, len: BULK as u64 }]).expect("D2D copy");
        d2d.push(BULK as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    d2d.sort_by(|a, b| a.total_cmp(b));
    let d2d = d2d[d2d.len() / 2];
    println!("device D2D copy, 64 MiB, in one process: {d2d:.1} GB/s");

    let mut p = Prefill::start(3, None);
    let a = agent("gpu-decode");
    let lv = mem::alloc(dev, BULK, false, None).expect("alloc");
    reg(&a, MemType::Vram, lv, BULK, dev as u64).expect("register local VRAM");
    let host = vec![0u8; BULK];
    reg(&a, MemType::Dram, host.as_ptr() as u64, BULK, 0).expect("register local DRAM");
    a.load_remote_md(&p.md).expect("load prefill metadata");
    let o = XferOpts::default();
    let (v, dr) = (MemType::Vram, MemType::Dram);
    let mk = |op, l: XferDList, r: XferDList| a.create_xfer_req(op, &l, &r, "gpu-prefill", &o);
    let mut rows: Vec<(String, f64)> = Vec::new();

    let bulk_l = || dl(v, vec![(lv, BULK)], dev);
    let bulk_r = |p: &Prefill| dl(v, vec![(p.vram, BULK)], dev);
    // READ 64 MiB.
    let r = mk(XferOp::Read, bulk_l(), bulk_r(&p)).expect("request");
    rows.push(("VRAM→VRAM READ 1 × 64 MiB".into(), rate(&a, &r, BULK, iters).unwrap_or(f64::NAN)));
    check(mem::sum(lv, BULK) == 3 * BULK as u64, "READ 64 MiB: data");
    // WRITE 64 MiB.
    mem::fill(lv, BULK, 7);
    let w = mk(XferOp::Write, bulk_l(), bulk_r(&p)).expect("request");
    rows.push(("VRAM→VRAM WRITE 1 × 64 MiB".into(), rate(&a, &w, BULK, iters).unwrap_or(f64::NAN)));
    check(p.sums().0 == 7 * BULK as u64, "WRITE 64 MiB: data");
    // 1024 × 16 KiB, remote blocks shuffled.
    let perm = shuffled(BLOCKS);
    let pattern: Vec<u8> = (0..BLOCKS * BLOCK).map(|i| (i / BLOCK) as u8 ^ 0x5a).collect();
    mem::write(lv, &pattern);
    let bl = dl(v, (0..BLOCKS).map(|i| (lv + (i * BLOCK) as u64, BLOCK)).collect(), dev);
    let br = |p: &Prefill| dl(v, perm.iter().map(|&j| (p.vram + (j * BLOCK) as u64, BLOCK)).collect(), dev);
    let w = mk(XferOp::Write, bl.clone(), br(&p)).expect("request");
    rows.push(("VRAM→VRAM WRITE 1024 × 16 KiB".into(), rate(&a, &w, BLOCKS * BLOCK, iters).unwrap_or(f64::NAN)));
    mem::fill(lv, BULK, 0);
    let r = mk(XferOp::Read, bl.clone(), br(&p)).expect("request");
    rows.push(("VRAM→VRAM READ 1024 × 16 KiB".into(), rate(&a, &r, BLOCKS * BLOCK, iters).unwrap_or(f64::NAN)));
    let mut back = vec![0u8; BLOCKS * BLOCK];
    mem::read(lv, &mut back);
    check(back == pattern, "1024 × 16 KiB WRITE then READ: data");
    // Remote VRAM ↔ local DRAM.
    let hl = dl(dr, vec![(host.as_ptr() as u64, BULK)], 0);
    let r = mk(XferOp::Read, hl.clone(), bulk_r(&p)).expect("request");
    rows.push(("remote VRAM → local DRAM (READ) 64 MiB".into(), rate(&a, &r, BULK, iters).unwrap_or(f64::NAN)));
    // The prefill's VRAM: 7 everywhere (the 64 MiB WRITE), block `perm[i]` holding pattern block `i`.
    let mut want = vec![7u8; BULK];
    for (i, &j) in perm.iter().enumerate() {
        want[j * BLOCK..(j + 1) * BLOCK].copy_from_slice(&pattern[i * BLOCK..(i + 1) * BLOCK]);
    }
    check(host == want, "remote VRAM → DRAM: data");
    let w = mk(XferOp::Write, hl.clone(), bulk_r(&p)).expect("request");
    rows.push(("local DRAM → remote VRAM (WRITE) 64 MiB".into(), rate(&a, &w, BULK, iters).unwrap_or(f64::NAN)));
    // Local VRAM ↔ remote DRAM (staged).
    mem::fill(lv, BULK, 0x21);
    let rd = dl(dr, vec![(p.dram, BULK)], 0);
    let w = mk(XferOp::Write, bulk_l(), rd.clone()).expect("request");
    rows.push((
        "local VRAM → remote DRAM (WRITE, staged) 64 MiB".into(),
        rate(&a, &w, BULK, iters).unwrap_or(f64::NAN),
    ));
    check(p.sums().1 == 0x21 * BULK as u64, "VRAM → remote DRAM: data");
    mem::fill(lv, BULK, 0);
    let r = mk(XferOp::Read, bulk_l(), rd).expect("request");
    rows.push(("remote DRAM → local VRAM (READ, staged) 64 MiB".into(), rate(&a, &r, BULK, iters).unwrap_or(f64::NAN)));
    check(mem::sum(lv, BULK) == 0x21 * BULK as u64, "remote DRAM → VRAM: data");
    // VMM allocation (POSIX-fd handle).
    if p.vmm != 0 {
        let r = mk(XferOp::Read, bulk_l(), dl(v, vec![(p.vmm, BULK)], dev)).expect("request");
        let name = format!("VMM VRAM→VRAM READ 1 × 64 MiB ({} chunks)", mem::VMM_CHUNKS);
        rows.push((name, rate(&a, &r, BULK, iters).unwrap_or(f64::NAN)));
        check(mem::sum(lv, BULK) == (3 ^ 0x0f) * BULK as u64, "VMM READ: data");
    } else {
        println!("  skip VMM case: the prefill could not create or register a VMM allocation (see its stderr)");
    }

    // The TCP route (another host, here loopback with transport=tcp): both sides staged through pinned buffers.
    {
        let mut pt = Prefill::start_with(5, None, Some("tcp"));
        let at = tcp_agent("gpu-decode-tcp");
        reg(&at, MemType::Vram, lv, BULK, dev as u64).expect("register local VRAM (TCP agent)");
        reg(&at, MemType::Dram, host.as_ptr() as u64, BULK, 0).expect("register local DRAM (TCP agent)");
        at.load_remote_md(&pt.md).expect("load TCP prefill metadata");
        let mk = |op, l: XferDList, r: XferDList| at.create_xfer_req(op, &l, &r, "gpu-prefill", &o);
        let r = mk(XferOp::Read, bulk_l(), bulk_r(&pt)).expect("request");
        rows.push(("TCP: VRAM→VRAM READ 1 × 64 MiB".into(), rate(&at, &r, BULK, iters).unwrap_or(f64::NAN)));
        check(mem::sum(lv, BULK) == 5 * BULK as u64, "TCP READ 64 MiB: data");
        mem::fill(lv, BULK, 0x17);
        let w = mk(XferOp::Write, bulk_l(), bulk_r(&pt)).expect("request");
        rows.push(("TCP: VRAM→VRAM WRITE 1 × 64 MiB".into(), rate(&at, &w, BULK, iters).unwrap_or(f64::NAN)));
        check(pt.sums().0 == 0x17 * BULK as u64, "TCP WRITE 64 MiB: data");
        mem::write(lv, &pattern);
        let w = mk(XferOp::Write, bl.clone(), br(&pt)).expect("request");
        rows.push((
            "TCP: VRAM→VRAM WRITE 1024 × 16 KiB".into(),
            rate(&at, &w, BLOCKS * BLOCK, iters).unwrap_or(f64::NAN),
        ));
        mem::fill(lv, BULK, 0);
        let r = mk(XferOp::Read, bl.clone(), br(&pt)).expect("request");
        rows.push((
            "TCP: VRAM→VRAM READ 1024 × 16 KiB".into(),
            rate(&at, &r, BLOCKS * BLOCK, iters).unwrap_or(f64::NAN),
        ));
        let mut back = vec![0u8; BLOCKS * BLOCK];
        mem::read(lv, &mut back);
        check(back == pattern, "TCP 1024 × 16 KiB WRITE then READ: data");
        let hl = dl(dr, vec![(host.as_ptr() as u64, BULK)], 0);
        let r = mk(XferOp::Read, hl, bulk_r(&pt)).expect("request");
        rows.push(("TCP: remote VRAM → local DRAM 64 MiB".into(), rate(&at, &r, BULK, iters).unwrap_or(f64::NAN)));
        let mut want = vec![0x17u8; BULK];
        for (i, &j) in perm.iter().enumerate() {
            want[j * BLOCK..(j + 1) * BLOCK].copy_from_slice(&pattern[i * BLOCK..(i + 1) * BLOCK]);
        }
        check(host == want, "TCP remote VRAM → DRAM: data");
        let rd = dl(dr, vec![(pt.dram, BULK)], 0);
        mem::fill(lv, BULK, 0x29);
        let w = mk(XferOp::Write, bulk_l(), rd.clone()).expect("request");
        rows.push(("TCP: local VRAM → remote DRAM 64 MiB".into(), rate(&at, &w, BULK, iters).unwrap_or(f64::NAN)));
        check(pt.sums().1 == 0x29 * BULK as u64, "TCP VRAM → remote DRAM: data");
        mem::fill(lv, BULK, 0);
        let r = mk(XferOp::Read, bulk_l(), rd).expect("request");
        rows.push(("TCP: remote DRAM → local VRAM 64 MiB".into(), rate(&at, &r, BULK, iters).unwrap_or(f64::NAN)));
        check(mem::sum(lv, BULK) == 0x29 * BULK as u64, "TCP remote DRAM → VRAM: data");
        pt.kill();
    }

    // The RDMA route, where there is a port to take it.
    let fabric = gixl::verbs::fabric().and_then(|f| Ok((f.name(), f.ports()?)));
    match fabric {
        Ok((name, ports)) if ports.iter().any(|p| p.active) => {
            for p in &ports {
                println!(
                    "RDMA port {}:{} {:?} active {} numa {:?} pci {:?}",
                    p.device, p.port, p.link, p.active, p.numa, p.pci
                );
            }
            let mut pr = Prefill::start_with(11, None, Some("rdma"));
            let ar = agent_with("gpu-decode-rdma", [("transport".to_owned(), "rdma".to_owned())].into());
            // Regions become memory regions at registration (eagerly): what that costs on this NIC.
            let t = Instant::now();
            reg(&ar, MemType::Vram, lv, BULK, dev as u64).expect("register local VRAM (RDMA agent)");
            let tv = t.elapsed();
            let t = Instant::now();
            reg(&ar, MemType::Dram, host.as_ptr() as u64, BULK, 0).expect("register local DRAM (RDMA agent)");
            println!(
                "RDMA: registering 64 MiB took {:.2} ms (VRAM) and {:.2} ms (DRAM), every port included: paid once at \
                 registration (lazily it would fall on a region's first request)",
                tv.as_secs_f64() * 1e3,
                t.elapsed().as_secs_f64() * 1e3
            );
            ar.load_remote_md(&pr.md).expect("load RDMA prefill metadata");
            let route = gixl::telemetry::live_agents()
                .into_iter()
                .filter(|(n, _, _)| n == "gpu-decode-rdma")
                .flat_map(|(_, _, rows)| rows)
                .map(|r| r.route)
                .next()
                .unwrap_or_default();
            check(route == "rdma", &format!("RDMA ({name} fabric): the route is '{route}'"));
            let mk = |op, l: XferDList, r: XferDList| ar.create_xfer_req(op, &l, &r, "gpu-prefill", &o);
            let r = mk(XferOp::Read, bulk_l(), bulk_r(&pr)).expect("request");
            rows.push(("RDMA: VRAM→VRAM READ 1 × 64 MiB".into(), rate(&ar, &r, BULK, iters).unwrap_or(f64::NAN)));
            check(mem::sum(lv, BULK) == 11 * BULK as u64, "RDMA READ 64 MiB: data");
            mem::fill(lv, BULK, 0x33);
            let w = mk(XferOp::Write, bulk_l(), bulk_r(&pr)).expect("request");
            rows.push(("RDMA: VRAM→VRAM WRITE 1 × 64 MiB".into(), rate(&ar, &w, BULK, iters).unwrap_or(f64::NAN)));
            check(pr.sums().0 == 0x33 * BULK as u64, "RDMA WRITE 64 MiB: data");
            mem::write(lv, &pattern);
            let w = mk(XferOp::Write, bl.clone(), br(&pr)).expect("request");
            let name = "RDMA: VRAM→VRAM WRITE 1024 × 16 KiB";
            rows.push((name.into(), rate(&ar, &w, BLOCKS * BLOCK, iters).unwrap_or(f64::NAN)));
            mem::fill(lv, BULK, 0);
            let r = mk(XferOp::Read, bl.clone(), br(&pr)).expect("request");
            let name = "RDMA: VRAM→VRAM READ 1024 × 16 KiB";
            rows.push((name.into(), rate(&ar, &r, BLOCKS * BLOCK, iters).unwrap_or(f64::NAN)));
            let mut back = vec![0u8; BLOCKS * BLOCK];
            mem::read(lv, &mut back);
            check(back == pattern, "RDMA 1024 × 16 KiB WRITE then READ: data");
            let r = mk(XferOp::Read, dl(dr, vec![(host.as_ptr() as u64, BULK)], 0), dl(dr, vec![(pr.dram, BULK)], 0))
                .expect("request");
            rows.push(("RDMA: DRAM→DRAM READ 1 × 64 MiB".into(), rate(&ar, &r, BULK, iters).unwrap_or(f64::NAN)));
            check(host.iter().all(|&b| b == !11u8), "RDMA DRAM READ: data");
            pr.kill();
        }
        Ok((name, _)) => println!("RDMA: the {name} fabric has no active port: RDMA cases not run"),
        Err(e) => println!("RDMA: {e}: RDMA cases not run"),
    }

    println!("\n| case | gixl GB/s | of device D2D |");
    println!("|---|---:|---:|");
    for (name, gbs) in &rows {
        println!("| {name} | {gbs:.2} | {:.0}% |", 100.0 * gbs / d2d);
    }
    println!("| device D2D (one process) | {d2d:.2} | 100% |\n");

    // Restart with the old IPC handle.
    let old = p.vram;
    let r = mk(XferOp::Read, bulk_l(), bulk_r(&p)).expect("request");
    let w = mk(XferOp::Write, dl(v, vec![(lv, 4096)], dev), dl(v, vec![(p.vram, 4096)], dev)).expect("request");
    run(&a, &r).expect("READ before the kill");
    p.kill();
    let t = Instant::now();
    let e = run(&a, &w).err();
    check(
        e.as_ref().map(|e| e.status()) == Some(Status::RemoteDisconnect),
        &format!("killed peer, old handle: {:?} after {:?}", e.map(|e| e.status()), t.elapsed()),
    );
    let mut p2 = Prefill::start(9, Some(old));
    println!(
        "  restarted prefill: VRAM at {:#x} ({} address)",
        p2.vram,
        if p2.vram == old { "same" } else { "another" }
    );
    let e = run(&a, &w).err().map(|e| e.status());
    check(e == Some(Status::RemoteDisconnect), &format!("restarted peer, not reloaded, old handle: {e:?}"));
    a.invalidate_remote_md("gpu-prefill").expect("invalidate");
    a.load_remote_md(&p2.md).expect("load new metadata");
    let e = run(&a, &w).err().map(|e| e.status());
    check(e == Some(Status::NotFound), &format!("reloaded, old handle: {e:?}"));
    check(p2.sums().0 == 9 * BULK as u64, "the new incarnation's VRAM is unchanged");
    let r2 = mk(XferOp::Read, bulk_l(), bulk_r(&p2)).expect("request");
    let ok = run(&a, &r2).is_ok() && mem::sum(lv, BULK) == 9 * BULK as u64;
    check(ok, "new handle READ: data");
    p2.kill();
    let failures = failures + gds_cases(dev, iters);
    println!("\ngpu_check: {} failure(s)", failures);
    std::process::exit(if failures == 0 { 0 } else { 1 });
}

/// The libfabric route over a NIC provider of this host (efa, verbs…), where libfabric offers one: see the
/// module's comment. The number of failed checks.
fn fabric_cases(dev: u32, iters: usize) -> usize {
    let mut failures = 0;
    let mut check = |ok: bool, what: &str| {
        println!("  {} {what}", if ok { "ok  " } else { "FAIL" });
        failures += usize::from(!ok);
    };
    let all = match gixl::fabric::devices(None, None) {
        Ok(v) => v,
        Err(e) => {
            println!("libfabric: {e}: libfabric cases not run");
            return 0;
        }
    };
    let names: Vec<String> = all.iter().map(|d| format!("{}/{}", d.provider(), d.domain())).collect();
    println!("libfabric devices (RDM endpoints with one-sided RMA): {}", names.join(", "));
    let forced = std::env::var("GIXL_GPU_CHECK_FABRIC_PROVIDER").ok();
    let nics: Vec<&gixl::fabric::Device> = all
        .iter()
        .filter(|d| match &forced {
            Some(p) => d.provider() == *p,
            None => !gixl::fabric::is_sockets(&d.provider()),
        })
        .collect();
    if nics.is_empty() {
        println!(
            "libfabric: no provider here beyond sockets and shared memory (tcp, udp, shm…): the route over a NIC \
             provider (efa, verbs) not run"
        );
        return 0;
    }
    let mut passed = None;
    for d in &nics {
        let t = gixl::fabric::selftest::run(d, Duration::from_secs(10));
        check(t.passed(), &format!("libfabric self-test (an endpoint of its own) {t}"));
        if t.passed() && passed.is_none() {
            passed = Some(d.provider());
        }
    }
    let Some(prov) = passed else { return failures };
    let mut pf = Prefill::start_with(0x21, None, Some(&format!("fabric:{prov}")));
    let p: Params =
        [("transport", "fabric"), ("fabric_provider", prov.as_str())].map(|(k, v)| (k.to_owned(), v.to_owned())).into();
    let a = agent_with("gpu-decode-fi", p);
    let lv = mem::alloc(dev, BULK, false, None).expect("alloc");
    reg(&a, MemType::Vram, lv, BULK, dev as u64).expect("register local VRAM (libfabric agent)");
    let mut host = vec![0u8; BULK];
    reg(&a, MemType::Dram, host.as_ptr() as u64, BULK, 0).expect("register local DRAM (libfabric agent)");
    a.load_remote_md(&pf.md).expect("load the libfabric prefill's metadata");
    let o = XferOpts::default();
    let mk = |op, l: XferDList, r: XferDList| a.create_xfer_req(op, &l, &r, "gpu-prefill", &o);
    let dram = |hp: &[u8], p: &Prefill| {
        (dl(MemType::Dram, vec![(hp.as_ptr() as u64, BULK)], 0), dl(MemType::Dram, vec![(p.dram, BULK)], 0))
    };
    let mut rows: Vec<(String, f64)> = Vec::new();
    let (l, r) = dram(&host, &pf);
    let rd = mk(XferOp::Read, l, r).expect("request");
    rows.push((format!("libfabric {prov}: DRAM→DRAM READ 1 × 64 MiB"), rate(&a, &rd, BULK, iters).unwrap_or(f64::NAN)));
    let route = gixl::telemetry::live_agents()
        .into_iter()
        .filter(|(n, _, _)| n == "gpu-decode-fi")
        .flat_map(|(_, _, rows)| rows)
        .map(|r| r.route)
        .next()
        .unwrap_or_default();
    check(route == "libfabric", &format!("libfabric {prov}: the route is '{route}'"));
    check(host.iter().all(|&b| b == !0x21u8), "libfabric DRAM READ 64 MiB: data");
    host.iter_mut().for_each(|b| *b = 0x44);
    let (l, r) = dram(&host, &pf);
    let w = mk(XferOp::Write, l, r).expect("request");
    rows.push((format!("libfabric {prov}: DRAM→DRAM WRITE 1 × 64 MiB"), rate(&a, &w, BULK, iters).unwrap_or(f64::NAN)));
    check(pf.sums().1 == 0x44 * BULK as u64, "libfabric DRAM WRITE 64 MiB: data at the target");
    let r = mk(XferOp::Read, dl(MemType::Vram, vec![(lv, BULK)], dev), dl(MemType::Vram, vec![(pf.vram, BULK)], dev))
        .expect("request");
    // GPU memory goes through FI_HMEM where this side's rails registered it (their device offers FI_HMEM and
    // passed the GPU-memory self-test, run when the VRAM was registered above) and the peer's did too; else it
    // is staged over the TCP link. This side's verdict, from its self-test records:
    let gpu_tests: Vec<_> = gixl::fabric::selftest::records()
        .into_iter()
        .filter(|r| r.device.starts_with(&format!("{prov}/")) && r.device.contains(" (GPU memory"))
        .collect();
    let hmem_here = gpu_tests.iter().any(|r| r.passed);
    let how = if hmem_here {
        let ways: Vec<&str> = gpu_tests.iter().filter(|r| r.passed).map(|r| r.device.as_str()).collect();
        format!(
            "direct through FI_HMEM where the peer's rails carry it too (this side's GPU-memory self-test passed: {})",
            ways.join(", ")
        )
    } else if gpu_tests.is_empty() {
        "staged over the TCP link (no rail of this provider offers FI_HMEM)".to_owned()
    } else {
        let why: Vec<String> = gpu_tests.iter().map(|r| format!("{} at {}", r.device, r.step.unwrap_or("?"))).collect();
        format!("staged over the TCP link (GPU-memory self-test failed: {})", why.join(", "))
    };
    println!("libfabric {prov}: VRAM: {how}");
    let copied = gixl::device::is_fake().then(gixl::device::fake::copied_bytes);
    let name = format!(
        "libfabric {prov}: VRAM→VRAM READ 1 × 64 MiB ({})",
        if hmem_here { "FI_HMEM, direct" } else { "staged over the TCP link" }
    );
    rows.push((name, rate(&a, &r, BULK, iters).unwrap_or(f64::NAN)));
    check(mem::sum(lv, BULK) == 0x21 * BULK as u64, "libfabric VRAM READ 64 MiB: data");
    if let Some(c) = copied {
        // The fake device (a dry run): its copies are what staging does here; none where it went direct.
        let c = gixl::device::fake::copied_bytes() - c;
        println!("libfabric {prov}: the fake device layer copied {c} bytes during the VRAM READs (0: not staged here)");
    }
    for r in gixl::fabric::selftest::records() {
        println!(
            "libfabric self-test record {}: {} in {:.1} ms{}",
            r.device,
            if r.passed { "passed" } else { "failed" },
            r.ms,
            r.error.map(|e| format!(" ({e})")).unwrap_or_default()
        );
    }
    println!("\n| case | gixl GB/s |");
    println!("|---|---:|");
    for (name, gbs) in &rows {
        println!("| {name} | {gbs:.2} |");
    }
    drop(host);
    pf.kill();
    failures
}

/// The GDS backends: VRAM → FILE → VRAM, 1 × 64 MiB and 1024 × 16 KiB scattered, buffered and O_DIRECT, in
/// `GIXL_GDS_DIR` (default /tmp), through GDS and GDS_MT, beside POSIX DRAM ↔ FILE on the same file. Says which
/// path (staged, or cuFile) the backends take here and why. Returns the number of failed checks.
fn gds_cases(dev: u32, iters: usize) -> usize {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    // Asking runs cuFile's self-test (once per process) where libcufile is installed.
    let route = match gixl::backend::gds::staged_reason() {
        None => {
            println!("GDS: cuFile self-test PASSED: VRAM <-> FILE goes direct through cuFile here");
            "direct"
        }
        Some(why) => {
            println!("GDS: cuFile self-test not passed (or not run): staged through page-locked host buffers: {why}");
            "staged"
        }
    };
    let dir = std::env::var("GIXL_GDS_DIR").unwrap_or_else(|_| "/tmp".into());
    let mut failures = 0;
    let mut check = |ok: bool, what: &str| {
        println!("  {} {what}", if ok { "ok  " } else { "FAIL" });
        failures += usize::from(!ok);
    };
    let src = mem::alloc(dev, BULK, false, None).expect("alloc");
    let dst = mem::alloc(dev, BULK, false, None).expect("alloc");
    let pattern: Vec<u8> = (0..BULK).map(|i| (i.wrapping_mul(2654435761) >> 9) as u8).collect();
    mem::write(src, &pattern);
    let order = shuffled(BLOCKS);
    let scattered: Vec<(u64, u64, u64)> =
        (0..BLOCKS).map(|i| ((i * BLOCK) as u64, (order[i] * 2 * BLOCK) as u64, BLOCK as u64)).collect();
    let shapes = [("1 × 64 MiB", vec![(0u64, 0u64, BULK as u64)]), ("1024 × 16 KiB", scattered)];
    let host = vec![0u8; BULK + 4096];
    let h = (host.as_ptr() as u64).div_ceil(4096) * 4096;
    for plugin in ["GDS", "GDS_MT"] {
        for direct in [false, true] {
            let path = format!("{dir}/gixl-gpu-check-{}-{plugin}-{direct}", std::process::id());
            let mut o = std::fs::File::options();
            o.read(true).write(true).create(true).truncate(true);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            let f = match o.open(&path) {
                Ok(f) => f,
                Err(e) => {
                    println!("GDS {plugin}: cannot open {path} (O_DIRECT {direct}): {e}: not run");
                    continue;
                }
            };
            let fd = f.as_raw_fd() as u64;
            let a = Agent::new(&format!("gpu-gds-{plugin}-{direct}"), AgentConfig::default()).expect("agent");
            let b = a.create_backend(plugin, &Params::new()).expect("GDS backend");
            let px = a.create_backend("POSIX", &Params::new()).expect("POSIX backend");
            let file = RegDList::with_descs(MemType::File, vec![RegDesc { desc: Desc::new(0, 0, fd), meta: vec![] }]);
            let regs = [(MemType::Vram, src, dev as u64), (MemType::Vram, dst, dev as u64)];
            for (m, p, d) in regs {
                a.register_mem(
                    &RegDList::with_descs(m, vec![RegDesc { desc: Desc::new(p, BULK as u64, d), meta: vec![] }]),
                    &[b],
                )
                .expect("register VRAM");
            }
            a.register_mem(&file, &[b, px]).expect("register FILE");
            a.register_mem(
                &RegDList::with_descs(
                    MemType::Dram,
                    vec![RegDesc { desc: Desc::new(h, BULK as u64, 0), meta: vec![] }],
                ),
                &[px],
            )
            .expect("register DRAM");
            let tag = if direct { "O_DIRECT" } else { "page cache" };
            for (shape, pieces) in &shapes {
                let bytes: usize = pieces.iter().map(|p| p.2 as usize).sum();
                let mk = |op, m: MemType, base: u64, d: u32, be: BackendId| {
                    let l = dl(m, pieces.iter().map(|&(x, _, n)| (base + x, n as usize)).collect(), d);
                    let r = XferDList::with_descs(
                        MemType::File,
                        pieces.iter().map(|&(_, off, n)| Desc::new(off, n, fd)).collect(),
                    );
                    a.create_xfer_req(op, &l, &r, a.name(), &XferOpts { backends: vec![be], ..XferOpts::default() })
                };
                let w = mk(XferOp::Write, MemType::Vram, src, dev, b).expect("request");
                let r = mk(XferOp::Read, MemType::Vram, dst, dev, b).expect("request");
                mem::fill(dst, BULK, 0);
                let wr = rate(&a, &w, bytes, iters).unwrap_or(f64::NAN);
                let rr = rate(&a, &r, bytes, iters).unwrap_or(f64::NAN);
                let mut back = vec![0u8; BULK];
                mem::read(dst, &mut back);
                let same = pieces
                    .iter()
                    .all(|&(x, _, n)| back[x as usize..][..n as usize] == pattern[x as usize..][..n as usize]);
                check(same, &format!("{plugin} ({route}) {tag} {shape}: VRAM → FILE → VRAM data"));
                let pw = mk(XferOp::Write, MemType::Dram, h, 0, px).expect("request");
                let pr = mk(XferOp::Read, MemType::Dram, h, 0, px).expect("request");
                let (pwr, prr) =
                    (rate(&a, &pw, bytes, iters).unwrap_or(f64::NAN), rate(&a, &pr, bytes, iters).unwrap_or(f64::NAN));
                println!(
                    "  {plugin} ({route}) {tag} {shape}: WRITE {wr:.2} GB/s ({:.0}% of POSIX DRAM {pwr:.2}), READ {rr:.2} GB/s ({:.0}% of {prr:.2})",
                    100.0 * wr / pwr,
                    100.0 * rr / prr
                );
            }
            drop(a);
            drop(f);
            let _ = std::fs::remove_file(&path);
        }
    }
    failures
}
