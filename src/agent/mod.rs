//! The agent: configuration, backends, local registrations, the remote table and notifications.
//!
//! Transfers (prepped descriptor lists and requests, with the generation gate) live in `xfer`.
//! The agent keeps all bookkeeping itself and is safe to call from any thread whatever `sync_mode` says:
//! tables are behind `parking_lot` locks, and the transfer fast path takes none of them.
//! It does not open sockets or spawn threads itself; backends and the metadata exchange (`crate::mdx`) do.

#[cfg(test)]
mod harness;
mod overlap;
mod section;
mod xfer;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::{Mutex, RwLock};

use crate::backend::{self, Backend, BackendInit, Caps, Params, Peer, RegionKey, Target};
use crate::md::{AgentMd, SectionMd};
use crate::mdx::{Host, Mdx};
use crate::mem::{Desc, MemType, RegDList, XferDList};
use crate::status::{Error, Result, Status};
use section::Section;

pub use xfer::{NotifUpdate, PlanIndex, PrepFail, PreppedDList, XferOpts, XferReq, XferTelemetry};

/// `nixl_thread_sync_t`. gixl is thread-safe in every mode; the value is kept for callers that read it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SyncMode {
    #[default]
    None = 0,
    Strict = 1,
    Rw = 2,
}

impl SyncMode {
    pub fn from_u32(v: u32) -> Result<SyncMode> {
        match v {
            0 => Ok(SyncMode::None),
            1 => Ok(SyncMode::Strict),
            2 => Ok(SyncMode::Rw),
            _ => Err(Error::invalid_param(format!("unknown thread sync mode {v}"))),
        }
    }
}

/// `nixlAgentConfig`, plus gixl's own switches.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub prog_thread: bool,
    pub listen_thread: bool,
    pub listen_port: u16,
    pub sync_mode: SyncMode,
    /// Worker threads for large copies; 0 lets the backend choose.
    pub num_workers: u32,
    pub pthr_delay_us: u64,
    pub lthr_delay_us: u64,
    pub capture_telemetry: bool,
    /// NIXL 1.4 behaviour: a peer found disconnected is invalidated at once, so its restarted incarnation can
    /// be loaded without calling `invalidate_remote_md` first. Off by default (NIXL 1.5). Also switched on by
    /// the environment variable `GIXL_INVALIDATE_ON_DISCONNECT=1`.
    pub invalidate_on_disconnect: bool,
    /// The overlap check (see `crate::overlap`): off (default), `Warn` or `Refuse`. The environment variable
    /// `GIXL_CHECK_OVERLAP=off|warn|refuse`, when set, overrides it.
    pub check_overlap: crate::overlap::Mode,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            prog_thread: false,
            listen_thread: false,
            listen_port: crate::DEFAULT_COMM_PORT,
            sync_mode: SyncMode::None,
            num_workers: 0,
            pthr_delay_us: 0,
            lthr_delay_us: 100_000,
            capture_telemetry: false,
            invalidate_on_disconnect: false,
            check_overlap: crate::overlap::Mode::Off,
        }
    }
}

/// Index of a backend in its agent, in creation order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendId(pub u32);

pub(crate) struct BackendSlot {
    pub id: BackendId,
    pub name: &'static str,
    pub caps: Caps,
    /// The init parameters it was created with; `backend_params` reports them, as NIXL does.
    pub params: Params,
    pub be: Arc<dyn Backend>,
}

pub(crate) struct LocalEntry {
    pub public: Vec<u8>,
    pub key: Option<RegionKey>,
}

pub(crate) struct RemoteEntry {
    pub public: Vec<u8>,
    pub key: Option<RegionKey>,
}

/// One incarnation of a peer as loaded from its metadata. Handles built against it hold it by `Arc`, so
/// nothing it owns is freed while they live; `invalidated` is what the generation gate reads.
pub(crate) struct RemoteAgent {
    pub name: String,
    pub incarnation: u128,
    pub invalidated: AtomicBool,
    pub conns: Vec<(String, Vec<u8>)>,
    pub peers: Vec<(BackendId, Arc<dyn Peer>)>,
    pub sections: RwLock<HashMap<(BackendId, MemType), Section<RemoteEntry>>>,
}

impl RemoteAgent {
    pub fn peer(&self, id: BackendId) -> Option<&Arc<dyn Peer>> {
        self.peers.iter().find(|(b, _)| *b == id).map(|(_, p)| p)
    }

    /// How telemetry and `gixl doctor` show this peer: its first backend's route.
    pub fn telemetry_row(&self) -> crate::telemetry::PeerRow {
        let p = self.peers.first().map(|(_, p)| p);
        crate::telemetry::PeerRow {
            name: self.name.clone(),
            incarnation: self.incarnation,
            route: p.map_or("", |p| p.route()).to_owned(),
            connected: !p.is_some_and(|p| p.disconnected()),
        }
    }
}

pub struct Agent {
    pub(crate) inner: Arc<Inner>,
    /// The metadata exchange threads. None in the views those threads use to call back into the agent,
    /// which is also how `Drop` tells a view from the agent itself.
    mdx: Option<Arc<Mdx>>,
}

pub(crate) struct Inner {
    pub name: String,
    pub incarnation: u128,
    pub cfg: AgentConfig,
    pub telemetry: bool,
    /// Telemetry sinks (NIXL's environment) and this agent's entry for `gixl doctor`.
    pub tele: Arc<crate::telemetry::Telemetry>,
    pub backends: RwLock<Vec<Arc<BackendSlot>>>,
    pub regs: RwLock<HashMap<(BackendId, MemType), Section<LocalEntry>>>,
    pub remotes: RwLock<HashMap<String, Arc<RemoteAgent>>>,
    pub closing: AtomicBool,
    /// The overlap check, while it is on.
    pub(crate) overlap: Option<Arc<overlap::Checker>>,
    /// Conflicts it has seen (also those of this agent's TCP target), for telemetry.
    pub overlaps: Arc<crate::overlap::Counts>,
}

impl Agent {
    pub fn new(name: &str, cfg: AgentConfig) -> Result<Agent> {
        if name.is_empty() {
            return Err(Error::invalid_param("agent name must not be empty"));
        }
        // A cluster key that is configured but unusable must not leave the agent unauthenticated.
        crate::auth::check_configured()?;
        let mut cfg = cfg;
        if env_flag("GIXL_INVALIDATE_ON_DISCONNECT") == Some(true) {
            cfg.invalidate_on_disconnect = true;
        }
        if let Some(mode) = crate::overlap::Mode::from_env()? {
            cfg.check_overlap = mode;
        }
        let telemetry = match crate::config::flag("NIXL_TELEMETRY_ENABLE")? {
            Some(on) => on,
            None => cfg.capture_telemetry,
        };
        let listen = cfg.listen_thread.then_some(cfg.listen_port);
        let incarnation = crate::util::random_u128();
        let tele = crate::telemetry::Telemetry::new(name, incarnation, telemetry)?;
        let overlaps = Arc::new(crate::overlap::Counts::default());
        let overlap = (cfg.check_overlap != crate::overlap::Mode::Off)
            .then(|| Arc::new(overlap::Checker::new(cfg.check_overlap, incarnation, overlaps.clone())));
        if overlap.is_some() {
            tele.set_overlap_source(overlaps.clone());
        }
        let inner = Arc::new(Inner {
            name: name.to_owned(),
            incarnation,
            tele,
            cfg,
            telemetry,
            backends: RwLock::new(Vec::new()),
            regs: RwLock::new(HashMap::new()),
            remotes: RwLock::new(HashMap::new()),
            closing: AtomicBool::new(false),
            overlap,
            overlaps,
        });
        let weak = Arc::downgrade(&inner);
        inner.tele.set_peer_source(Arc::new(move || {
            let Some(inner) = weak.upgrade() else { return Vec::new() };
            let remotes: Vec<Arc<RemoteAgent>> = inner.remotes.read().values().cloned().collect();
            remotes.iter().map(|ra| ra.telemetry_row()).collect()
        }));
        let host =
            Arc::new(AgentHost { inner: Arc::downgrade(&inner), name: name.to_owned(), pushed: Mutex::default() });
        let mdx = Mdx::new(host, listen)?;
        Ok(Agent { inner, mdx: Some(Arc::new(mdx)) })
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Random 128-bit id of this agent's life; a restarted agent with the same name gets a new one.
    pub fn incarnation(&self) -> u128 {
        self.inner.incarnation
    }

    pub fn config(&self) -> &AgentConfig {
        &self.inner.cfg
    }

    pub fn telemetry_enabled(&self) -> bool {
        self.inner.telemetry
    }

    /// Conflicts the overlap check has seen: (by this agent's posts, by its TCP target among the pieces of
    /// different initiators). Both stay 0 while the check is off.
    pub fn overlap_counts(&self) -> (u64, u64) {
        self.inner.overlaps.get()
    }

    // ----- plugins and backends -----

    pub fn available_plugins(&self) -> Vec<String> {
        backend::plugins().iter().map(|p| p.name.to_owned()).collect()
    }

    pub fn plugin_params(&self, plugin: &str) -> Result<(Params, Vec<MemType>)> {
        let p = backend::plugin(plugin)?;
        Ok(((p.defaults)(), p.mems.to_vec()))
    }

    pub fn create_backend(&self, plugin: &str, params: &Params) -> Result<BackendId> {
        let p = backend::plugin(plugin)?;
        let mut backends = self.inner.backends.write();
        if backends.iter().any(|b| b.name == p.name) {
            return Err(Error::invalid_param(format!(
                "backend {plugin} already exists in agent '{}'",
                self.inner.name
            )));
        }
        let be = (p.create)(BackendInit {
            agent_name: self.inner.name.clone(),
            incarnation: self.inner.incarnation,
            params: params.clone(),
            num_workers: self.inner.cfg.num_workers,
            overlap: self.inner.overlap.as_ref().map(|_| self.inner.overlaps.clone()),
        })?;
        let caps = be.caps();
        if caps.remote && !caps.notif {
            return Err(Error::backend(format!("backend {plugin} is remote-capable but has no notifications")));
        }
        let id = BackendId(backends.len() as u32);
        backends.push(Arc::new(BackendSlot { id, name: p.name, caps, params: params.clone(), be }));
        Ok(id)
    }

    pub fn backend_params(&self, id: BackendId) -> Result<(Params, Vec<MemType>)> {
        let slot = self.slot(id)?;
        Ok((slot.params.clone(), slot.caps.mems.clone()))
    }

    pub fn backend_name(&self, id: BackendId) -> Result<&'static str> {
        Ok(self.slot(id)?.name)
    }

    /// The backends in creation order.
    pub fn backends(&self) -> Vec<(BackendId, &'static str)> {
        self.inner.backends.read().iter().map(|b| (b.id, b.name)).collect()
    }

    pub(crate) fn slot(&self, id: BackendId) -> Result<Arc<BackendSlot>> {
        self.inner
            .backends
            .read()
            .get(id.0 as usize)
            .cloned()
            .ok_or_else(|| Error::invalid_param(format!("backend handle {} does not belong to this agent", id.0)))
    }

    /// Backends in creation order, restricted to `hints` when given, that pass `keep`.
    pub(crate) fn chosen(
        &self,
        hints: &[BackendId],
        keep: impl Fn(&BackendSlot) -> bool,
    ) -> Result<Vec<Arc<BackendSlot>>> {
        let all = self.inner.backends.read();
        for h in hints {
            if all.get(h.0 as usize).is_none() {
                return Err(Error::invalid_param(format!("backend handle {} does not belong to this agent", h.0)));
            }
        }
        Ok(all.iter().filter(|b| (hints.is_empty() || hints.contains(&b.id)) && keep(b)).cloned().collect())
    }

    // ----- registration -----

    pub fn register_mem(&self, descs: &RegDList, hints: &[BackendId]) -> Result<()> {
        let mem = descs.mem_type();
        let chosen = self.chosen(hints, |b| b.caps.mems.contains(&mem))?;
        if chosen.is_empty() {
            return Err(Error::not_found(format!("no backend supports {}", mem.seg_name())));
        }
        if descs.is_empty() {
            return Err(Error::backend("nothing to register: the descriptor list is empty"));
        }
        for d in descs.iter() {
            check_reg_desc(mem, &d.desc)?;
        }
        let mut done: Vec<(BackendId, Desc, LocalEntry)> = Vec::new();
        for d in descs.iter() {
            let mut accepted = false;
            let mut last_err = None;
            for b in &chosen {
                match b.be.register(mem, d) {
                    Ok(r) => {
                        accepted = true;
                        done.push((b.id, d.desc, LocalEntry { public: r.public, key: r.key }));
                    }
                    Err(e) => last_err = Some(e),
                }
            }
            if !accepted {
                for (id, desc, e) in done {
                    if let Ok(slot) = self.slot(id) {
                        slot.be.deregister(mem, &desc, e.key.as_ref());
                    }
                }
                // NOT_SUPPORTED (e.g. VRAM in a build or on a machine without GPU support) is passed on as
                // such; any other refusal is BACKEND.
                let status = match &last_err {
                    Some(e) if e.status() == Status::NotSupported => Status::NotSupported,
                    _ => Status::Backend,
                };
                let why = last_err.map(|e| e.to_string()).unwrap_or_default();
                return Err(Error::new(status, format!("no backend accepted {:?}: {why}", d.desc)));
            }
        }
        // One sorted merge per table, whatever order the regions came in.
        let mut by_backend: HashMap<BackendId, Vec<(Desc, LocalEntry)>> = HashMap::new();
        for (id, desc, e) in done {
            by_backend.entry(id).or_default().push((desc, e));
        }
        let mut regs = self.inner.regs.write();
        for (id, new) in by_backend {
            regs.entry((id, mem)).or_insert_with(|| Section::new(mem)).extend(new);
        }
        drop(regs);
        self.inner.tele.registered(descs.iter().map(|d| d.desc.len).sum());
        Ok(())
    }

    /// Each descriptor must match a registration exactly (address, length, device); nothing is removed
    /// unless all of them do.
    pub fn deregister_mem(&self, descs: &RegDList, hints: &[BackendId]) -> Result<()> {
        let mem = descs.mem_type();
        let chosen = self.chosen(hints, |b| b.caps.mems.contains(&mem))?;
        if chosen.is_empty() {
            return Err(Error::not_found(format!("no backend supports {}", mem.seg_name())));
        }
        let mut regs = self.inner.regs.write();
        for d in descs.iter() {
            let found = chosen.iter().any(|b| regs.get(&(b.id, mem)).is_some_and(|s| s.find_exact(&d.desc).is_some()));
            if !found {
                return Err(Error::not_found(format!("{:?} is not registered", d.desc)));
            }
        }
        let mut retired = Vec::new();
        for b in &chosen {
            if let Some(s) = regs.get_mut(&(b.id, mem)) {
                let gone: Vec<_> =
                    s.remove_exact_many(descs.iter().map(|d| &d.desc)).into_iter().map(|(d, e)| (d, e.key)).collect();
                retired.push((b, gone));
            }
        }
        drop(regs);
        // The backends wait (bounded) for transfers still using these regions: not under the table's lock, so
        // that this agent's other requests, registrations and metadata go on meanwhile. The regions are out of
        // the table already: nothing new can be prepared on them.
        for (b, gone) in retired {
            b.be.deregister_many(mem, &gone);
        }
        self.inner.tele.deregistered(descs.iter().map(|d| d.desc.len).sum());
        Ok(())
    }

    pub fn query_mem(&self, descs: &RegDList, backend: BackendId) -> Result<Vec<Option<Params>>> {
        self.slot(backend)?.be.query_mem(descs)
    }

    // ----- metadata -----

    /// Full metadata: connection info of every remote-capable backend and all their registrations.
    pub fn local_md(&self) -> Result<Vec<u8>> {
        let remote = self.chosen(&[], |b| b.caps.remote)?;
        if remote.is_empty() {
            return Err(Error::invalid_param("no remote-capable backend: nothing to put in metadata"));
        }
        let regs = self.inner.regs.read();
        let mut sections = Vec::new();
        for b in &remote {
            for mem in &b.caps.mems {
                if let Some(s) = regs.get(&(b.id, *mem)).filter(|s| !s.is_empty()) {
                    let regions = s.iter().map(|(d, e)| (*d, e.public.clone())).collect();
                    sections.push(SectionMd { backend: b.name.to_owned(), mem: *mem, regions });
                }
            }
        }
        Ok(self.md(false, true, &remote, sections).seal(crate::auth::cluster()))
    }

    /// Metadata for some registered descriptors only (each must match a registration exactly),
    /// with or without connection info. As in NIXL, an empty list always carries the connection info
    /// (whatever `include_conn` says): it is how a peer is told how to connect before any region.
    pub fn local_partial_md(&self, descs: &RegDList, include_conn: bool, hints: &[BackendId]) -> Result<Vec<u8>> {
        let mem = descs.mem_type();
        let remote = self.chosen(hints, |b| b.caps.remote)?;
        if remote.is_empty() {
            return Err(Error::invalid_param("no remote-capable backend: nothing to put in metadata"));
        }
        let regs = self.inner.regs.read();
        let mut sections = Vec::new();
        for d in descs.iter() {
            if !remote.iter().any(|b| regs.get(&(b.id, mem)).is_some_and(|s| s.find_exact(&d.desc).is_some())) {
                return Err(Error::not_found(format!("{:?} is not registered with a remote-capable backend", d.desc)));
            }
        }
        for b in &remote {
            let Some(s) = regs.get(&(b.id, mem)) else { continue };
            let regions: Vec<_> = descs
                .iter()
                .filter_map(|d| s.find_exact(&d.desc).map(|i| (d.desc, s.get(i).1.public.clone())))
                .collect();
            if !regions.is_empty() {
                sections.push(SectionMd { backend: b.name.to_owned(), mem, regions });
            }
        }
        Ok(self.md(true, include_conn || descs.is_empty(), &remote, sections).seal(crate::auth::cluster()))
    }

    fn md(&self, partial: bool, include_conn: bool, remote: &[Arc<BackendSlot>], sections: Vec<SectionMd>) -> AgentMd {
        let conns = if include_conn {
            remote.iter().map(|b| (b.name.to_owned(), b.be.conn_info())).collect()
        } else {
            Vec::new()
        };
        AgentMd { name: self.inner.name.clone(), incarnation: self.inner.incarnation, partial, conns, sections }
    }

    /// Load a peer's metadata and return its name. Loading the same incarnation again merges new regions
    /// and keeps every handle valid; another incarnation under a loaded name is NOT_ALLOWED until the old
    /// one is invalidated.
    pub fn load_remote_md(&self, blob: &[u8]) -> Result<String> {
        self.load_md(blob, None)
    }

    /// `load_remote_md`, refused (NOT_ALLOWED, nothing changed) when the peer would then have more than
    /// `region_cap` regions here: what metadata pushed to the listener by anyone may add.
    fn load_md(&self, blob: &[u8], region_cap: Option<usize>) -> Result<String> {
        let mut md = AgentMd::open_within(blob, crate::auth::cluster(), region_cap.unwrap_or(usize::MAX))?;
        if md.name == self.inner.name {
            return Err(Error::invalid_param("cannot load this agent's own metadata"));
        }
        let backends: Vec<Arc<BackendSlot>> = self.inner.backends.read().clone();
        let by_name = |n: &str| backends.iter().find(|b| b.name == n && b.caps.remote).cloned();

        // A peer not loaded yet is connected to (sockets, pidfds: I/O that may wait) before the table is
        // locked, so a slow or hostile peer never holds up calls about other peers.
        let fresh = if self.inner.remotes.read().contains_key(&md.name) {
            None
        } else {
            if md.conns.is_empty() {
                return Err(Error::not_found(format!(
                    "agent '{}' is not loaded and its metadata has no connection info",
                    md.name
                )));
            }
            let mut peers = Vec::new();
            let mut last_err = None;
            for (bname, info) in &md.conns {
                let Some(b) = by_name(bname) else { continue };
                match b.be.load_peer(&md.name, md.incarnation, info) {
                    Ok(p) => peers.push((b.id, p)),
                    Err(e) => last_err = Some(e),
                }
            }
            if peers.is_empty() {
                return Err(last_err
                    .unwrap_or_else(|| Error::backend(format!("no backend in common with agent '{}'", md.name))));
            }
            Some(Arc::new(RemoteAgent {
                name: md.name.clone(),
                incarnation: md.incarnation,
                invalidated: AtomicBool::new(false),
                conns: md.conns.clone(),
                peers,
                sections: RwLock::new(HashMap::new()),
            }))
        };

        let mut remotes = self.inner.remotes.write();
        let existing = remotes.get(&md.name).cloned();
        let ra = match (existing, fresh) {
            (Some(ra), _) if ra.incarnation != md.incarnation => {
                return Err(Error::not_allowed(format!(
                    "agent '{}' is loaded with incarnation {:032x}; metadata is for {:032x} (a restarted peer): invalidate it first",
                    md.name, ra.incarnation, md.incarnation
                )));
            }
            // Loaded already (possibly by another thread while this one connected: its connection wins).
            (Some(ra), _) => {
                if !md.conns.is_empty() && md.conns != ra.conns {
                    return Err(Error::not_allowed(format!(
                        "agent '{}' sent different connection info for the same incarnation",
                        md.name
                    )));
                }
                ra
            }
            (None, Some(fresh)) => fresh,
            (None, None) => {
                return Err(Error::not_found(format!(
                    "agent '{}' was removed while its metadata was being loaded; load it again",
                    md.name
                )))
            }
        };

        // Resolve every region before changing anything, so a bad section leaves the cache as it was. Grouped
        // per table as they come, each region's bytes moved, not copied, out of the decoded metadata.
        let mut by_table: HashMap<(BackendId, MemType), Vec<(Desc, RemoteEntry)>> = HashMap::new();
        let mut nadds = 0usize;
        {
            let sections = ra.sections.read();
            for s in std::mem::take(&mut md.sections) {
                let Some(b) = by_name(&s.backend) else { continue };
                let Some(peer) = ra.peer(b.id) else { continue };
                if s.regions.is_empty() {
                    return Err(Error::not_found(format!(
                        "agent '{}' sent an empty {} section",
                        md.name,
                        s.mem.seg_name()
                    )));
                }
                let cur = sections.get(&(b.id, s.mem));
                let adds = by_table.entry((b.id, s.mem)).or_default();
                adds.reserve(s.regions.len());
                for (d, public) in s.regions {
                    if let Some(i) = cur.and_then(|c| c.find_exact(&d)) {
                        if cur.map(|c| &c.get(i).1.public) != Some(&public) {
                            return Err(Error::not_allowed(format!(
                                "agent '{}' changed the access data of region {d:?}",
                                md.name
                            )));
                        }
                        continue;
                    }
                    let key = b.be.load_remote_region(peer, s.mem, &d, &public)?;
                    adds.push((d, RemoteEntry { public, key }));
                    nadds += 1;
                }
            }
        }
        if let Some(cap) = region_cap {
            let have: usize = ra.sections.read().values().map(|s| s.len()).sum();
            if have + nadds > cap {
                return Err(Error::not_allowed(format!(
                    "agent '{}' would have {} regions here, past the {cap} that metadata pushed to the listener may \
                     bring (GIXL_MAX_PUSHED_REGIONS per agent, GIXL_MAX_PUSHED_REGIONS_TOTAL for all of them); load \
                     it with load_remote_md / fetch_remote_md instead",
                    md.name,
                    have + nadds
                )));
            }
        }
        if nadds > 0 {
            // Inserted with one sort per table: O(n log n) under the lock, in any order.
            let mut sections = ra.sections.write();
            for (k, v) in by_table.into_iter().filter(|(_, v)| !v.is_empty()) {
                sections.entry(k).or_insert_with(|| Section::new(k.1)).extend(v);
            }
        }
        remotes.entry(md.name.clone()).or_insert(ra);
        Ok(md.name)
    }

    /// Forget a peer. Handles built against it stay allocated but are refused from now on (NOT_FOUND).
    pub fn invalidate_remote_md(&self, name: &str) -> Result<()> {
        if name == self.inner.name {
            return Err(Error::invalid_param("cannot invalidate this agent's own metadata"));
        }
        let ra = self
            .inner
            .remotes
            .write()
            .remove(name)
            .ok_or_else(|| Error::not_found(format!("agent '{name}' is not loaded")))?;
        self.retire(&ra);
        if let Some(m) = &self.mdx {
            m.forget(name);
        }
        Ok(())
    }

    fn retire(&self, ra: &RemoteAgent) {
        ra.invalidated.store(true, Ordering::Release);
        for (id, peer) in &ra.peers {
            if let Ok(slot) = self.slot(*id) {
                slot.be.disconnect(peer);
            }
        }
    }

    /// NIXL 1.4 mode: drop `ra` from the table if it is still the loaded incarnation.
    pub(crate) fn on_disconnect(&self, ra: &Arc<RemoteAgent>) {
        self.inner.tele.disconnect(&ra.name, ra.incarnation);
        if !self.inner.cfg.invalidate_on_disconnect {
            return;
        }
        let mut remotes = self.inner.remotes.write();
        if remotes.get(&ra.name).is_some_and(|cur| Arc::ptr_eq(cur, ra)) {
            remotes.remove(&ra.name);
            drop(remotes);
            self.retire(ra);
        }
    }

    /// Ok if `name` is loaded and (when `descs` is not empty) one backend covers every descriptor.
    pub fn check_remote_md(&self, name: &str, descs: &XferDList) -> Result<()> {
        if name == self.inner.name {
            // NIXL keeps a "self" section once a local-capable backend holds registrations: it answers for the
            // name itself, while any descriptor checked against it is NOT_FOUND.
            let local = self.chosen(&[], |b| b.caps.local)?;
            let regs = self.inner.regs.read();
            let any = local.iter().any(|b| regs.iter().any(|((id, _), s)| *id == b.id && !s.is_empty()));
            return if any && descs.is_empty() {
                Ok(())
            } else {
                Err(Error::not_found("this agent's own name has no remote section to check descriptors against"))
            };
        }
        let ra = self.remote(name)?;
        if descs.is_empty() {
            return Ok(());
        }
        let sections = ra.sections.read();
        let covered = ra.peers.iter().any(|(id, _)| {
            sections.get(&(*id, descs.mem_type())).is_some_and(|s| descs.iter().all(|d| s.find_cover(d).is_some()))
        });
        if covered {
            Ok(())
        } else {
            Err(Error::not_found(format!("agent '{name}' has not registered all of these descriptors")))
        }
    }

    /// The incarnation id of the loaded peer `name` (a gixl addition).
    pub fn remote_incarnation(&self, name: &str) -> Result<u128> {
        Ok(self.remote(name)?.incarnation)
    }

    pub(crate) fn remote(&self, name: &str) -> Result<Arc<RemoteAgent>> {
        self.inner
            .remotes
            .read()
            .get(name)
            .cloned()
            .ok_or_else(|| Error::not_found(format!("agent '{name}' is not loaded")))
    }

    pub fn make_connection(&self, name: &str, hints: &[BackendId]) -> Result<()> {
        let ra = self.remote(name)?;
        let mut any = false;
        for (id, peer) in &ra.peers {
            if hints.is_empty() || hints.contains(id) {
                self.slot(*id)?.be.connect(peer)?;
                any = true;
            }
        }
        if any {
            Ok(())
        } else {
            Err(Error::backend(format!("no chosen backend is shared with agent '{name}'")))
        }
    }

    // ----- notifications -----

    /// Notifications that arrived since the last call, per sender in arrival order.
    pub fn notifs(&self, hints: &[BackendId]) -> Result<Vec<(String, Vec<u8>)>> {
        let chosen = self.chosen(hints, |b| b.caps.notif)?;
        if chosen.is_empty() {
            return Err(Error::backend("no backend with notification support"));
        }
        let mut out = Vec::new();
        for b in &chosen {
            b.be.notifs(&mut out)?;
        }
        if out.is_empty() {
            // Callers poll this in a tight loop (nixlbench's target spins on it for a whole run): one that finds
            // nothing gives its core to whatever else is runnable there, the copy threads moving the data it waits
            // for among them. Spinning on beside them, a 2-core host's target held back 8 and 16 MiB transfers
            // by a third (docs/performance.md).
            std::thread::yield_now();
        }
        Ok(out)
    }

    /// Send a notification on its own; `remote` may be this agent's own name.
    pub fn gen_notif(&self, remote: &str, msg: &[u8], hints: &[BackendId]) -> Result<()> {
        if self.chosen(hints, |b| b.caps.notif)?.is_empty() {
            return Err(Error::backend("no backend with notification support"));
        }
        if remote == self.inner.name {
            let chosen = self.chosen(hints, |b| b.caps.notif && b.caps.local)?;
            let b = chosen.first().ok_or_else(|| Error::backend("no local backend with notification support"))?;
            return b.be.gen_notif(&Target::Local, msg);
        }
        let ra = self.remote(remote)?;
        let chosen = self.chosen(hints, |b| b.caps.notif && ra.peer(b.id).is_some())?;
        let b = chosen.first().ok_or_else(|| {
            Error::backend(format!("no backend with notification support is shared with agent '{remote}'"))
        })?;
        let peer = ra.peer(b.id).cloned().expect("filtered on peer presence");
        if peer.disconnected() {
            self.on_disconnect(&ra);
            return Err(crate::backend::disconnected(remote, &*peer));
        }
        b.be.gen_notif(&Target::Remote(peer), msg)
    }

    // ----- metadata exchange through a listener, etcd or a TCPStore -----
    //
    // Each of these checks its arguments and builds the metadata now, returns, and leaves the I/O to a
    // background thread, which logs failures (NIXL's contract). `ip` empty means the metadata store (etcd or a
    // TCPStore); otherwise the peer's listener at `ip:port`. An `ip` that is not an address is logged and
    // ignored, as NIXL does.

    /// The port this agent's metadata listener is bound to (`listen_port` 0 picks a free one), if it has one.
    pub fn listen_port(&self) -> Option<u16> {
        self.mdx.as_ref().and_then(|m| m.listen_port())
    }

    fn exchange(&self) -> Result<&Mdx> {
        self.mdx.as_deref().ok_or_else(|| Error::invalid_param("metadata exchange is not available on this agent view"))
    }

    /// Publish this agent's full metadata to the listener at `ip:port`, or to the store under `metadata`.
    pub fn send_local_md(&self, ip: &str, port: u16) -> Result<()> {
        let m = self.exchange()?;
        let Some(route) = m.route(ip, port)? else { return Ok(()) };
        m.send(route, "", self.local_md()?)
    }

    /// Publish metadata for some registered descriptors (see `local_partial_md`). Through a store a `label` is
    /// required; a peer ignores it.
    pub fn send_local_partial_md(
        &self,
        descs: &RegDList,
        include_conn: bool,
        hints: &[BackendId],
        ip: &str,
        port: u16,
        label: &str,
    ) -> Result<()> {
        let m = self.exchange()?;
        let Some(route) = m.route(ip, port)? else { return Ok(()) };
        if matches!(route, crate::mdx::Route::Store) && label.is_empty() {
            let store = m.store_name().unwrap_or("etcd");
            return Err(Error::invalid_param(format!(
                "metadata label is required for {store} send of local partial metadata"
            )));
        }
        m.send(route, label, self.local_partial_md(descs, include_conn, hints)?)
    }

    /// Ask the listener at `ip:port` for its agent's metadata, or read `remote`'s from the store (under
    /// `label`, default `metadata`), and load it when it arrives; poll with `check_remote_md`. Through etcd the
    /// peer is then watched and invalidated when its keys are deleted; a TCPStore has no watch.
    pub fn fetch_remote_md(&self, remote: &str, ip: &str, port: u16, label: &str) -> Result<()> {
        if remote.is_empty() {
            return Err(Error::invalid_param("remote agent name is empty"));
        }
        if remote == self.inner.name {
            return Err(Error::invalid_param("cannot fetch this agent's own metadata"));
        }
        let m = self.exchange()?;
        let Some(route) = m.route(ip, port)? else { return Ok(()) };
        m.fetch(route, remote, label)
    }

    /// Tell the listener at `ip:port` to invalidate this agent, or delete this agent's keys from the store
    /// (etcd's watchers then invalidate it; a TCPStore's readers keep what they loaded).
    pub fn invalidate_local_md(&self, ip: &str, port: u16) -> Result<()> {
        let m = self.exchange()?;
        let Some(route) = m.route(ip, port)? else { return Ok(()) };
        m.invalidate_local(route)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let Some(mdx) = self.mdx.take() else { return };
        self.inner.closing.store(true, Ordering::Release);
        // Frames and etcd requests already accepted get a bounded chance to go out.
        mdx.shutdown();
        // Retire every loaded peer so handles that outlive the agent are refused, not used.
        let remotes: Vec<_> = self.inner.remotes.write().drain().map(|(_, ra)| ra).collect();
        for ra in remotes {
            ra.invalidated.store(true, Ordering::Release);
        }
        for slot in self.inner.backends.read().iter() {
            slot.be.shutdown();
        }
    }
}

/// The agent as the metadata exchange threads see it: a weak reference, so they never keep it alive.
struct AgentHost {
    inner: Weak<Inner>,
    name: String,
    /// Names loaded from LOADs pushed to the listener (see `MAX_PUSHED_PEERS`).
    pushed: Mutex<HashSet<String>>,
}

/// Agents that LOADs pushed to the metadata listener may add (`GIXL_MAX_PUSHED_PEERS`, default 1024).
/// Without a cluster key anyone who reaches the listener can push metadata; this bounds the memory that
/// costs. Peers the application loads itself (`load_remote_md`, `fetch_remote_md`) do not count, nor do
/// pushes that refresh an agent already loaded.
const MAX_PUSHED_PEERS: usize = 1024;
/// Regions one agent may have through pushed LOADs (`GIXL_MAX_PUSHED_REGIONS`): a LOAD frame may carry 2.5
/// million, each about 100 bytes here, and merges into a loaded incarnation would otherwise add up unbounded.
const MAX_PUSHED_REGIONS: usize = 1 << 16;

/// Regions all the agents added by pushed LOADs may have here together (`GIXL_MAX_PUSHED_REGIONS_TOTAL`): each
/// loaded region costs about 230 bytes, so 1024 agents of 65536 regions each would be 15 GiB; this keeps what
/// strangers can make an agent hold to about 240 MiB.
const MAX_PUSHED_REGIONS_TOTAL: usize = 1 << 20;

/// Regions one agent may have here through metadata pushed to the listener (merges included).
fn max_pushed_regions() -> usize {
    std::env::var("GIXL_MAX_PUSHED_REGIONS").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(MAX_PUSHED_REGIONS)
}

fn max_pushed_regions_total() -> usize {
    std::env::var("GIXL_MAX_PUSHED_REGIONS_TOTAL")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(MAX_PUSHED_REGIONS_TOTAL)
}

fn max_pushed_peers() -> usize {
    std::env::var("GIXL_MAX_PUSHED_PEERS").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(MAX_PUSHED_PEERS)
}

impl AgentHost {
    fn with<R>(&self, f: impl FnOnce(&Agent) -> Result<R>) -> Result<R> {
        let inner = self.inner.upgrade().filter(|i| !i.closing.load(Ordering::Acquire));
        let inner = inner.ok_or_else(|| Error::invalid_param(format!("agent '{}' is being destroyed", self.name)))?;
        f(&Agent { inner, mdx: None })
    }
}

impl Host for AgentHost {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn load(&self, blob: &[u8]) -> Result<String> {
        self.with(|a| a.load_remote_md(blob))
    }
    fn load_pushed(&self, blob: &[u8]) -> Result<String> {
        self.with(|a| {
            let mut pushed = self.pushed.lock();
            // Only a new name counts (`load_md` verifies the blob).
            let name = AgentMd::peek_name(blob)?;
            if a.remote_incarnation(&name).is_err() {
                pushed.retain(|n| a.remote_incarnation(n).is_ok());
                let max = max_pushed_peers();
                if pushed.len() >= max {
                    return Err(Error::not_allowed(format!(
                        "{max} agents loaded from metadata pushed to the listener already (GIXL_MAX_PUSHED_PEERS); \
                         invalidate some, or load this one with load_remote_md / fetch_remote_md"
                    )));
                }
            }
            // What the other pushed agents hold leaves this one the rest of the total.
            let regions = |n: &String| {
                a.inner
                    .remotes
                    .read()
                    .get(n)
                    .map_or(0, |ra| ra.sections.read().values().map(|s| s.len()).sum::<usize>())
            };
            let others: usize = pushed.iter().filter(|n| **n != name).map(regions).sum();
            let cap = max_pushed_regions().min(max_pushed_regions_total().saturating_sub(others));
            let loaded = a.load_md(blob, Some(cap))?;
            pushed.insert(loaded.clone());
            Ok(loaded)
        })
    }
    fn invalidate(&self, name: &str) -> Result<()> {
        self.with(|a| a.invalidate_remote_md(name))
    }
    fn full_md(&self) -> Result<Vec<u8>> {
        self.with(|a| a.local_md())
    }
    fn loaded_incarnation(&self, name: &str) -> Option<u128> {
        self.with(|a| a.remote_incarnation(name)).ok()
    }
    fn closing(&self) -> bool {
        match self.inner.upgrade() {
            Some(i) => i.closing.load(Ordering::Acquire),
            None => true,
        }
    }
}

fn check_reg_desc(mem: MemType, d: &Desc) -> Result<()> {
    if d.end().is_none() {
        return Err(Error::invalid_param(format!("{d:?}: address + length overflows")));
    }
    if matches!(mem, MemType::Dram | MemType::Vram) && d.addr == 0 {
        return Err(Error::invalid_param(format!("{d:?}: NULL address")));
    }
    Ok(())
}

/// Reads a yes/no environment variable the way NIXL does ("y", "yes", "1", "true", "on", "enable" and their
/// opposites, any case; NIXL 1.5.1 takes `NIXL_TELEMETRY_ENABLE=enable`).
pub(crate) fn env_flag(name: &str) -> Option<bool> {
    let v = std::env::var(name).ok()?;
    match v.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" | "1" | "true" | "on" | "enable" => Some(true),
        "n" | "no" | "0" | "false" | "off" | "disable" => Some(false),
        _ => None,
    }
}
