//! Notification pipes: single-producer single-consumer rings of 64-byte slots, the software
//! analog of FlexiNS's DMA-only notification pipe.
//!
//! - Each slot carries a valid bit that the producer flips on every lap of the ring, so the
//!   consumer learns that a slot is full by reading the slot itself: there is no shared
//!   head/tail index on the hot path.
//! - The consumer publishes how far it has read only every `publish_every` slots (and before it
//!   sleeps); the producer reads that counter only when its cached copy says the ring is full.
//! - A consumer with nothing to do may sleep on an eventfd after saying so; a producer writes
//!   the eventfd only when the consumer said it sleeps.
//!
//! # Safety model
//! This is the stack's third `unsafe` module. A slot's payload is written by the producer only
//! while the slot is free (the consumer has published a position past it) and read by the
//! consumer only after it observed the slot's valid bit with Acquire ordering, which the producer
//! set with Release ordering after writing the payload. The `Producer` and `Consumer` halves are
//! not `Clone` and take `&mut self`, so each side has exactly one user at a time.
//!
//! The protocol (slot hand-over, batched publishing, and the sleep/notify hand-shake that must
//! never lose a wake-up) is model-checked with `loom`: `scripts/loom.sh` builds this module
//! with `--cfg flexns_loom`, where the atomics and the payload cell are loom's (the eventfd
//! stays a real one: a system call, ordered with everything around it), and explores every
//! interleaving of the tests in `loom_model`.

use crate::link::sys::EventFd;
use std::mem::MaybeUninit;
use std::sync::Arc;

#[cfg(flexns_loom)]
use loom::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
#[cfg(not(flexns_loom))]
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};

/// A slot's payload cell (std's `UnsafeCell`, or loom's, which checks the accesses).
struct Cell<T>(
    #[cfg(not(flexns_loom))] std::cell::UnsafeCell<MaybeUninit<T>>,
    #[cfg(flexns_loom)] loom::cell::UnsafeCell<MaybeUninit<T>>,
);

impl<T> Cell<T> {
    fn new() -> Cell<T> {
        #[cfg(not(flexns_loom))]
        return Cell(std::cell::UnsafeCell::new(MaybeUninit::uninit()));
        #[cfg(flexns_loom)]
        return Cell(loom::cell::UnsafeCell::new(MaybeUninit::uninit()));
    }

    /// # Safety
    /// No other access to the cell may happen during the call (the producer owns a free slot).
    unsafe fn write(&self, v: T) {
        #[cfg(not(flexns_loom))]
        // SAFETY: exclusive access, the caller's contract.
        unsafe {
            (*self.0.get()).write(v);
        }
        #[cfg(flexns_loom)]
        // SAFETY: exclusive access, the caller's contract (loom checks it).
        self.0.with_mut(|p| unsafe {
            (*p).write(v);
        });
    }

    /// # Safety
    /// The cell must hold a value written by [`Cell::write`] that happens-before this call, and
    /// no write may run during it.
    unsafe fn read(&self) -> T {
        #[cfg(not(flexns_loom))]
        // SAFETY: initialized and not written concurrently, the caller's contract.
        return unsafe { (*self.0.get()).assume_init_read() };
        #[cfg(flexns_loom)]
        // SAFETY: as above (loom checks it).
        return self.0.with(|p| unsafe { (*p).assume_init_read() });
    }
}

/// Bytes of one slot (checked at compile time, except under loom, whose cells are larger).
#[cfg_attr(flexns_loom, allow(dead_code))]
pub const SLOT_BYTES: usize = 64;
/// Largest payload a slot carries.
pub const MAX_PAYLOAD: usize = 56;

#[repr(C, align(64))]
struct Slot<T> {
    /// Bit 0: the valid bit of the lap that last wrote this slot.
    valid: AtomicU32,
    data: Cell<T>,
}

#[repr(align(64))]
struct Padded<T>(T);

struct Ring<T> {
    slots: Box<[Slot<T>]>,
    mask: u64,
    /// Slots consumed so far, published every `publish_every` slots.
    consumed: Padded<AtomicU64>,
    sleeping: Padded<AtomicBool>,
    wake: EventFd,
}

// SAFETY: access to slot payloads follows the protocol in the module docs; T is Send.
unsafe impl<T: Send> Send for Ring<T> {}
// SAFETY: a slot's payload is touched by one side at a time (the producer before publishing it,
// the consumer after seeing it published, ordered by the Release/Acquire index updates in the
// module docs), so sharing `&Ring` between the two threads creates no data race.
unsafe impl<T: Send> Sync for Ring<T> {}

/// The writing half.
pub struct Producer<T> {
    ring: Arc<Ring<T>>,
    head: u64,
    /// The consumer's published position as last read.
    cached_consumed: u64,
}

/// The reading half.
pub struct Consumer<T> {
    ring: Arc<Ring<T>>,
    tail: u64,
    publish_every: u64,
    unpublished: u64,
}

/// Creates a pipe of `capacity` slots (rounded up to a power of two, at least 2); the consumer
/// publishes its position every `publish_every` slots.
pub fn pipe<T: Copy + Send>(capacity: usize, publish_every: usize) -> std::io::Result<(Producer<T>, Consumer<T>)> {
    #[cfg(not(flexns_loom))]
    const {
        assert!(
            std::mem::size_of::<Slot<T>>() == SLOT_BYTES,
            "a pipe payload must fit in 56 bytes"
        )
    };
    let cap = capacity.max(2).next_power_of_two();
    let slots = (0..cap)
        .map(|_| Slot {
            valid: AtomicU32::new(0),
            data: Cell::new(),
        })
        .collect();
    let ring = Arc::new(Ring {
        slots,
        mask: cap as u64 - 1,
        consumed: Padded(AtomicU64::new(0)),
        sleeping: Padded(AtomicBool::new(false)),
        wake: EventFd::new()?,
    });
    let publish_every = (publish_every as u64).clamp(1, cap as u64 / 2);
    Ok((
        Producer {
            ring: ring.clone(),
            head: 0,
            cached_consumed: 0,
        },
        Consumer {
            ring,
            tail: 0,
            publish_every,
            unpublished: 0,
        },
    ))
}

/// The valid bit a slot carries when written on lap `n / capacity`: 1 on even laps, 0 on odd
/// ones (slots start at 0, so a fresh ring reads as empty).
fn phase(n: u64, cap: u64) -> u32 {
    (((n / cap) & 1) ^ 1) as u32
}

impl<T: Copy + Send> Producer<T> {
    /// Slots in the ring.
    pub fn capacity(&self) -> usize {
        self.ring.slots.len()
    }

    /// Appends `v`, or gives it back when the ring is full.
    pub fn try_push(&mut self, v: T) -> Result<(), T> {
        let cap = self.ring.mask + 1;
        if self.head - self.cached_consumed >= cap {
            self.cached_consumed = self.ring.consumed.0.load(Ordering::Acquire);
            if self.head - self.cached_consumed >= cap {
                return Err(v);
            }
        }
        let slot = &self.ring.slots[(self.head & self.ring.mask) as usize];
        // SAFETY: the consumer has published a position past this slot's previous use, so it
        // no longer reads it; we are the only producer (&mut self).
        unsafe { slot.data.write(v) };
        slot.valid.store(phase(self.head, cap), Ordering::Release);
        self.head += 1;
        Ok(())
    }

    /// Slots that can be written now without waiting for the consumer.
    pub fn free(&mut self) -> usize {
        self.cached_consumed = self.ring.consumed.0.load(Ordering::Acquire);
        ((self.ring.mask + 1) - (self.head - self.cached_consumed)) as usize
    }

    /// Wakes the consumer if it said it is going to sleep. Call after a batch of pushes.
    pub fn notify(&self) {
        // Store-buffering hand-shake with `prepare_sleep`: we stored a slot's valid bit, then
        // load `sleeping`; the consumer stores `sleeping`, then loads the valid bit. Without
        // a SeqCst fence on both sides between the store and the load, both loads may see the
        // old values (the valid bit's Release store can pass a later load, on x86 too) and the
        // wake-up is lost (found by the loom model below).
        fence(Ordering::SeqCst);
        if self.ring.sleeping.0.load(Ordering::SeqCst) {
            self.ring.wake.notify();
        }
    }

    /// Slots written so far.
    #[cfg(test)]
    pub fn pushed(&self) -> u64 {
        self.head
    }
}

impl<T: Copy + Send> Consumer<T> {
    /// Takes the next slot, if the producer has written it.
    pub fn pop(&mut self) -> Option<T> {
        let cap = self.ring.mask + 1;
        let slot = &self.ring.slots[(self.tail & self.ring.mask) as usize];
        if slot.valid.load(Ordering::Acquire) != phase(self.tail, cap) {
            return None;
        }
        // SAFETY: the valid bit of this lap was stored with Release after the payload was
        // written, and we loaded it with Acquire; the producer will not rewrite the slot
        // before we publish a position past it.
        let v = unsafe { slot.data.read() };
        self.tail += 1;
        self.unpublished += 1;
        if self.unpublished >= self.publish_every {
            self.publish();
        }
        Some(v)
    }

    /// Makes every consumed slot available to the producer again.
    pub fn publish(&mut self) {
        self.ring.consumed.0.store(self.tail, Ordering::Release);
        self.unpublished = 0;
    }

    /// Whether a slot is waiting.
    pub fn has_data(&self) -> bool {
        let slot = &self.ring.slots[(self.tail & self.ring.mask) as usize];
        slot.valid.load(Ordering::Acquire) == phase(self.tail, self.ring.mask + 1)
    }

    /// Says "I am going to sleep"; returns false (and stays awake) when data arrived meanwhile.
    /// After a true return, wait on [`Consumer::wake_fd`] and then call [`Consumer::woke`].
    pub fn prepare_sleep(&mut self) -> bool {
        self.publish();
        self.ring.sleeping.0.store(true, Ordering::SeqCst);
        // pairs with the fence in `Producer::notify`
        fence(Ordering::SeqCst);
        if self.has_data() {
            self.ring.sleeping.0.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// Clears the sleeping flag and drains the eventfd.
    pub fn woke(&mut self) {
        self.woke_ready(true);
    }

    /// Clears the sleeping flag, and drains the eventfd when the wait reported it `readable`
    /// (a read of an empty eventfd is a system call for nothing).
    pub fn woke_ready(&mut self, readable: bool) {
        self.ring.sleeping.0.store(false, Ordering::SeqCst);
        if readable {
            self.ring.wake.drain();
        }
    }

    /// The eventfd a sleeping consumer waits on (with other descriptors, e.g. in `ppoll`).
    pub fn wake_fd(&self) -> std::os::fd::RawFd {
        self.ring.wake.fd()
    }

    /// Sleeps until a producer notifies or `timeout_ns` passes (when no data is waiting); the
    /// engine's waits use `prepare_sleep` and `woke` around their own `ppoll`, this one the
    /// tests (not loom's model, which has its own).
    #[cfg(all(test, not(flexns_loom)))]
    pub fn sleep(&mut self, timeout_ns: u64) {
        if self.prepare_sleep() {
            let _ = crate::link::sys::ppoll_readable(&[self.wake_fd()], timeout_ns);
            self.woke();
        }
    }
}

#[cfg(all(test, not(flexns_loom)))]
mod stress;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps_and_reports_full() {
        let (mut p, mut c) = pipe::<u64>(4, 1).unwrap();
        for lap in 0..10u64 {
            for i in 0..4 {
                p.try_push(lap * 4 + i).unwrap();
            }
            assert_eq!(p.try_push(99), Err(99), "full after 4");
            for i in 0..4 {
                assert_eq!(c.pop(), Some(lap * 4 + i));
            }
            assert_eq!(c.pop(), None);
        }
    }

    #[test]
    fn batched_publishing_holds_back_the_producer_until_published() {
        let (mut p, mut c) = pipe::<u32>(8, 4).unwrap();
        for i in 0..8 {
            p.try_push(i).unwrap();
        }
        for _ in 0..3 {
            c.pop().unwrap();
        }
        assert!(p.try_push(8).is_err(), "3 pops are not published yet");
        c.pop().unwrap();
        assert!(p.try_push(8).is_ok(), "the 4th pop publishes");
    }
}

/// Every interleaving of producer and consumer (run by `scripts/loom.sh`).
#[cfg(all(test, flexns_loom))]
mod loom_model {
    use super::*;
    use loom::thread;

    /// Across two laps of a two-slot ring, with batched publishing, every value arrives once,
    /// in order, and the producer never overwrites a slot the consumer has not released.
    #[test]
    fn values_cross_laps_once_and_in_order() {
        loom::model(|| {
            let (mut p, mut c) = pipe::<u64>(2, 2).unwrap();
            let t = thread::spawn(move || {
                for i in 0..4u64 {
                    while p.try_push(i).is_err() {
                        thread::yield_now();
                    }
                }
            });
            let mut got = Vec::new();
            while got.len() < 4 {
                match c.pop() {
                    Some(v) => got.push(v),
                    None => {
                        c.publish();
                        thread::yield_now();
                    }
                }
            }
            t.join().unwrap();
            assert_eq!(got, [0, 1, 2, 3]);
        });
    }

    /// A consumer that decides to sleep is always woken by a producer that pushes and then
    /// notifies: either it sees the data before sleeping, or the wake-up is pending.
    #[test]
    fn a_sleeping_consumer_is_never_missed() {
        loom::model(|| {
            let (mut p, mut c) = pipe::<u64>(2, 1).unwrap();
            let t = thread::spawn(move || {
                p.try_push(7).unwrap();
                p.notify();
            });
            if c.prepare_sleep() {
                // blocked in ppoll: only a pending wake-up lets it go on (a lost one spins
                // here until loom reports it)
                while !c.ring.wake.take() {
                    thread::yield_now();
                }
                c.woke();
            }
            t.join().unwrap();
            assert_eq!(c.pop(), Some(7));
        });
    }
}
