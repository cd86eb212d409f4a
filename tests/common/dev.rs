//! Helpers of the device-memory tests (`tests/vram.rs`, `tests/vram_tcp.rs`): (fake) device memory seen as a
//! slice, one-descriptor lists, posting a request until it leaves IN_PROG, and the peer child process.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command};
use std::time::{Duration, Instant};

use gixl::*;

/// The `len` bytes at `p`: a test allocation (fake VRAM lives in host memory) that lives until the process
/// exits.
pub fn slice(p: u64, len: usize) -> &'static mut [u8] {
    // SAFETY: test allocations of at least `len` bytes that live until the process exits.
    unsafe { std::slice::from_raw_parts_mut(p as usize as *mut u8, len) }
}

/// Register the one region `addr..addr+len` of `mem` on device `dev` with `a`.
pub fn reg(a: &Agent, mem: MemType, addr: u64, len: usize, dev: u64) {
    let l = RegDList::with_descs(mem, vec![RegDesc { desc: Desc::new(addr, len as u64, dev), meta: vec![] }]);
    a.register_mem(&l, &[]).unwrap();
}

/// A transfer list of one descriptor.
pub fn one(mem: MemType, addr: u64, len: usize, dev: u64) -> XferDList {
    XferDList::with_descs(mem, vec![Desc::new(addr, len as u64, dev)])
}

/// Poll `r` until it leaves IN_PROG or `limit` has passed (then IN_PROG is returned).
pub fn wait(a: &Agent, r: &XferReq, limit: Duration) -> Result<Status> {
    let t = Instant::now();
    loop {
        match a.xfer_status(r) {
            Ok(Status::InProg) if t.elapsed() < limit => std::thread::sleep(Duration::from_micros(100)),
            other => return other,
        }
    }
}

/// Post `r` and wait for it, up to 60 s.
pub fn run(a: &Agent, r: &XferReq) -> Result<Status> {
    match a.post_xfer_req(r, NotifUpdate::Keep)? {
        Status::InProg => wait(a, r, Duration::from_secs(60)),
        s => Ok(s),
    }
}

/// An agent of this process on the fake device layer, with the UCX backend made with `params`.
pub fn agent(name: &str, params: &Params) -> Agent {
    assert!(gixl::device::select_fake());
    let a = Agent::new(name, AgentConfig::default()).unwrap();
    a.create_backend("UCX", params).unwrap();
    a
}

/// A peer process (this test binary re-run) holding device memory, driven a command per line on its stdin.
/// It begins with `@md <hex metadata> <vram> <dram> <identity>...`: the identity of each of its VRAM chunks.
pub struct Peer {
    pub child: Child,
    pub stdin: ChildStdin,
    pub stdout: BufReader<ChildStdout>,
    pub md: Vec<u8>,
    pub vram: u64,
    pub dram: u64,
    pub inos: Vec<u64>,
}

impl Peer {
    pub fn spawn(c: Command) -> Peer {
        let (child, stdin, stdout, rest) = super::spawn_until_md(c);
        let mut p = Peer { child, stdin, stdout, md: Vec::new(), vram: 0, dram: 0, inos: Vec::new() };
        p.set_md(&rest);
        p
    }

    /// Take the fields of an `@md` line (what follows `@md `).
    pub fn set_md(&mut self, rest: &str) {
        let f: Vec<&str> = rest.split(' ').collect();
        (self.md, self.vram, self.dram) = (super::unhex(f[0]), f[1].parse().unwrap(), f[2].parse().unwrap());
        self.inos = f[3..].iter().map(|x| x.parse().unwrap()).collect();
    }

    /// The identity of its (first) VRAM allocation.
    pub fn ino(&self) -> u64 {
        self.inos[0]
    }

    pub fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        let mut l = String::new();
        assert!(self.stdout.read_line(&mut l).unwrap() > 0, "the peer exited");
        l.trim().to_owned()
    }

    /// The two numbers after the word of the reply to `cmd` (`<word> <a> <b>`).
    pub fn ask_pair(&mut self, cmd: &str) -> (u64, u64) {
        let l = self.ask(cmd);
        let f: Vec<&str> = l.split(' ').collect();
        (f[1].parse().unwrap(), f[2].parse().unwrap())
    }

    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}
