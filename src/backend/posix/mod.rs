//! The "POSIX" file backend (being written).

use std::sync::Arc;

use crate::backend::{Backend, BackendInit, Params};
use crate::status::{Error, Result};

pub fn default_params() -> Params {
    Params::new()
}

pub fn create(_init: BackendInit) -> Result<Arc<dyn Backend>> {
    Err(Error::not_supported("the POSIX backend is not built yet"))
}
