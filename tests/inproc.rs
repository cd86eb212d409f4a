//! Two agents in one process through the public Rust API: transfers, notifications and the generation gate.

use gixl::*;

fn agent(name: &str) -> (Agent, BackendId) {
    let a = Agent::new(name, AgentConfig::default()).unwrap();
    let b = a.create_backend("UCX", &Params::new()).unwrap();
    (a, b)
}

fn reg(a: &Agent, buf: &[u8]) {
    let l = RegDList::with_descs(
        MemType::Dram,
        vec![RegDesc { desc: Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0), meta: vec![] }],
    );
    a.register_mem(&l, &[]).unwrap();
}

fn xl(buf: &[u8], off: usize, len: usize) -> XferDList {
    XferDList::with_descs(MemType::Dram, vec![Desc::new(buf.as_ptr() as u64 + off as u64, len as u64, 0)])
}

fn wait(a: &Agent, r: &XferReq) -> Result<Status> {
    loop {
        match a.xfer_status(r)? {
            Status::InProg => std::thread::yield_now(),
            s => return Ok(s),
        }
    }
}

#[test]
fn read_write_with_notifications_between_two_agents() {
    let (a, _) = agent("A");
    let (b, _) = agent("B");
    let src: Vec<u8> = (0..8 << 20).map(|i| (i % 253) as u8).collect();
    let mut dst = vec![0u8; 8 << 20];
    reg(&a, &dst);
    reg(&b, &src);
    assert_eq!(a.load_remote_md(&b.local_md().unwrap()).unwrap(), "B");
    b.load_remote_md(&a.local_md().unwrap()).unwrap();

    let opts = XferOpts { notif: Some(b"done".to_vec()), ..Default::default() };
    let r = a.create_xfer_req(XferOp::Read, &xl(&dst, 0, dst.len()), &xl(&src, 0, src.len()), "B", &opts).unwrap();
    a.post_xfer_req(&r, NotifUpdate::Keep).unwrap();
    assert_eq!(wait(&a, &r).unwrap(), Status::Success);
    assert!(dst == src);
    let n = b.notifs(&[]).unwrap();
    assert_eq!(n, vec![("A".to_string(), b"done".to_vec())]);

    // WRITE back a small piece, inline, with an empty notification.
    dst[..4].copy_from_slice(b"gixl");
    let opts = XferOpts { notif: Some(vec![]), ..Default::default() };
    let w = a.create_xfer_req(XferOp::Write, &xl(&dst, 0, 4), &xl(&src, 100, 4), "B", &opts).unwrap();
    assert_eq!(a.post_xfer_req(&w, NotifUpdate::Keep).unwrap(), Status::Success);
    assert_eq!(&src[100..104], b"gixl");
    assert_eq!(b.notifs(&[]).unwrap(), vec![("A".to_string(), vec![])]);
    a.gen_notif("B", b"hb", &[]).unwrap();
    assert_eq!(b.notifs(&[]).unwrap()[0].1, b"hb");
    drop(dst);
}

#[test]
fn stale_handles_are_refused_after_invalidate_and_reload() {
    let (a, _) = agent("A2");
    let (b, _) = agent("B2");
    let src = vec![1u8; 4096];
    let dst = vec![0u8; 4096];
    reg(&a, &dst);
    reg(&b, &src);
    a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let local = a.prep_xfer_dlist("", &xl(&dst, 0, 4096), &[]).unwrap();
    let remote = a.prep_xfer_dlist("B2", &xl(&src, 0, 4096), &[]).unwrap();
    let r = a.make_xfer_req(XferOp::Read, &local, &[0], &remote, &[0], &XferOpts::default()).unwrap();
    assert_eq!(a.post_xfer_req(&r, NotifUpdate::Keep).unwrap(), Status::Success);

    // Identical reload: idempotent, handles stay valid.
    a.load_remote_md(&b.local_md().unwrap()).unwrap();
    assert_eq!(a.post_xfer_req(&r, NotifUpdate::Keep).unwrap(), Status::Success);

    // The peer restarts under the same name: NOT_ALLOWED until invalidated.
    drop(b);
    let (b2, _) = agent("B2");
    let src2 = vec![2u8; 4096];
    reg(&b2, &src2);
    assert_eq!(a.load_remote_md(&b2.local_md().unwrap()).unwrap_err().status(), Status::NotAllowed);
    // The old incarnation's engine is gone: its handle reports the disconnect.
    assert_eq!(a.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err().status(), Status::RemoteDisconnect);

    a.invalidate_remote_md("B2").unwrap();
    assert_eq!(a.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err().status(), Status::NotFound);
    assert_eq!(a.estimate_xfer_cost(&r).unwrap_err().status(), Status::NotFound);
    a.load_remote_md(&b2.local_md().unwrap()).unwrap();
    assert_eq!(a.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err().status(), Status::NotFound);
    let err = a.make_xfer_req(XferOp::Read, &local, &[0], &remote, &[0], &XferOpts::default()).unwrap_err();
    assert_eq!(err.status(), Status::NotFound);
    assert_ne!(a.remote_incarnation("B2").unwrap(), r.remote_incarnation().unwrap());

    let remote2 = a.prep_xfer_dlist("B2", &xl(&src2, 0, 4096), &[]).unwrap();
    let r2 = a.make_xfer_req(XferOp::Read, &local, &[0], &remote2, &[0], &XferOpts::default()).unwrap();
    assert_eq!(a.post_xfer_req(&r2, NotifUpdate::Keep).unwrap(), Status::Success);
    assert_eq!(dst, src2);
}

#[test]
fn request_errors_match_nixl() {
    let (a, _) = agent("A3");
    let buf = vec![0u8; 1 << 16];
    reg(&a, &buf);
    let descs = XferDList::with_descs(
        MemType::Dram,
        (0..8).map(|i| Desc::new(buf.as_ptr() as u64 + i * 1024, 1024, 0)).collect(),
    );
    let l = a.prep_xfer_dlist("", &descs, &[]).unwrap();
    let r = a.prep_xfer_dlist("A3", &descs, &[]).unwrap();
    let o = XferOpts::default();
    let st = |e: Error| e.status();
    assert_eq!(st(a.make_xfer_req(XferOp::Read, &l, &[0, 1], &r, &[0], &o).unwrap_err()), Status::InvalidParam);
    assert_eq!(st(a.make_xfer_req(XferOp::Read, &l, &[], &r, &[], &o).unwrap_err()), Status::InvalidParam);
    assert_eq!(st(a.make_xfer_req(XferOp::Read, &l, &[-1], &r, &[0], &o).unwrap_err()), Status::InvalidParam);
    assert_eq!(st(a.make_xfer_req(XferOp::Read, &l, &[8], &r, &[0], &o).unwrap_err()), Status::InvalidParam);
    assert_eq!(st(a.make_xfer_req(XferOp::Read, &r, &[0], &l, &[0], &o).unwrap_err()), Status::InvalidParam);
    assert_eq!(st(a.prep_xfer_dlist("nobody", &descs, &[]).unwrap_err()), Status::NotFound);
    assert_eq!(st(a.prep_xfer_dlist("", &XferDList::new(MemType::Dram), &[]).unwrap_err()), Status::NotFound);
    let outside = XferDList::with_descs(MemType::Dram, vec![Desc::new(buf.as_ptr() as u64 + 65000, 1024, 0)]);
    assert_eq!(st(a.prep_xfer_dlist("", &outside, &[]).unwrap_err()), Status::NotFound);

    // Contiguous indices merge into one piece; skip_desc_merge keeps them apart.
    let x = a.make_xfer_req(XferOp::Write, &l, &[0, 1, 2, 3], &r, &[4, 5, 6, 7], &o).unwrap();
    assert_eq!(x.desc_count(), 1);
    let x2 = a
        .make_xfer_req(XferOp::Write, &l, &[0, 1], &r, &[4, 5], &XferOpts { skip_desc_merge: true, ..o.clone() })
        .unwrap();
    assert_eq!(x2.desc_count(), 2);
    assert_eq!(st(a.xfer_status(&x).unwrap_err()), Status::NotPosted);
    assert_eq!(a.post_xfer_req(&x, NotifUpdate::Keep).unwrap(), Status::Success);
    assert_eq!(a.xfer_status(&x).unwrap(), Status::Success);
    a.release_xfer_req(&x).unwrap();
    assert_eq!(st(a.post_xfer_req(&x, NotifUpdate::Keep).unwrap_err()), Status::InvalidParam);

    // Garbage and own metadata.
    assert_eq!(st(a.load_remote_md(b"garbage").unwrap_err()), Status::Mismatch);
    assert_eq!(st(a.load_remote_md(&a.local_md().unwrap()).unwrap_err()), Status::InvalidParam);
    assert_eq!(st(a.invalidate_remote_md("A3").unwrap_err()), Status::InvalidParam);
    assert_eq!(st(a.invalidate_remote_md("zzz").unwrap_err()), Status::NotFound);
    assert_eq!(st(a.create_backend("UCX", &Params::new()).unwrap_err()), Status::InvalidParam);
    assert_eq!(st(a.create_backend("NOPE", &Params::new()).unwrap_err()), Status::NotFound);
}

// ----- exact to the incarnation (issue #10): in-process route -----

/// Metadata of `victim` rewritten by an attacker: another name, the victim's incarnation and connection info
/// (so the route is "in process, to the victim"), and `regions` claimed with the public bytes given.
fn forged(victim: &Agent, name: &str, incarnation: Option<u128>, regions: Vec<(Desc, Vec<u8>)>) -> Vec<u8> {
    let mut md = gixl::md::AgentMd::decode(&victim.local_md().unwrap()).unwrap();
    md.name = name.to_owned();
    if let Some(i) = incarnation {
        md.incarnation = i;
    }
    md.sections[0].regions = regions;
    md.encode()
}

#[test]
fn forged_metadata_routes_nothing_into_unregistered_memory() {
    let (v, _) = agent("fv-victim");
    let (d, _) = agent("fv-decode");
    // The victim registers one page of a 16 KiB buffer; the rest is memory it never registered.
    let secret = vec![0x77u8; 16384];
    let base = secret.as_ptr() as u64;
    reg(&v, &secret[4096..8192]);
    let real = gixl::md::AgentMd::decode(&v.local_md().unwrap()).unwrap();
    let ticket = real.sections[0].regions[0].1.clone();
    let src = vec![0xEEu8; 16384];
    reg(&d, &src);
    let whole = Desc::new(base, 16384, 0);
    let post = |name: &str, md: Vec<u8>, off: u64, len: u64| -> Result<Status> {
        d.load_remote_md(&md)?;
        let local = XferDList::with_descs(MemType::Dram, vec![Desc::new(src.as_ptr() as u64, len, 0)]);
        let remote = XferDList::with_descs(MemType::Dram, vec![Desc::new(base + off, len, 0)]);
        let r = d.create_xfer_req(XferOp::Write, &local, &remote, name, &XferOpts::default())?;
        d.post_xfer_req(&r, NotifUpdate::Keep)?;
        wait(&d, &r)
    };
    // The victim's real ticket stretched over the whole buffer.
    let e = post("fv-1", forged(&v, "fv-1", None, vec![(whole, ticket.clone())]), 0, 16384).unwrap_err();
    assert_eq!(e.status(), Status::Backend, "{e}");
    // A made-up slot and state.
    let e = post("fv-2", forged(&v, "fv-2", None, vec![(whole, vec![5, 3])]), 0, 16384).unwrap_err();
    assert_eq!(e.status(), Status::Backend, "{e}");
    // Connection info of this very process but an incarnation no engine here has: not routed at all.
    let e = post("fv-3", forged(&v, "fv-3", Some(42), vec![(whole, ticket.clone())]), 0, 16384).unwrap_err();
    assert_eq!(e.status(), Status::RemoteDisconnect, "{e}");
    assert!(secret.iter().all(|&b| b == 0x77), "unregistered memory was written");
    // Control: inside the registration, the same forged route reaches it (it is the victim's registered memory).
    let inside = Desc::new(base + 4096, 4096, 0);
    assert_eq!(post("fv-4", forged(&v, "fv-4", None, vec![(inside, ticket)]), 4096, 4096).unwrap(), Status::Success);
    assert!(secret[4096..8192].iter().all(|&b| b == 0xEE));
    assert!(secret[..4096].iter().chain(&secret[8192..]).all(|&b| b == 0x77));
}

#[test]
fn agent_recreated_in_process_at_the_same_address_is_not_written() {
    let (d, _) = agent("rc-decode");
    let src = vec![0x5Au8; 1 << 20];
    reg(&d, &src);
    let dst = vec![0u8; 1 << 20];
    let (p, _) = agent("rc-prefill");
    reg(&p, &dst);
    d.load_remote_md(&p.local_md().unwrap()).unwrap();
    let local = d.prep_xfer_dlist("", &xl(&src, 0, 1 << 20), &[]).unwrap();
    let remote = d.prep_xfer_dlist("rc-prefill", &xl(&dst, 0, 1 << 20), &[]).unwrap();
    let r = d.make_xfer_req(XferOp::Write, &local, &[0], &remote, &[0], &XferOpts::default()).unwrap();
    assert_eq!(d.post_xfer_req(&r, NotifUpdate::Keep).unwrap(), Status::Success);
    // Destroyed and created again under the same name, the same buffer registered again.
    drop(p);
    let dst = {
        let mut b = dst;
        b.fill(0x22);
        b
    };
    let (p2, _) = agent("rc-prefill");
    reg(&p2, &dst);
    assert_eq!(d.post_xfer_req(&r, NotifUpdate::Keep).unwrap_err().status(), Status::RemoteDisconnect);
    let e = d.make_xfer_req(XferOp::Write, &local, &[0], &remote, &[0], &XferOpts::default());
    if let Ok(r2) = e {
        assert_eq!(d.post_xfer_req(&r2, NotifUpdate::Keep).unwrap_err().status(), Status::RemoteDisconnect);
    }
    assert!(dst.iter().all(|&b| b == 0x22), "the new agent's buffer was written through an old handle");
}

#[test]
fn deregistration_waits_for_in_process_copies() {
    const SIZE: usize = 256 << 20;
    let (d, _) = agent("dr-decode");
    let (p, _) = agent("dr-prefill");
    let src = vec![0x5Au8; SIZE];
    reg(&d, &src);
    let dst = vec![0u8; SIZE];
    let l = RegDList::with_descs(
        MemType::Dram,
        vec![RegDesc { desc: Desc::new(dst.as_ptr() as u64, SIZE as u64, 0), meta: vec![] }],
    );
    p.register_mem(&l, &[]).unwrap();
    d.load_remote_md(&p.local_md().unwrap()).unwrap();
    let r =
        d.create_xfer_req(XferOp::Write, &xl(&src, 0, SIZE), &xl(&dst, 0, SIZE), "dr-prefill", &XferOpts::default());
    let r = r.unwrap();
    let addr = dst.as_ptr() as usize;
    let watcher = std::thread::spawn(move || {
        // Deregister as soon as the write is under way, then overwrite everything with a sentinel.
        let probe = (addr + SIZE / 2 + (8 << 20)) as *const u8;
        // SAFETY: `dst` outlives this thread (joined below); volatile: another thread writes it.
        while unsafe { std::ptr::read_volatile(probe) } == 0 {
            std::hint::spin_loop();
        }
        p.deregister_mem(&l, &[]).unwrap();
        // SAFETY: as above; after deregistration only this thread writes the buffer.
        unsafe { std::ptr::write_bytes(addr as *mut u8, 0xEE, SIZE) };
        p
    });
    let st = match d.post_xfer_req(&r, NotifUpdate::Keep) {
        Ok(Status::InProg) => wait(&d, &r),
        other => other,
    };
    let _p = watcher.join().unwrap();
    assert!(matches!(st, Ok(Status::Success)) || st.as_ref().unwrap_err().status() == Status::Backend, "{st:?}");
    let landed = dst.iter().filter(|&&b| b != 0xEE).count();
    assert_eq!(landed, 0, "{landed} bytes landed after deregister_mem returned ({st:?})");
}
