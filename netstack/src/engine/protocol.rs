//! Protocols a data core carries beside RC: their datagrams arrive on the core's ports, their
//! timers run in the core's passes, their packets leave in its batches, and the core is their
//! only owner. The engine knows them only through [`CoreProtocol`]; each is registered when the
//! context opens ([`super::Engine::start`] asks a [`ProtocolFactory`] for each core's set), so a
//! new protocol needs no change here. Application threads reach a protocol through handles of
//! its own that queue commands for its next pass and wake the core (see
//! [`EngineShared::run_here`] and [`EngineShared::notify`]).

use super::tx::send_batch;
pub(crate) use super::tx::Datagram;
use super::{EngineShared, EngineStats};
use crate::link::sys::{OutMsg, SendScratch};
use crate::link::Link;
use std::net::SocketAddrV4;
use std::sync::Arc;

/// One protocol's state on one data core.
pub(crate) trait CoreProtocol: Send {
    /// Whether a received datagram is this protocol's (asked before RoCEv2's parse, so its
    /// first bytes must never be a BTH flexns speaks).
    fn claims(&self, d: &[u8]) -> bool;
    /// One received datagram of this protocol from `src`; `ce`: its IP header carried ECN CE.
    fn on_packet(&mut self, shared: &Arc<EngineShared>, now: u64, d: &[u8], src: SocketAddrV4, ce: bool);
    /// Applies the commands application threads queued since the last pass; whether any came.
    fn commands(&mut self, now: u64) -> bool;
    /// Runs the timers due at `now`; returns the earliest deadline left.
    fn timers(&mut self, now: u64) -> Option<u64>;
    /// Delivers finished work and gathers what is to be sent; whether anything happened.
    fn collect(&mut self, shared: &EngineShared, now: u64) -> bool;
    /// Sends what [`CoreProtocol::collect`] gathered through `tx`; whether anything left.
    fn flush(&mut self, tx: &mut Transmitter<'_>) -> bool;
    /// The core is about to sleep: false when a command raced in (then it must not sleep).
    fn prepare_sleep(&self) -> bool;
    /// The core woke (or did not sleep after [`CoreProtocol::prepare_sleep`] said it could).
    fn woke(&self);
    /// Changes whenever the ports [`CoreProtocol::rx_ports`] names may have changed.
    fn ports_generation(&self) -> (u64, u64);
    /// Adds the ports (link indexes below `path_ports`) this protocol's answers arrive on
    /// beyond each address's main port.
    fn rx_ports(&self, path_ports: usize, out: &mut Vec<usize>);
    /// A new estimate of how late the core runs (see [`super::lateness`]).
    fn set_host_delay(&mut self, ns: u64);
}

/// Makes each data core's protocols as the engine starts it.
pub(crate) trait ProtocolFactory {
    /// The protocols of the core `shared` (its index among the context's cores is `index`).
    fn for_core(&self, index: usize, shared: &Arc<EngineShared>) -> Vec<Box<dyn CoreProtocol>>;
}

/// The core's batch sender, lent to a protocol to send its packets with the core's reused
/// buffers (GSO, one `sendmmsg` per run of packets from one port).
pub(crate) struct Transmitter<'a> {
    pub(super) gso: bool,
    pub(super) link: &'a dyn Link,
    pub(super) stats: &'a EngineStats,
    pub(super) msgs: &'a mut Vec<OutMsg>,
    pub(super) per_msg: &'a mut Vec<usize>,
    pub(super) scratch: &'a mut SendScratch,
}

impl Transmitter<'_> {
    /// Sends `out` (emptied); whether anything was sent.
    pub(crate) fn send<T: Datagram>(&mut self, out: &mut Vec<T>) -> bool {
        send_batch(
            out,
            self.gso,
            self.link,
            self.stats,
            self.msgs,
            self.per_msg,
            self.scratch,
        )
    }
}

/// A core's protocols, asked in turn.
#[derive(Default)]
pub(super) struct Protocols(Vec<Box<dyn CoreProtocol>>);

impl Protocols {
    pub(super) fn new(p: Vec<Box<dyn CoreProtocol>>) -> Protocols {
        Protocols(p)
    }

    /// The protocol a datagram belongs to, if it is not RoCEv2.
    pub(super) fn claiming(&mut self, d: &[u8]) -> Option<&mut (dyn CoreProtocol + 'static)> {
        self.0.iter_mut().find(|p| p.claims(d)).map(|p| &mut **p)
    }

    pub(super) fn commands(&mut self, now: u64) -> bool {
        self.0.iter_mut().fold(false, |w, p| p.commands(now) | w)
    }

    pub(super) fn timers(&mut self, now: u64) -> Option<u64> {
        self.0.iter_mut().fold(None, |d, p| super::earliest(d, p.timers(now)))
    }

    pub(super) fn collect(&mut self, shared: &EngineShared, now: u64) -> bool {
        self.0.iter_mut().fold(false, |w, p| p.collect(shared, now) | w)
    }

    pub(super) fn flush(&mut self, tx: &mut Transmitter<'_>) -> bool {
        self.0.iter_mut().fold(false, |w, p| p.flush(tx) | w)
    }

    /// All of them agree to sleep; when one does not, those that did are woken again.
    pub(super) fn prepare_sleep(&self) -> bool {
        for (k, p) in self.0.iter().enumerate() {
            if !p.prepare_sleep() {
                self.0[..k].iter().for_each(|q| q.woke());
                return false;
            }
        }
        true
    }

    pub(super) fn woke(&self) {
        self.0.iter().for_each(|p| p.woke());
    }

    /// Whether any protocol's ports changed since `seen` was taken.
    pub(super) fn ports_changed(&self, seen: &[(u64, u64)]) -> bool {
        seen.len() != self.0.len() || self.0.iter().zip(seen).any(|(p, s)| p.ports_generation() != *s)
    }

    /// The protocols' port generations now, into `seen`.
    pub(super) fn ports_generations(&self, seen: &mut Vec<(u64, u64)>) {
        seen.clear();
        seen.extend(self.0.iter().map(|p| p.ports_generation()));
    }

    pub(super) fn rx_ports(&self, path_ports: usize, out: &mut Vec<usize>) {
        self.0.iter().for_each(|p| p.rx_ports(path_ports, out));
    }

    pub(super) fn set_host_delay(&mut self, ns: u64) {
        self.0.iter_mut().for_each(|p| p.set_host_delay(ns));
    }
}
