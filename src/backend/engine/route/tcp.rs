//! The TCP route as a peer's route: every request and notification over the peer's link (the link itself,
//! its connections and its serving side are `engine::tcp`).

use std::sync::Arc;

use super::{Job, Route};
use crate::backend::engine::tcp_link::TcpLink;
use crate::backend::Seg;
use crate::status::Result;

pub(crate) struct Tcp {
    pub(crate) link: Arc<TcpLink>,
}

impl Route for Tcp {
    fn label(&self) -> &'static str {
        "tcp"
    }
    fn pid(&self) -> Option<i32> {
        None
    }
    fn exited(&self) -> bool {
        false
    }
    fn down(&self) -> bool {
        self.link.down()
    }
    fn why_down(&self) -> String {
        self.link.why().map(|w| format!(" ({w})")).unwrap_or_default()
    }
    fn connect(&self, _from: &str) -> Result<()> {
        self.link.connect().map(|_| ())
    }
    fn close(&self) {
        self.link.close()
    }
    fn notify(&self, _from: &str, msg: &[u8]) -> Result<()> {
        self.link.notif(msg)
    }
    fn link(&self) -> Option<&Arc<TcpLink>> {
        Some(&self.link)
    }
    fn copy(&self, job: &Job, segs: &[Seg]) -> Result<()> {
        job.over_tcp(&self.link, segs)
    }
}
