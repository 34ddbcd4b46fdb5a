//! The sent-packet ledger that RC and Solar share: one record per sequence number a sender
//! used, from the oldest it still needs to the next it will use. A record says when the packet
//! was sent (for RTT samples under Karn's rule: a packet sent twice gives none), which path it
//! is in flight on or last left (so the [`PathSet`]'s per-path flight, delivery and loss
//! counts stay exact however the packet leaves: delivered, presumed lost, or forgotten because
//! it is being sent again), and whether it was acknowledged.
//!
//! RC keeps one ledger over a QP's PSNs (records are reserved when a work request starts, and
//! leave in order as the cumulative acknowledgement passes them); Solar keeps one per path,
//! over that path's own PSNs (answers come back in any order, and the oldest unanswered one
//! holds the window's start).

use crate::path::PathSet;
use std::collections::VecDeque;

/// When a packet was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SendTime {
    /// Not sent yet (RC reserves a message's PSNs when it starts; a READ's response PSNs are
    /// never sent by the requester).
    #[default]
    NotYet,
    /// Sent once, at this time: its acknowledgement is an RTT sample.
    Once(u64),
    /// Sent again (last at this time): which copy an acknowledgement answers is unknown, so it
    /// is no RTT sample (Karn's rule).
    Resent(u64),
}

impl SendTime {
    /// The send time of a packet sent once.
    pub fn once(self) -> Option<u64> {
        match self {
            SendTime::Once(t) => Some(t),
            _ => None,
        }
    }
    /// When the packet was last sent (None before the first time).
    pub fn last(self) -> Option<u64> {
        match self {
            SendTime::Once(t) | SendTime::Resent(t) => Some(t),
            SendTime::NotYet => None,
        }
    }
}

/// Where a packet is, as its path's accounting sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Flight {
    /// Never put on a path.
    #[default]
    NotSent,
    /// In flight on this path: counted in the path's flight.
    On(u8),
    /// Last sent on this path and no longer counted in its flight (delivered, lost or
    /// forgotten).
    Left(u8),
}

impl Flight {
    /// The path it is on or last left.
    pub fn path(self) -> Option<u8> {
        match self {
            Flight::On(p) | Flight::Left(p) => Some(p),
            Flight::NotSent => None,
        }
    }
}

/// How a packet leaves its path's flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leave {
    /// It was delivered now: the path delivers.
    Delivered(u64),
    /// It is presumed lost: a loss of the path.
    Lost,
    /// It stops counting without a verdict (sent again, or no longer wanted).
    Forgotten,
}

/// One sequence number's record.
#[derive(Debug, Clone)]
pub struct Sent<T> {
    /// When it was sent.
    pub time: SendTime,
    /// Its path.
    pub flight: Flight,
    /// Acknowledged (RC), or answered or given up (Solar): it holds the window no more.
    pub acked: bool,
    /// What the transport keeps with it.
    pub data: T,
}

/// The records of sequence numbers `base..end`, in order.
#[derive(Debug, Clone)]
pub struct SentLedger<T> {
    base: u64,
    slots: VecDeque<Sent<T>>,
}

impl<T> Default for SentLedger<T> {
    fn default() -> Self {
        SentLedger::new(0)
    }
}

impl<T> SentLedger<T> {
    /// An empty ledger whose next sequence number is `base`.
    pub fn new(base: u64) -> SentLedger<T> {
        SentLedger {
            base,
            slots: VecDeque::new(),
        }
    }

    /// The oldest sequence number still recorded (the next one when the ledger is empty).
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The next sequence number [`SentLedger::push`] will use.
    pub fn end(&self) -> u64 {
        self.base + self.slots.len() as u64
    }

    /// Records held.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Heap bytes of the records.
    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Sent<T>>()
    }

    /// Adds the record of the next sequence number, not sent yet; returns that number.
    pub fn push(&mut self, data: T) -> u64 {
        self.slots.push_back(Sent {
            time: SendTime::NotYet,
            flight: Flight::NotSent,
            acked: false,
            data,
        });
        self.end() - 1
    }

    /// The record of `seq`.
    pub fn get(&self, seq: u64) -> Option<&Sent<T>> {
        self.slots.get(usize::try_from(seq.checked_sub(self.base)?).ok()?)
    }

    /// The record of `seq`, to change.
    pub fn get_mut(&mut self, seq: u64) -> Option<&mut Sent<T>> {
        self.slots.get_mut(usize::try_from(seq.checked_sub(self.base)?).ok()?)
    }

    /// Whether `seq` is acknowledged (every number below the window is).
    pub fn is_acked(&self, seq: u64) -> bool {
        seq < self.base || self.get(seq).is_some_and(|s| s.acked)
    }

    /// The RTT sample that an acknowledgement of `seq` arriving at `now` gives: none for a
    /// packet not sent, or sent more than once.
    pub fn rtt_of(&self, seq: u64, now: u64) -> Option<u64> {
        let t = self.get(seq)?.time.once()?;
        Some(now.saturating_sub(t))
    }

    /// `seq` leaves on `path` at `now` (the path counts it in flight); `resend` marks a second
    /// transmission. A copy still in flight must have been taken off first
    /// ([`SentLedger::take_off`] with [`Leave::Forgotten`]).
    pub fn put_on(&mut self, seq: u64, path: u8, now: u64, resend: bool, paths: &mut PathSet) {
        let Some(s) = self.get_mut(seq) else { return };
        debug_assert!(
            !matches!(s.flight, Flight::On(_)),
            "a packet in flight was put on a path again"
        );
        s.flight = Flight::On(path);
        s.time = if resend {
            SendTime::Resent(now)
        } else {
            SendTime::Once(now)
        };
        paths.on_send(path, now);
    }

    /// `seq` stops counting in its path's flight, as `how` says; returns whether it was in
    /// flight.
    pub fn take_off(&mut self, seq: u64, how: Leave, paths: &mut PathSet) -> bool {
        let Some(s) = self.get_mut(seq) else { return false };
        let Flight::On(p) = s.flight else { return false };
        s.flight = Flight::Left(p);
        match how {
            Leave::Delivered(now) => paths.on_delivered(p, now),
            Leave::Lost => paths.on_lost(p),
            Leave::Forgotten => paths.forget(p),
        }
        true
    }

    /// Marks `seq` acknowledged; returns whether it was not already.
    pub fn set_acked(&mut self, seq: u64) -> bool {
        match self.get_mut(seq) {
            Some(s) if !s.acked => {
                s.acked = true;
                true
            }
            _ => false,
        }
    }

    /// Drops the acknowledged records at the start of the window; returns how many.
    pub fn pop_acked(&mut self) -> u64 {
        let mut n = 0;
        while self.slots.front().is_some_and(|s| s.acked) {
            self.slots.pop_front();
            self.base += 1;
            n += 1;
        }
        n
    }

    /// The records in order, with their sequence numbers.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &Sent<T>)> {
        let base = self.base;
        self.slots.iter().enumerate().map(move |(i, s)| (base + i as u64, s))
    }

    /// The records from `seq` on, in order, with their sequence numbers.
    pub fn iter_from(&self, seq: u64) -> impl Iterator<Item = (u64, &Sent<T>)> {
        let skip = seq.saturating_sub(self.base).min(self.slots.len() as u64) as usize;
        let base = self.base;
        self.slots
            .range(skip..)
            .enumerate()
            .map(move |(i, s)| (base + (skip + i) as u64, s))
    }

    /// The sequence numbers whose packets are in flight, in order.
    pub fn in_flight(&self) -> impl Iterator<Item = (u64, &Sent<T>)> {
        self.iter().filter(|(_, s)| matches!(s.flight, Flight::On(_)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_leave_in_order_and_keep_the_paths_counts() {
        let mut paths = PathSet::default();
        let mut l: SentLedger<()> = SentLedger::new(10);
        assert_eq!((l.push(()), l.push(()), l.push(())), (10, 11, 12));
        l.put_on(10, 0, 100, false, &mut paths);
        l.put_on(11, 0, 110, false, &mut paths);
        assert_eq!(l.rtt_of(10, 150), Some(50));
        assert_eq!(l.rtt_of(12, 150), None, "not sent");
        // 11 is sent again: its first copy stops counting, and it gives no RTT sample
        assert!(l.take_off(11, Leave::Forgotten, &mut paths));
        assert!(!l.take_off(11, Leave::Forgotten, &mut paths), "already off");
        l.put_on(11, 0, 200, true, &mut paths);
        assert_eq!(l.rtt_of(11, 250), None);
        assert_eq!(l.get(11).map(|s| s.time), Some(SendTime::Resent(200)));
        assert_eq!(l.in_flight().map(|(q, _)| q).collect::<Vec<_>>(), [10, 11]);
        // acknowledged out of order: the window starts at the oldest unacknowledged number
        assert!(l.take_off(11, Leave::Delivered(260), &mut paths));
        assert!(l.set_acked(11));
        assert!(!l.set_acked(11));
        assert_eq!(l.pop_acked(), 0);
        assert!(l.is_acked(11) && !l.is_acked(10) && l.is_acked(9));
        assert!(l.take_off(10, Leave::Lost, &mut paths));
        l.set_acked(10);
        assert_eq!(l.pop_acked(), 2);
        assert_eq!((l.base(), l.end(), l.len()), (12, 13, 1));
        assert_eq!(l.get(12).map(|s| s.flight), Some(Flight::NotSent));
        assert_eq!(l.iter_from(12).map(|(q, _)| q).collect::<Vec<_>>(), [12]);
        assert_eq!(l.iter_from(99).count(), 0);
        assert!(l.get(9).is_none() && l.get(13).is_none());
    }
}
