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
