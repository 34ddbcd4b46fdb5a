//! Waiting for work completions the way a run's threads wait ([`Wait`]): what the client and
//! its offload operations share.

use super::reference::Wait;
use anyhow::{bail, Result};
use netstack::verbs::{Cq, Wc};
use std::time::{Duration, Instant};

/// Waits for the next completion: spinning on the CQ, or sleeping on it.
pub fn next_wc(cq: &Cq, wcs: &mut [Wc], limit: Instant, wait: Wait) -> Result<usize> {
    loop {
        let n = cq.poll(wcs);
        if n > 0 {
            return Ok(n);
        }
        let now = Instant::now();
        if now > limit {
            bail!("no completion before the deadline: the peer stopped answering");
        }
        match wait {
            Wait::Spin => std::thread::yield_now(),
            Wait::Block => {
                cq.wait((limit - now).min(Duration::from_millis(5)));
            }
        }
    }
}
