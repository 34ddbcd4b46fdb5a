//! A data core's RedN side: the managed QPs' chains run in its pass.

use super::*;

impl DataCore {
    /// Runs the managed QPs' RedN chains; returns when a throttled one may go on.
    pub(super) fn run_chains(&mut self, now: u64, work: &mut bool) -> Option<u64> {
        if self.managed.is_empty() {
            return None;
        }
        let managed = std::mem::take(&mut self.managed);
        let mut retry: Option<u64> = None;
        // an ENABLE may release a QP visited earlier in the round: go round while one moves
        for _ in 0..8 {
            let mut moved = false;
            for &qpn in &managed {
                let peer_pd = self.local_peer_pd(qpn);
                let Some(s) = self.qps.get_mut(&qpn) else {
                    continue;
                };
                // a chain whose operations complete at once runs on after its completions are
                // delivered (its WAITs count delivered completions)
                for _ in 0..64 {
                    let Some(chain) = s.chain.as_mut() else { break };
                    let copied = s.qp.payload_copy_bytes();
                    let pass = chain.pass(
                        &mut s.qp,
                        &self.shared.mrs,
                        &self.shared.redn,
                        &self.shared.guards,
                        now,
                        peer_pd,
                    );
                    self.shared
                        .stats
                        .rx_payload_copy_bytes
                        .add(s.qp.payload_copy_bytes() - copied);
                    if let Some(t) = pass.retry_at {
                        retry = Some(retry.map_or(t, |r| r.min(t)));
                    }
                    if !pass.progressed {
                        break;
                    }
                    moved = true;
                    self.active.insert(qpn);
                    let had = s.qp.has_completions();
                    if !s.deliver_completions(self.index) {
                        self.stuck.insert(qpn);
                        break;
                    }
                    if !had {
                        break;
                    }
                }
            }
            if !moved {
                break;
            }
            *work = true;
        }
        self.managed = managed;
        retry
    }

    /// The protection domain of a QP's peer when the peer is a QP of this core (a loopback
    /// peer whose operations the engine may execute on memory directly).
    pub(super) fn local_peer_pd(&self, qpn: u32) -> Option<u32> {
        let s = self.qps.get(&qpn)?;
        let (remote, dest) = (s.remote?, s.qp.dest_qpn());
        if !self.local_addrs.contains(&remote) {
            return None;
        }
        if dest == qpn {
            return Some(s.qp.pd());
        }
        let p = self.qps.get(&dest)?;
        (p.qp.state() == QpState::Rts && p.qp.dest_qpn() == qpn).then(|| p.qp.pd())
    }
}
