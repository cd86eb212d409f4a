//! GPU memory over the libfabric route (`FI_HMEM`), between two real processes over the real library (Debian's
//! libfabric 1.17, and libfabric 2.1.0 in scripts/test-all.sh's second run; see tests/common/fabric.rs), with
//! the fake device layer (`GIXL_FAKE_DEVICE=1`: host memory standing for a GPU). Neither library is built with
//! CUDA, and no GPU or NIC is here, so:
//! - **shm, the fake device's memory registered as host memory** (`GIXL_TEST_FABRIC_HMEM=system`: it IS host
//!   memory; `FI_HMEM_SYSTEM`): this runs our `FI_HMEM` path (`fi_mr_regattr` with an interface, the rail's
//!   GPU-memory self-test, tickets naming the rails that carry the region, requests on VRAM going direct), not a
//!   GPU's. VRAM←→VRAM, VRAM←→DRAM and DRAM←→VRAM READs and WRITEs of 64 MiB and of 1024 × 16 KiB, data checked,
//!   and no byte staged: the fake device layer's copies (what staging over TCP does) stay at zero on both
//!   sides. With libfabric ≥ 1.20 the initiator's GPU memory goes as a dma-buf (`FI_MR_DMABUF`; shm uses the
//!   address the descriptor gives, not the descriptor), the target's, a fake GPU exporting none
//!   (`GIXL_FAKE_DMABUF=0`), by its interface after its dma-buf self-test failed. A VRAM region deregistered
//!   at the target hands out no byte, and a READ of it ends NOT_FOUND within 2 s (shm never answers an
//!   operation on a closed key; the target's closed-key notice tells the initiator, which gives it up).
//! - **shm, the fake device declaring `FI_HMEM_CUDA`** as a real GPU would, on this CUDA-less library: the
//!   rail's GPU-memory self-test fails (at registration), one WARN line names the rail, the step and the
//!   fallback, the doctor shows it, and the same requests are staged over TCP (the device layer copies them),
//!   data still right.
//! - **tcp;ofi_rxm** (no `FI_HMEM`): staged over TCP as before, data right.
//!
//! The cases run one after another in one test (they set `GIXL_TEST_FABRIC_HMEM` in this process). The child is
//! this binary re-run with `GIXL_CHILD=fabric-vram-prefill`.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gixl::*;

mod common;
use common::fabric::{agent, setup};
use common::route_of;
use common::{hex, unhex};

const SIZE: usize = 64 << 20;
const BLOCK: usize = 16 << 10;

fn reg_of(mem: MemType, buf: &[u8]) -> RegDList {
    let d = Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0);
    RegDList::with_descs(mem, vec![RegDesc { desc: d, meta: vec![] }])
}

/// `SIZE` bytes of fake device memory on GPU 0 (host memory the fake device layer calls device memory).
fn fake_vram() -> &'static mut [u8] {
    let p = gixl::device::fake::alloc(0, SIZE, false, None).unwrap();
    // SAFETY: a fresh fake allocation of `SIZE` bytes in this process, never freed.
    unsafe { std::slice::from_raw_parts_mut(p as usize as *mut u8, SIZE) }
}

fn pattern(buf: &mut [u8], seed: usize) {
    buf.iter_mut().enumerate().for_each(|(i, b)| *b = ((i + seed) % 251) as u8);
}

fn sum(buf: &[u8]) -> u64 {
    buf.iter().map(|&b| b as u64).sum()
}

/// The target: `SIZE` bytes of fake VRAM (byte i = (i + seed) % 251) and `SIZE` of DRAM ((i + seed + 1) % 251),
/// both registered; `@md <md> <vram> <dram>`; then commands.
fn prefill_child() {
    setup("fabric vram child").expect("the parent found libfabric");
    let seed: usize = std::env::var("GIXL_SEED").unwrap().parse().unwrap();
    let a = agent("prefill", &std::env::var("GIXL_FABRIC_PROVIDER").unwrap());
    let vram = fake_vram();
    pattern(vram, seed);
    let mut dram = vec![0u8; SIZE];
    pattern(&mut dram, seed + 1);
    a.register_mem(&reg_of(MemType::Vram, vram), &[]).unwrap();
    a.register_mem(&reg_of(MemType::Dram, &dram), &[]).unwrap();
    let mut out = std::io::stdout().lock();
    let md = hex(&a.local_md().unwrap());
    writeln!(out, "\n@md {md} {} {}", vram.as_ptr() as u64, dram.as_ptr() as u64).unwrap();
    out.flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        match line.unwrap().as_str() {
            "sum" => writeln!(out, "sum {}", sum(vram)).unwrap(),
            "reset" => {
                pattern(vram, seed);
                pattern(&mut dram, seed + 1);
                writeln!(out, "reset done").unwrap();
            }
            "dsum" => writeln!(out, "dsum {}", sum(&dram)).unwrap(),
            // Bytes this process's fake device layer copied: staging, where VRAM is served over TCP.
            "copied" => writeln!(out, "copied {}", gixl::device::fake::copied_bytes()).unwrap(),
            // This process's GPU-memory self-tests: `<device> <passed> <step>` each, on one line.
            "selftests" => {
                let rec = gixl::fabric::selftest::records();
                let all: Vec<String> = rec
                    .iter()
                    .filter(|r| r.device.contains("GPU memory"))
                    .map(|r| format!("{}={}:{}", r.device.replace(' ', "_"), r.passed, r.step.unwrap_or("-")))
                    .collect();
                writeln!(out, "selftests {}", all.join(" ")).unwrap()
            }
            "dereg" => {
                a.deregister_mem(&reg_of(MemType::Vram, vram), &[]).unwrap();
                writeln!(out, "dereg done").unwrap();
            }
            _ => break,
        }
        out.flush().unwrap();
    }
}

#[test]
fn child_entry() {
    if std::env::var("GIXL_CHILD").as_deref() == Ok("fabric-vram-prefill") {
        prefill_child();
    }
}

struct Prefill {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    md: Vec<u8>,
    vram: u64,
    dram: u64,
}

impl Prefill {
    fn start(seed: usize, provider: &str, hmem: &str) -> Prefill {
        Prefill::start_with(seed, provider, hmem, &[])
    }

    fn start_with(seed: usize, provider: &str, hmem: &str, env: &[(&str, &str)]) -> Prefill {
        let mut c = Command::new(std::env::current_exe().unwrap());
        c.envs(env.iter().copied());
        c.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env("GIXL_CHILD", "fabric-vram-prefill")
            .env("GIXL_SEED", seed.to_string())
            .env("GIXL_FABRIC_PROVIDER", provider)
            .env("GIXL_FAKE_DEVICE", "1")
            .env("GIXL_TEST_FABRIC_HMEM", hmem);
        let (child, stdin, stdout, rest) = common::spawn_until_md(c);
        let mut it = rest.split(' ');
        let md = unhex(it.next().unwrap());
        let vram = it.next().unwrap().parse().unwrap();
        let dram = it.next().unwrap().parse().unwrap();
        Prefill { child, stdin, stdout, md, vram, dram }
    }

    fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        let mut l = String::new();
        assert!(self.stdout.read_line(&mut l).unwrap() > 0, "the child exited");
        l.trim().to_owned()
    }

    fn number(&mut self, cmd: &str) -> u64 {
        let l = self.ask(cmd);
        l.rsplit(' ').next().unwrap().parse().unwrap_or_else(|_| panic!("{cmd}: {l}"))
    }
}

impl Drop for Prefill {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A killed child leaves its shm regions behind (tmpfs: memory).
        gixl::fabric::clear_shm_regions(self.child.id());
    }
}

fn one(mem: MemType, addr: u64) -> XferDList {
    XferDList::with_descs(mem, vec![Desc::new(addr, SIZE as u64, 0)])
}

/// 1024 blocks of `BLOCK` bytes from `addr`, in order, or reversed.
fn blocks(mem: MemType, addr: u64, reversed: bool) -> XferDList {
    let n = 1024;
    let at = |i: usize| if reversed { n - 1 - i } else { i };
    XferDList::with_descs(mem, (0..n).map(|i| Desc::new(addr + (at(i) * BLOCK) as u64, BLOCK as u64, 0)).collect())
}

fn run(a: &Agent, op: XferOp, l: &XferDList, r: &XferDList) -> Result<Status> {
    let req = a.create_xfer_req(op, l, r, "prefill", &XferOpts::default())?;
    let mut s = a.post_xfer_req(&req, NotifUpdate::Keep)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while s == Status::InProg {
        assert!(Instant::now() < deadline, "a request did not finish in 60 s");
        std::thread::sleep(Duration::from_micros(200));
        s = a.xfer_status(&req)?;
    }
    Ok(s)
}

static WARNS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Every combination of local and remote memory with VRAM on a side (VRAM←→VRAM, VRAM←→DRAM, DRAM←→VRAM): a
/// 64 MiB READ, a 1024 × 16 KiB READ (remote blocks reversed), a 1024 × 16 KiB WRITE of ones (remote blocks
/// reversed) and a 64 MiB WRITE of twos against `p`, data checked (READs here, WRITEs by the target's sums); the
/// bytes the fake device layers copied meanwhile (here, there).
fn exchange(a: &Agent, p: &mut Prefill, seed: usize, vram: &mut [u8], dram: &mut [u8]) -> (u64, u64) {
    let (v, d) = (MemType::Vram, MemType::Dram);
    let (here0, there0) = (gixl::device::fake::copied_bytes(), p.number("copied"));
    for (lm, rm) in [(v, v), (v, d), (d, v)] {
        assert_eq!(p.ask("reset"), "reset done");
        let what = format!("{lm:?} ← {rm:?}");
        let buf: &mut [u8] = if lm == v { &mut *vram } else { &mut *dram };
        let here = buf.as_ptr() as u64;
        // The target's buffer and its pattern's seed.
        let (there, rseed, sum) = if rm == v { (p.vram, seed, "sum") } else { (p.dram, seed + 1, "dsum") };
        let ok = |s: Result<Status>, op: &str| assert_eq!(s.unwrap(), Status::Success, "{what}: {op}");
        buf.fill(0);
        ok(run(a, XferOp::Read, &one(lm, here), &one(rm, there)), "64 MiB READ");
        assert!(buf.iter().enumerate().all(|(i, &b)| b == ((i + rseed) % 251) as u8), "{what}: 64 MiB READ data");
        buf.fill(0);
        ok(run(a, XferOp::Read, &blocks(lm, here, false), &blocks(rm, there, true)), "1024 × 16 KiB READ");
        for i in 0..1024 {
            let base = (1023 - i) * BLOCK;
            let good =
                buf[i * BLOCK..(i + 1) * BLOCK].iter().enumerate().all(|(j, &b)| b == ((base + j + rseed) % 251) as u8);
            assert!(good, "{what}: 1024 × 16 KiB READ data, block {i}");
        }
        buf.fill(1);
        ok(run(a, XferOp::Write, &blocks(lm, here, false), &blocks(rm, there, true)), "1024 × 16 KiB WRITE");
        let rest: u64 = (1024 * BLOCK..SIZE).map(|i| ((i + rseed) % 251) as u64).sum();
        assert_eq!(p.number(sum), (1024 * BLOCK) as u64 + rest, "{what}: 1024 × 16 KiB WRITE data");
        buf.fill(2);
        ok(run(a, XferOp::Write, &one(lm, here), &one(rm, there)), "64 MiB WRITE");
        assert_eq!(p.number(sum), 2 * SIZE as u64, "{what}: 64 MiB WRITE data");
    }
    (gixl::device::fake::copied_bytes() - here0, p.number("copied") - there0)
}

/// The agent for one case, its buffers registered, the peer's metadata loaded.
fn start(me: &str, provider: &str, p: &Prefill) -> (Agent, &'static mut [u8], Vec<u8>) {
    let a = agent(me, provider);
    let vram = fake_vram();
    let dram = vec![0u8; SIZE];
    a.register_mem(&reg_of(MemType::Vram, vram), &[]).unwrap();
    a.register_mem(&reg_of(MemType::Dram, &dram), &[]).unwrap();
    a.load_remote_md(&p.md).unwrap();
    assert_eq!(route_of(me, "prefill"), "libfabric", "{me}");
    (a, vram, dram)
}

#[test]
fn gpu_memory_goes_through_fi_hmem_where_the_rail_carries_it_else_staged_over_tcp() {
    if setup("fabric vram").is_none() {
        return;
    }
    std::env::set_var("GIXL_FAKE_DEVICE", "1");
    gixl::telemetry::log::set_sink(Box::new(|level, msg| {
        if level == gixl::telemetry::log::Level::Warn {
            WARNS.lock().unwrap().push(msg.to_owned());
        }
        gixl::telemetry::log::stderr(level, msg);
    }));

    // (a) shm, the fake device's memory registered as the host memory it is (FI_HMEM_SYSTEM): our FI_HMEM path
    // runs for real (not a GPU's): every request direct, nothing staged.
    // From libfabric 1.20 on, GPU memory goes as a dma-buf (the fake device's memfd; shm reaches the memory by
    // the address the dma-buf descriptor gives); the target here is a fake GPU that exports none
    // (GIXL_FAKE_DMABUF=0): its dma-buf self-test fails at registration and it registers by interface instead.
    std::env::set_var("GIXL_TEST_FABRIC_HMEM", "system");
    let dmabuf = gixl::fabric::sys::lib().unwrap().api >= gixl::fabric::sys::API_1_20;
    {
        let mut p = Prefill::start_with(5, "shm", "system", &[("GIXL_FAKE_DMABUF", "0")]);
        let (a, vram, mut dram) = start("decode-hmem-system", "shm", &p);
        let (here, there) = exchange(&a, &mut p, 5, vram, &mut dram);
        assert_eq!((here, there), (0, 0), "FI_HMEM over shm: nothing staged through the device layer on either side");
        let rec = gixl::fabric::selftest::records();
        let gpu: Vec<_> = rec.iter().filter(|r| r.device.starts_with("shm/shm (GPU memory")).collect();
        let names: Vec<&str> = gpu.iter().map(|r| r.device.as_str()).collect();
        if dmabuf {
            assert_eq!(names, ["shm/shm (GPU memory, dma-buf)"], "{rec:?}");
        } else {
            assert_eq!(names, ["shm/shm (GPU memory)"], "{rec:?}");
        }
        assert!(gpu[0].passed, "{gpu:?}");
        let theirs = p.ask("selftests");
        if dmabuf {
            assert_eq!(
                theirs, "selftests shm/shm_(GPU_memory,_dma-buf)=false:vram-register shm/shm_(GPU_memory)=true:-",
                "the target, which exports no dma-buf"
            );
        } else {
            assert_eq!(theirs, "selftests shm/shm_(GPU_memory)=true:-");
        }
        // Deregistration: once the target's VRAM region is deregistered, its key hands out no byte, and a READ
        // on it ends NOT_FOUND within the bound. shm never answers an operation on a closed key (1.17 and 2.1,
        // host memory alike); the target's closed-key notice on the greeting connection tells the initiator,
        // which refuses the piece (or gives up what it posted).
        assert_eq!(p.ask("dereg"), "dereg done");
        vram.fill(0);
        let (l, r) = (one(MemType::Vram, vram.as_ptr() as u64), one(MemType::Vram, p.vram));
        let req = a.create_xfer_req(XferOp::Read, &l, &r, "prefill", &XferOpts::default()).unwrap();
        let mut s = a.post_xfer_req(&req, NotifUpdate::Keep);
        let t = Instant::now();
        while matches!(s, Ok(Status::InProg)) && t.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(5));
            s = a.xfer_status(&req);
        }
        match &s {
            Err(e) => assert_eq!(e.status(), Status::NotFound, "{e}"),
            Ok(other) => panic!("a READ of a deregistered VRAM region: {other:?} after {:?}", t.elapsed()),
        }
        assert!(vram.iter().all(|&b| b == 0), "a deregistered VRAM region handed out bytes");
        let t = Instant::now();
        a.release_xfer_req(&req).unwrap();
        assert!(t.elapsed() < Duration::from_secs(5), "releasing the READ took {:?}", t.elapsed());
        assert!(WARNS.lock().unwrap().iter().all(|w| !w.contains("GPU-memory self-test")), "{:?}", WARNS.lock());
    }

    // (b) shm, the fake device declaring FI_HMEM_CUDA as a real GPU would, on this CUDA-less library: the
    // rail's GPU-memory self-test fails, one WARN line, the doctor shows it, and the requests are staged.
    std::env::set_var("GIXL_TEST_FABRIC_HMEM", "cuda");
    {
        let mut p = Prefill::start(7, "shm", "cuda");
        let (a, vram, mut dram) = start("decode-hmem-cuda", "shm", &p);
        let (here, there) = exchange(&a, &mut p, 7, vram, &mut dram);
        // Staged: every byte of a VRAM side goes through its device layer (each side is VRAM in two of the three
        // combinations: 2 × (64 + 16 + 16 + 64) MiB).
        assert!(here >= 5 * SIZE as u64 && there >= 5 * SIZE as u64, "staged: {here} {there}");
        let rec = gixl::fabric::selftest::records();
        let gpu = rec.iter().find(|r| r.device == "shm/shm (GPU memory)").unwrap_or_else(|| panic!("{rec:?}"));
        assert!(!gpu.passed && gpu.step.is_some_and(|s| s.starts_with("vram-")), "{gpu:?}");
        if dmabuf {
            // The dma-buf way was tried first, failed too, and was said at INFO (the WARN is the last way's).
            let first =
                rec.iter().find(|r| r.device == "shm/shm (GPU memory, dma-buf)").unwrap_or_else(|| panic!("{rec:?}"));
            assert!(!first.passed, "{first:?}");
        }
        let warns: Vec<String> =
            WARNS.lock().unwrap().iter().filter(|w| w.contains("GPU-memory self-test")).cloned().collect();
        assert_eq!(warns.len(), 1, "{warns:?}");
        let w = &warns[0];
        assert!(w.contains("rail shm/shm") && w.contains("vram-") && w.contains("staged"), "{w}");
        let doctor = gixl::telemetry::doctor::report(None);
        assert!(doctor.contains("shm/shm (GPU memory)") && doctor.contains("vram-"), "{doctor}");
        drop(a);
    }

    // (c) tcp;ofi_rxm: no FI_HMEM, staged over TCP as before.
    {
        let mut p = Prefill::start(9, "tcp;ofi_rxm", "system");
        let (a, vram, mut dram) = start("decode-hmem-tcp", "tcp;ofi_rxm", &p);
        let (here, there) = exchange(&a, &mut p, 9, vram, &mut dram);
        // Staged: every byte of a VRAM side goes through its device layer (each side is VRAM in two of the three
        // combinations: 2 × (64 + 16 + 16 + 64) MiB).
        assert!(here >= 5 * SIZE as u64 && there >= 5 * SIZE as u64, "staged: {here} {there}");
        drop(a);
    }
}
