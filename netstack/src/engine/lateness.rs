//! How late a data core has lately been, so that its timers do not count as network delay
//! the time its own host did not run.
//!
//! Two measures, both from what the core sees:
//! - **Host delay**: how long a datagram waited between the kernel taking it in (its receive
//!   timestamp) and a pass processing it, and how far past its deadline a sleeping core woke.
//!   On a 2-core machine shared with two busy loops these are milliseconds: a thread waits for
//!   a core. The peak of the recent samples, halving every [`HALF_LIFE_NS`], is handed to the
//!   flows (`RcQp::set_host_delay`, and each protocol's through `CoreProtocol::set_host_delay`), which add it to their
//!   retransmission timeouts: a peer on such a host answers late for the same reason.
//! - **Receive horizon**: the time up to which everything that arrived has been taken in. A
//!   pass whose receive batch came back full left datagrams in a socket (answers, perhaps, to
//!   what is about to time out), and a pass run by a poster or an application thread may not
//!   receive at all before it runs timers; timers are judged at the horizon, not at the clock,
//!   so a packet whose answer sits unread is not called lost. The horizon never lags the clock
//!   by more than [`MAX_HORIZON_LAG_NS`]: a core that has not emptied its sockets for that long
//!   is overloaded rather than late, and its timers run on the clock.

/// The host-delay estimate halves every this long without a new peak.
const HALF_LIFE_NS: u64 = 250_000_000;
/// Most host delay the flows allow for (a stop of the whole host beyond it is a fault).
const MAX_HOST_DELAY_NS: u64 = 100_000_000;
/// Below this an estimate is the ordinary cost of a wake-up, not lateness: the flows get 0.
const NOISE_NS: u64 = 100_000;
/// Most the receive horizon lags the clock.
pub(super) const MAX_HORIZON_LAG_NS: u64 = 20_000_000;

/// A core's lateness (see the module docs). Owned by its core; times are the engine clock's.
#[derive(Debug, Default)]
pub(super) struct Lateness {
    /// The latest peak and when it came.
    peak_ns: u64,
    peak_at: u64,
    /// The largest sample of the pass under way.
    pass_max: u64,
    /// Everything that arrived by this time has been taken in.
    horizon: u64,
    /// When the core last woke from a wait, and the deadline that wait was for.
    woke_at: u64,
    sleep_deadline: Option<u64>,
    /// The estimate the flows were last given.
    applied: u64,
}

impl Lateness {
    /// A datagram the kernel took in at `arrived` is processed at `now`.
    pub(super) fn arrival(&mut self, now: u64, arrived: u64) {
        self.pass_max = self.pass_max.max(now.saturating_sub(arrived));
    }

    /// The core goes to sleep at `now` until `deadline` at the latest (`None`: no deadline). A
    /// deadline already past (the wait is the shortest there is) says nothing of lateness.
    pub(super) fn sleeping(&mut self, now: u64, deadline: Option<u64>) {
        self.sleep_deadline = deadline.filter(|&d| d > now);
    }

    /// The core's driver read at `at` which of its descriptors are readable (the tokio task's
    /// driver, before each pass): a pass that receives on those alone has taken in what came
    /// by `at`, as after a wake-up, with no lateness to sample.
    pub(super) fn ready_as_of(&mut self, at: u64) {
        self.woke_at = self.woke_at.max(at);
    }

    /// The core woke at `now`: how far past its deadline is a sample.
    pub(super) fn woke(&mut self, now: u64) {
        self.woke_at = now;
        if let Some(d) = self.sleep_deadline.take() {
            self.pass_max = self.pass_max.max(now.saturating_sub(d));
        }
    }

    /// The current estimate at `now`: the latest peak, halved per half-life since.
    pub(super) fn estimate(&self, now: u64) -> u64 {
        let halvings = now.saturating_sub(self.peak_at) / HALF_LIFE_NS;
        if halvings >= 64 {
            0
        } else {
            self.peak_ns >> halvings
        }
    }

    /// Ends a pass's receive step at `now`. `drained` says whether every port it received on
    /// came back with room to spare, and `all_ports` whether it received on every port (not
    /// only those a wait reported readable: the others had nothing when the core woke). Folds
    /// the pass's samples in; returns the host delay to hand the flows when it changed (rounded
    /// up to a power of two, so that it changes a few times a second at most).
    pub(super) fn end_receive(&mut self, now: u64, drained: bool, all_ports: bool) -> Option<u64> {
        if drained {
            let upto = if all_ports { now } else { self.woke_at.min(now) };
            self.horizon = self.horizon.max(upto);
        }
        let s = std::mem::take(&mut self.pass_max).min(MAX_HOST_DELAY_NS);
        if s >= self.estimate(now) {
            self.peak_ns = s;
            self.peak_at = now;
        }
        let e = self.estimate(now);
        let q = if e < NOISE_NS { 0 } else { e.next_power_of_two() };
        (q != self.applied).then(|| {
            self.applied = q;
            q
        })
    }

    /// What the flows were last given.
    pub(super) fn applied(&self) -> u64 {
        self.applied
    }

    /// The time timers are judged at, at `now`: the receive horizon, at most
    /// [`MAX_HORIZON_LAG_NS`] behind.
    pub(super) fn timer_now(&self, now: u64) -> u64 {
        self.horizon.max(now.saturating_sub(MAX_HORIZON_LAG_NS)).min(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn a_late_pass_raises_the_estimate_which_then_decays() {
        let mut l = Lateness::default();
        let t = 1_000 * MS;
        l.arrival(t, t - 5 * MS);
        assert_eq!(l.end_receive(t, true, true), Some(8_388_608), "5 ms, rounded up");
        assert_eq!(l.applied(), 8_388_608);
        // a smaller sample within the half-life changes nothing
        l.arrival(t + MS, t);
        assert_eq!(l.end_receive(t + MS, true, true), None);
        // two half-lives later a quarter is left; past the noise floor it is 0
        assert_eq!(l.estimate(t + 2 * HALF_LIFE_NS), 5 * MS / 4);
        assert_eq!(l.end_receive(t + 20 * HALF_LIFE_NS, true, true), Some(0));
    }

    #[test]
    fn oversleeping_a_deadline_counts() {
        let mut l = Lateness::default();
        l.sleeping(9 * MS, Some(10 * MS));
        l.woke(13 * MS);
        l.end_receive(13 * MS, true, true);
        assert_eq!(l.estimate(13 * MS), 3 * MS);
        // a wait with no deadline that ends is no lateness
        let mut l = Lateness::default();
        l.sleeping(0, None);
        l.woke(500 * MS);
        assert_eq!(l.end_receive(500 * MS, true, true), None);
        // nor one whose deadline had passed when it began (the shortest wait)
        let mut l = Lateness::default();
        l.sleeping(30 * MS, Some(10 * MS));
        l.woke(31 * MS);
        assert_eq!(l.end_receive(31 * MS, true, true), None);
    }

    #[test]
    fn timers_wait_for_a_backlog_but_not_forever() {
        let mut l = Lateness::default();
        l.end_receive(10 * MS, true, true);
        assert_eq!(l.timer_now(10 * MS), 10 * MS);
        // a full batch: what came after 10 ms may still be in a socket
        l.end_receive(12 * MS, false, true);
        assert_eq!(l.timer_now(12 * MS), 10 * MS);
        // a pass that received only on ports a wait at 15 ms reported
        l.woke(15 * MS);
        l.end_receive(16 * MS, true, false);
        assert_eq!(l.timer_now(16 * MS), 15 * MS);
        // a driver that read its descriptors' readiness at 18 ms (the tokio task, which
        // never sleeps while it has work) moves it as a wake-up does
        l.ready_as_of(18 * MS);
        l.end_receive(19 * MS, true, false);
        assert_eq!(l.timer_now(19 * MS), 18 * MS);
        // an overloaded core's timers run at most the lag behind
        assert_eq!(l.timer_now(100 * MS), 100 * MS - MAX_HORIZON_LAG_NS);
    }
}
