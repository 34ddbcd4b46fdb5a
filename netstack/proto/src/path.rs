//! Multipath for one QP (sans-IO): which of its N paths each packet takes (the spray policy),
//! what each path delivered, lost and how long it takes, and whether it is up.
//!
//! A path is an index; the engine maps it to a (local socket, remote address) pair: a UDP source
//! port of its own (ECMP fabrics hash the 5-tuple, so each port is a different route) or a
//! local/remote address pair (multi-NIC hosts). The requester tells the [`PathSet`] about every
//! packet it sends, every packet delivered and every packet it presumes lost, and gives it RTT
//! samples. From that each path keeps a smoothed RTT, a loss rate and its packets in flight.
//!
//! **Health.** A path goes down when `down_after_losses` of its packets in a row were lost and it
//! delivered nothing for an RTO (a congested path loses bursts too, but keeps delivering), or
//! when it delivered nothing for `down_after_rtos` of its RTOs (`srtt + 4 rttvar`, at least
//! `min_rto_ns`) after a packet was sent on it while another path delivered in that time (if no
//! path delivers, the peer or the QP stalls, not a path). A down path leaves the rotation and the
//! requester resends what was in flight on it over the others. The last path that is up never
//! goes down (there is nothing to fail over to; the QP's own retry limit applies). A down path
//! is probed every `probe_interval_ns` with a PROBE packet the peer answers; the first answer
//! brings it back.
//!
//! **Suspects.** When spraying, a path that is up but has had a packet outstanding (or lost)
//! for longer than its RTO with nothing delivered since is suspect: it gets no new packets and
//! no retransmissions while another path is not suspect, and it is probed once per RTO. An
//! answer clears the suspicion (the path answers; what it lost was congestion or reordering),
//! so a false alarm costs one round trip, while a cut path carries nothing more from its first
//! RTO on and goes down by the rule above.
//!
//! **Policies.** `single` uses the first path that is up (the RoCE default with one path;
//! active-backup failover with several). `round-robin` sprays packets over the paths that are
//! up in turn. `weighted` sends where the packet is expected to be delivered soonest: the path
//! with the fewest packets in flight, penalised by its loss rate; a route that is slower or
//! shared with other traffic (two source ports that hash onto the same link) holds more packets
//! in flight per unit of throughput, so it gets fewer. New packets go in bursts of
//! `burst_packets` per choice (flowlets: whole GSO messages, in order within a path).
//! Retransmissions are placed one by one, away from the path the packet was lost on and
//! preferably on a path whose latest packet was delivered.

use smallvec::SmallVec;
use std::str::FromStr;

/// Most paths one QP may use (the BTH carries the path in 7 bits, per-packet records in 6).
pub const MAX_PATHS: usize = 64;
/// "Not in flight on any path" in per-packet path records.
pub const NO_PATH: u8 = u8::MAX;

/// How a QP spreads packets over its paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SprayPolicy {
    /// The first path that is up carries everything (fixed source port; failover only).
    #[default]
    Single,
    /// Packets go round robin over the paths that are up.
    RoundRobin,
    /// Packets go to the path expected to deliver them first (in flight x RTT x loss).
    Weighted,
}

impl SprayPolicy {
    /// Whether the policy sends one QP's packets over several paths at once (and so reorders).
    pub fn sprays(self) -> bool {
        self != SprayPolicy::Single
    }
}

impl FromStr for SprayPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "single" | "none" => Ok(SprayPolicy::Single),
            "round-robin" | "rr" => Ok(SprayPolicy::RoundRobin),
            "weighted" => Ok(SprayPolicy::Weighted),
            _ => Err(format!("unknown spray policy {s:?} (single, round-robin, weighted)")),
        }
    }
}

impl std::fmt::Display for SprayPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SprayPolicy::Single => "single",
            SprayPolicy::RoundRobin => "round-robin",
            SprayPolicy::Weighted => "weighted",
        })
    }
}

/// Health-tracking parameters.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PathParams {
    /// Smallest per-path RTO.
    pub min_rto_ns: u64,
    /// RTO of a path before its first RTT sample.
    pub initial_rto_ns: u64,
    /// A path that delivers nothing for this many RTOs after a send, while others deliver, is down.
    pub down_after_rtos: u32,
    /// A path that lost this many packets in a row is down.
    pub down_after_losses: u32,
    /// How often a down path is probed.
    pub probe_interval_ns: u64,
    /// Most consecutive new packets sent on one path before the policy picks again (a
    /// flowlet): kernel sockets batch them into one GSO message and the receiver gets them in
    /// order. A burst is also at most a path's share of the QP's window (see
    /// [`PathSet::set_window_hint`]), so a small window still spreads evenly. 1 sprays every
    /// packet.
    pub burst_packets: u32,
}

impl Default for PathParams {
    fn default() -> Self {
        PathParams {
            min_rto_ns: 2_000_000,
            initial_rto_ns: 16_000_000,
            down_after_rtos: 3,
            down_after_losses: 8,
            probe_interval_ns: 10_000_000,
            burst_packets: 64,
        }
    }
}

/// Source ports (routes) for `paths` paths with spares to move to (see
/// [`PathSet::set_ports`]): half as many again, at least 2 more, at most 64 in all.
pub fn with_spares(paths: usize) -> usize {
    (paths + (paths / 2).max(2)).min(MAX_PATHS)
}

/// What one path did (a snapshot; see [`PathSet::stats`]).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PathStats {
    /// In the rotation.
    pub up: bool,
    /// Packets sent (first transmissions and retransmissions).
    pub sent: u64,
    /// Packets delivered (answered).
    pub delivered: u64,
    /// Packets presumed lost.
    pub lost: u64,
    /// Packets in flight now.
    pub inflight: u32,
    /// Smoothed RTT (RFC 6298).
    pub srtt_ns: u64,
    /// RTT variation (RFC 6298).
    pub rttvar_ns: u64,
    /// Smoothed fraction of this path's packets that were lost.
    pub loss_rate: f64,
    /// Times the path went down.
    pub downs: u32,
    /// Times it came back.
    pub ups: u32,
    /// Probes sent while it was down.
    pub probes_sent: u64,
    /// Probes answered.
    pub probes_answered: u64,
    /// The host source port (index) the path leaves from now (see [`PathSet::set_ports`]).
    pub port: u8,
    /// Times the path moved to another source port.
    pub repaths: u32,
}

#[derive(Debug, Clone)]
struct Path {
    s: PathStats,
    /// The RTT estimate (`s.srtt_ns` and `s.rttvar_ns` are its snapshot).
    rtt: crate::rtt::RttEstimator,
    /// When the first packet sent since the last delivery left (None: nothing unanswered).
    waiting_since: Option<u64>,
    last_delivery: u64,
    /// When the latest RTT sample came.
    sampled_at: u64,
    losses_in_row: u32,
    next_probe: u64,
    /// When the path last moved to another source port (0: never).
    repathed_at: u64,
}

/// The path new packets keep taking, and how many more may take it (flowlets: a GSO message
/// stays on one path, in order).
#[derive(Debug, Clone, Copy)]
struct Burst {
    path: u8,
    left: u32,
}

/// The paths of one QP.
#[derive(Debug, Clone)]
pub struct PathSet {
    paths: SmallVec<[Path; 4]>,
    policy: SprayPolicy,
    p: PathParams,
    rr: usize,
    /// The current burst of new packets.
    burst: Burst,
    /// The latest delivery on any path.
    last_delivery: u64,
    /// The latest time the requester told (sends, deliveries, samples).
    now: u64,
    /// Packets the QP may have in flight (its window, or rate x RTT), as the requester last said.
    window_pkts: u32,
    /// Source ports the paths may leave from (at least one per path; see [`PathSet::set_ports`]).
    ports: u8,
    /// Where the search for a free source port starts next.
    port_cursor: u8,
    /// How long the hosts have lately kept packets waiting (see [`PathSet::set_host_delay`]).
    host_delay_ns: u64,
}

impl Default for PathSet {
    fn default() -> Self {
        PathSet::new(1, SprayPolicy::Single, PathParams::default())
    }
}

/// Loss-rate smoothing: each packet's outcome weighs 1/64.
const LOSS_GAIN: f64 = 1.0 / 64.0;

impl PathSet {
    /// `n` paths (1 to [`MAX_PATHS`]), all up.
    pub fn new(n: usize, policy: SprayPolicy, p: PathParams) -> PathSet {
        let n = n.clamp(1, MAX_PATHS);
        let path = Path {
            s: PathStats {
                up: true,
                ..PathStats::default()
            },
            rtt: Default::default(),
            waiting_since: None,
            last_delivery: 0,
            sampled_at: 0,
            losses_in_row: 0,
            next_probe: 0,
            repathed_at: 0,
        };
        let mut paths: SmallVec<[Path; 4]> = std::iter::repeat_n(path, n).collect();
        for (i, p) in paths.iter_mut().enumerate() {
            p.s.port = i as u8;
        }
        PathSet {
            paths,
            policy,
            p,
            rr: 0,
            burst: Burst { path: 0, left: 0 },
            last_delivery: 0,
            now: 0,
            window_pkts: u32::MAX,
            ports: n as u8,
            port_cursor: n as u8,
            host_delay_ns: 0,
        }
    }

    /// How long this host has lately kept work waiting (its driver measures it: datagrams
    /// that sat in a socket before a pass took them in, timers that fired late), added to
    /// every path's RTO. A host whose threads wait milliseconds for a core answers late for
    /// the same reason, so a deadline of a fabric RTO alone would call its peer's answers lost:
    /// on a 2-core machine shared with two busy loops, a 1-2 ms floor timed out thousands of
    /// packets a run that were never lost, and took paths out of the rotation with no fault
    /// on the fabric. The RTT estimate itself stays the samples' (RFC 6298).
    pub fn set_host_delay(&mut self, ns: u64) {
        self.host_delay_ns = ns;
    }

    /// What [`PathSet::set_host_delay`] last said.
    pub fn host_delay(&self) -> u64 {
        self.host_delay_ns
    }

    /// The host has `total` source ports (a 5-tuple each, so ECMP hashes each onto a link of its
    /// own choosing) that these paths may leave from; path `i` starts on port `i`, and ports
    /// `len()..total` are spares. When every path is silent (a packet times out and no path
    /// delivered since it was sent), the timed-out path moves to a port no other path uses: a
    /// fresh hash, likely onto a link that works, as Protective ReRoute moves a flow by
    /// changing its IPv6 flow label. While another path delivers, a silent path keeps its port
    /// (it goes down, is probed there, and comes back when its link does): moving it would
    /// gather every path on the links that stayed up, and a restored link would stay unused.
    /// Without spares (`total` at most `len()`) paths never move. At most 255.
    pub fn set_ports(&mut self, total: usize) {
        self.ports = total.clamp(self.paths.len(), 255) as u8;
        self.port_cursor = self.paths.len() as u8 % self.ports;
    }

    /// Whether no two paths leave from one port (the invariant repathing keeps).
    #[cfg(test)]
    fn ports_distinct(&self) -> bool {
        (0..self.paths.len()).all(|i| (0..i).all(|j| self.paths[i].s.port != self.paths[j].s.port))
    }

    /// Times any path moved to another source port.
    pub fn repaths(&self) -> u64 {
        self.paths.iter().map(|p| p.s.repaths as u64).sum()
    }

    /// The source port (index) path `i` leaves from now.
    pub fn port(&self, i: u8) -> u8 {
        self.paths.get(i as usize).map_or(i, |p| p.s.port)
    }

    /// Moves path `i` to the next source port no path uses (round robin over the host's
    /// ports); returns whether it moved (not without a spare port).
    fn repath(&mut self, i: usize, now: u64) -> bool {
        let total = self.ports as usize;
        if total <= self.paths.len() || i >= self.paths.len() {
            return false;
        }
        for step in 0..total {
            let port = ((self.port_cursor as usize + step) % total) as u8;
            if self.paths.iter().all(|p| p.s.port != port) {
                self.port_cursor = ((port as usize + 1) % total) as u8;
                let p = &mut self.paths[i];
                p.s.port = port;
                p.s.repaths += 1;
                p.repathed_at = now.max(1);
                return true;
            }
        }
        false
    }

    /// A packet sent on path `i` at `sent_at` timed out (its retransmission timer fired). If no
    /// path delivered since it was sent and it left from the path's current port, the path
    /// moves to a fresh one (once per port: packets sent before the move say nothing about the
    /// new port); returns whether it moved.
    pub fn on_timeout(&mut self, i: u8, sent_at: u64, now: u64) -> bool {
        self.now = self.now.max(now);
        let Some(p) = self.paths.get(i as usize) else {
            return false;
        };
        let all_silent = self.last_delivery <= sent_at;
        all_silent && sent_at >= p.repathed_at && self.repath(i as usize, now)
    }

    /// How many paths.
    pub fn len(&self) -> usize {
        self.paths.len()
    }
    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.paths.is_empty()
    }
    /// How packets spread over the paths.
    pub fn policy(&self) -> SprayPolicy {
        self.policy
    }
    /// The health parameters.
    pub fn params(&self) -> &PathParams {
        &self.p
    }
    /// Whether path `i` is in the rotation.
    pub fn is_up(&self, i: u8) -> bool {
        self.paths.get(i as usize).is_some_and(|p| p.s.up)
    }
    /// Paths that are up.
    pub fn up_count(&self) -> usize {
        self.paths.iter().filter(|p| p.s.up).count()
    }

    /// The path for a packet: new packets (`avoid` None) continue the current burst while it
    /// lasts and its path is up; a retransmission skips `avoid`, the path it was lost on, when
    /// another path is up.
    pub fn pick(&mut self, avoid: Option<u8>) -> u8 {
        let n = self.paths.len();
        if n == 1 {
            return 0;
        }
        if avoid.is_none() {
            let Burst { path: cur, left } = self.burst;
            if left > 0 && self.paths[cur as usize].s.up && !self.is_suspect(cur as usize) {
                self.burst.left -= 1;
                return cur;
            }
            let p = self.choose(None);
            // a burst is at most a path's share of the QP's window, so a small window (a
            // congestion-controlled QP) is still spread finely enough to balance the paths
            let share = self.window_pkts / self.up_count().max(1) as u32;
            self.burst = Burst {
                path: p,
                left: share.clamp(1, self.p.burst_packets.max(1)) - 1,
            };
            return p;
        }
        self.choose(avoid)
    }

    fn choose(&mut self, avoid: Option<u8>) -> u8 {
        let n = self.paths.len();
        // preference tiers: up, not `avoid`, not suspect (see the module's doc) and (for a
        // retransmission, when spraying) its latest packet delivered rather than lost, and a
        // delivery within its RTO; then the same without the recent delivery; then up, not
        // `avoid` and not suspect; then up and not `avoid`; then up; then any. A path that is
        // silently dropping gets nothing while it waits to be declared down (a cut link's
        // paths all go silent at once: a resend placed on another of them is lost too, and the
        // QP's timer backs off); a probe answer clears a false suspicion (a reordering).
        let resend = self.policy.sprays() && avoid.is_some();
        let tier = |i: usize, ps: &PathSet| -> u8 {
            let p = &ps.paths[i];
            let clear = !ps.is_suspect(i);
            let trusted = !resend || p.losses_in_row == 0;
            // a retransmission goes preferably where something was delivered within the
            // path's RTO: after a timeout with little in flight most paths are idle, and an idle
            // path may be a cut one nobody has noticed yet
            let recent = !resend || ps.now.saturating_sub(p.last_delivery) <= ps.rto(i as u8);
            match (p.s.up, Some(i as u8) != avoid, clear, trusted, recent) {
                (true, true, true, true, true) => 0,
                (true, true, true, true, false) => 1,
                (true, true, true, false, _) => 2,
                (true, true, false, _, _) => 3,
                (true, false, _, _, _) => 4,
                _ => 5,
            }
        };
        let best = (0..n).map(|i| tier(i, self)).min().unwrap_or(5);
        let ok = |i: usize, ps: &PathSet| tier(i, ps) == best;
        match self.policy {
            SprayPolicy::Single => (0..n).find(|&i| ok(i, self)).unwrap_or(0) as u8,
            SprayPolicy::RoundRobin => {
                for k in 1..=n {
                    let i = (self.rr + k) % n;
                    if ok(i, self) {
                        self.rr = i;
                        return i as u8;
                    }
                }
                0
            }
            SprayPolicy::Weighted => {
                // expected time to deliver: packets in flight (plus this one) times the RTT,
                // penalised by the loss rate. An RTT not refreshed for 16 of its own lengths per
                // path (each path's turn comes that rarely) counts as the fastest fresh
                // one, so a path that lost the comparison is tried and measured again instead
                // of being starved by a stale estimate
                let now = self.now;
                let age = 16 * n as u64;
                let fresh = |p: &Path| p.s.srtt_ns > 0 && now.saturating_sub(p.sampled_at) <= age * p.s.srtt_ns;
                let floor = self
                    .paths
                    .iter()
                    .filter(|p| fresh(p))
                    .map(|p| p.s.srtt_ns)
                    .min()
                    .unwrap_or(1);
                let mut best: Option<(f64, usize)> = None;
                for k in 1..=n {
                    let i = (self.rr + k) % n;
                    if !ok(i, self) {
                        continue;
                    }
                    let p = &self.paths[i];
                    let rtt = if fresh(p) { p.s.srtt_ns } else { floor } as f64;
                    let s = &p.s;
                    let cost = (s.inflight as f64 + 1.0) * rtt * (1.0 + 10.0 * s.loss_rate);
                    if best.is_none_or(|(c, _)| cost < c) {
                        best = Some((cost, i));
                    }
                }
                let i = best.map_or(0, |(_, i)| i);
                self.rr = i;
                i as u8
            }
        }
    }

    /// How many packets the QP may have in flight: the window its congestion control or rate
    /// allows (bursts are cut to a path's share of it).
    pub fn set_window_hint(&mut self, pkts: u32) {
        self.window_pkts = pkts;
    }

    /// The first path that is up.
    pub fn first_up(&self) -> u8 {
        self.paths.iter().position(|p| p.s.up).unwrap_or(0) as u8
    }

    /// A packet left on path `i`.
    pub fn on_send(&mut self, i: u8, now: u64) {
        self.now = self.now.max(now);
        let Some(p) = self.paths.get_mut(i as usize) else {
            return;
        };
        p.waiting_since.get_or_insert(now);
        p.s.inflight += 1;
        p.s.sent += 1;
    }

    /// A packet sent on path `i` was delivered.
    pub fn on_delivered(&mut self, i: u8, now: u64) {
        self.now = self.now.max(now);
        let Some(p) = self.paths.get_mut(i as usize) else {
            return;
        };
        p.s.inflight = p.s.inflight.saturating_sub(1);
        p.s.delivered += 1;
        p.s.loss_rate *= 1.0 - LOSS_GAIN;
        p.losses_in_row = 0;
        p.last_delivery = now;
        self.last_delivery = self.last_delivery.max(now);
        // still waiting for what was sent after the delivered packet, if anything
        p.waiting_since = (p.s.inflight > 0).then_some(now);
    }

    /// A packet presumed lost on path `i` turned out delivered (its resend was spurious): the
    /// loss is taken back and the path counts as delivering.
    pub fn on_late_delivery(&mut self, i: u8, now: u64) {
        let Some(p) = self.paths.get_mut(i as usize) else {
            return;
        };
        p.s.lost = p.s.lost.saturating_sub(1);
        p.s.delivered += 1;
        p.losses_in_row = 0;
        p.last_delivery = now;
        self.last_delivery = self.last_delivery.max(now);
    }

    /// An RTT sample, taken at `now`, of a packet first sent on path `i`.
    pub fn on_rtt(&mut self, i: u8, rtt: u64, now: u64) {
        self.now = self.now.max(now);
        let Some(p) = self.paths.get_mut(i as usize) else {
            return;
        };
        p.sampled_at = now;
        p.rtt.sample(rtt);
        p.s.srtt_ns = p.rtt.srtt_ns();
        p.s.rttvar_ns = p.rtt.rttvar_ns();
    }

    /// A packet sent on path `i` is presumed lost.
    pub fn on_lost(&mut self, i: u8) {
        let Some(p) = self.paths.get_mut(i as usize) else {
            return;
        };
        p.s.inflight = p.s.inflight.saturating_sub(1);
        p.s.lost += 1;
        p.losses_in_row += 1;
        p.s.loss_rate = p.s.loss_rate * (1.0 - LOSS_GAIN) + LOSS_GAIN;
    }

    /// A packet sent on path `i` is no longer in flight, neither delivered nor lost (go-back-N
    /// resends everything after a loss).
    pub fn forget(&mut self, i: u8) {
        if let Some(p) = self.paths.get_mut(i as usize) {
            p.s.inflight = p.s.inflight.saturating_sub(1);
        }
    }

    /// Path `i`'s retransmission timeout.
    pub fn rto(&self, i: u8) -> u64 {
        let Some(p) = self.paths.get(i as usize) else {
            return self.p.initial_rto_ns.saturating_add(self.host_delay_ns);
        };
        p.rtt
            .rto(self.p.initial_rto_ns, self.p.min_rto_ns, u64::MAX)
            .saturating_add(self.host_delay_ns)
    }

    /// Whether path `i` has had a packet outstanding (or lost) for longer than its RTO
    /// without delivering anything since.
    pub(crate) fn is_silent(&self, i: u8) -> bool {
        self.silent_at(i as usize).is_some_and(|t| self.now >= t)
    }

    /// When path `i` turns silent if nothing comes back: an RTO after the first packet sent on
    /// it since its last delivery, if that packet is still out there or lost.
    fn silent_at(&self, i: usize) -> Option<u64> {
        let p = self.paths.get(i)?;
        let since = p.waiting_since.filter(|_| p.s.inflight > 0 || p.losses_in_row > 0)?;
        Some(since + self.rto(i as u8) + 1)
    }

    /// Whether path `i` is suspect: up and silent while the QP sprays over several paths that
    /// are up.
    fn is_suspect(&self, i: usize) -> bool {
        self.policy.sprays() && self.paths[i].s.up && self.up_count() > 1 && self.is_silent(i as u8)
    }

    /// When any path last delivered a packet (ns; 0 before the first).
    pub(crate) fn last_delivery(&self) -> u64 {
        self.last_delivery
    }

    /// When path `i` has waited long enough to be down (if another path delivers meanwhile):
    /// something sent on it at `waiting_since` is still out there or was lost, and nothing was
    /// delivered on it since.
    fn down_at(&self, i: usize) -> Option<u64> {
        let p = &self.paths[i];
        let since = p
            .waiting_since
            .filter(|_| p.s.up && (p.s.inflight > 0 || p.losses_in_row > 0))?;
        Some(since + self.p.down_after_rtos.max(1) as u64 * self.rto(i as u8))
    }

    fn is_dead(&self, i: usize, now: u64) -> bool {
        let p = &self.paths[i];
        if !p.s.up {
            return false;
        }
        if p.losses_in_row >= self.p.down_after_losses.max(1) && now >= p.last_delivery + self.rto(i as u8) {
            return true;
        }
        let Some(since) = p.waiting_since else { return false };
        // something is still out there or was lost, nothing came back for the RTOs, and
        // another path delivered meanwhile
        self.down_at(i).is_some_and(|t| now >= t) && self.last_delivery > since
    }

    /// Takes paths that stopped delivering out of the rotation; returns those that went down
    /// now (the requester resends what they had in flight).
    pub fn check(&mut self, now: u64) -> SmallVec<[u8; 4]> {
        self.now = self.now.max(now);
        let mut down = SmallVec::new();
        for i in 0..self.paths.len() {
            if self.up_count() <= 1 {
                break;
            }
            if self.is_dead(i, now) {
                let p = &mut self.paths[i];
                p.s.up = false;
                p.s.downs += 1;
                p.next_probe = now + self.p.probe_interval_ns;
                down.push(i as u8);
            }
        }
        down
    }

    /// A path whose probe is due, marked as probed now: a down path every
    /// `probe_interval_ns`, a suspect one every RTO.
    pub fn probe_due(&mut self, now: u64) -> Option<u8> {
        self.now = self.now.max(now);
        let i = (0..self.paths.len())
            .find(|&i| self.paths[i].next_probe <= now && (!self.paths[i].s.up || self.is_suspect(i)))?;
        let every = if self.paths[i].s.up {
            self.rto(i as u8)
        } else {
            self.p.probe_interval_ns
        };
        let p = &mut self.paths[i];
        p.next_probe = now + every;
        p.s.probes_sent += 1;
        Some(i as u8)
    }

    /// The peer answered a probe sent on path `i`: a down path is back; a suspect one is
    /// cleared (its packets still out there are given a fresh RTO).
    pub fn on_probe_reply(&mut self, i: u8, now: u64) {
        self.now = self.now.max(now);
        let Some(p) = self.paths.get_mut(i as usize) else {
            return;
        };
        p.s.probes_answered += 1;
        if !p.s.up {
            p.s.up = true;
            p.s.ups += 1;
            p.s.inflight = 0;
            p.s.loss_rate = 0.0;
            p.losses_in_row = 0;
            p.waiting_since = None;
        } else {
            p.losses_in_row = 0;
            p.waiting_since = (p.s.inflight > 0).then_some(now);
        }
    }

    /// The earliest time [`PathSet::check`] or [`PathSet::probe_due`] has something to do.
    pub fn next_deadline(&self) -> Option<u64> {
        if self.paths.len() < 2 {
            return None;
        }
        // only times at which something would happen are deadlines: a silent path is probed
        // only while another is up, and goes down only once another path has delivered since
        // it began waiting (before that, the delivery itself brings the QP up). A time that
        // passed with nothing to do would be asked for again and again: the core would spin
        // through a partition instead of sleeping until its retransmission timeout.
        let suspects = self.policy.sprays() && self.up_count() > 1;
        (0..self.paths.len())
            .filter_map(|i| {
                let p = &self.paths[i];
                if p.s.up {
                    let probe = self.silent_at(i).filter(|_| suspects).map(|t| t.max(p.next_probe));
                    let down = self
                        .down_at(i)
                        .filter(|_| p.waiting_since.is_some_and(|since| self.last_delivery > since));
                    [down, probe].into_iter().flatten().min()
                } else {
                    Some(p.next_probe)
                }
            })
            .min()
    }

    /// How much later a packet may arrive than one sent at the same time on another path: the
    /// spread of the paths' RTTs (slowest `srtt + 2 rttvar` minus fastest `srtt`, over the
    /// paths that are up and were measured). Zero with one path. The requester widens its
    /// reordering window by it, so spraying over unequal paths causes no spurious resends.
    pub fn delay_spread(&self) -> u64 {
        if self.paths.len() < 2 || !self.policy.sprays() {
            return 0;
        }
        let measured = || self.paths.iter().filter(|p| p.s.up && p.s.srtt_ns > 0);
        let (Some(hi), Some(lo)) = (
            measured().map(|p| p.s.srtt_ns + 2 * p.s.rttvar_ns).max(),
            measured().map(|p| p.s.srtt_ns).min(),
        ) else {
            return 0;
        };
        hi - lo
    }

    /// Per-path counters.
    pub fn stats(&self) -> Vec<PathStats> {
        self.paths.iter().map(|p| p.s.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Per-packet choices (bursts of one).
    fn set(n: usize, policy: SprayPolicy) -> PathSet {
        PathSet::new(
            n,
            policy,
            PathParams {
                burst_packets: 1,
                ..PathParams::default()
            },
        )
    }

    /// `n` round-robin paths, each of which delivered a packet with an RTT of 100 us.
    fn measured(n: usize) -> PathSet {
        let mut s = set(n, SprayPolicy::RoundRobin);
        for i in 0..n as u8 {
            s.on_send(i, 0);
            s.on_delivered(i, 100_000);
            s.on_rtt(i, 100_000, 100_000);
        }
        s
    }

    #[test]
    fn new_packets_go_in_bursts_and_a_burst_ends_when_its_path_goes_down() {
        let mut s = PathSet::new(
            2,
            SprayPolicy::RoundRobin,
            PathParams {
                burst_packets: 4,
                ..PathParams::default()
            },
        );
        let v: Vec<u8> = (0..8).map(|_| s.pick(None)).collect();
        assert_eq!(v, [1, 1, 1, 1, 0, 0, 0, 0]);
        // bursts are at most a path's share of the window: with 2 packets over 2 paths, one
        let mut small = PathSet::new(2, SprayPolicy::RoundRobin, PathParams::default());
        small.set_window_hint(2);
        let v: Vec<u8> = (0..4).map(|_| small.pick(None)).collect();
        assert_eq!(v, [1, 0, 1, 0], "a packet per path");
        // retransmissions choose per packet, away from the path they were lost on
        assert_eq!(s.pick(Some(1)), 0);
        s.on_send(1, 0);
        s.on_send(0, 0);
        s.on_delivered(0, 1_000);
        assert_eq!(s.pick(None), 1, "a new burst");
        assert_eq!(s.check(3 * 16_000_000).as_slice(), &[1]);
        assert_eq!(s.pick(None), 0, "the burst on the down path ends");
    }

    #[test]
    fn round_robin_visits_every_up_path() {
        let mut s = set(4, SprayPolicy::RoundRobin);
        let v: Vec<u8> = (0..8).map(|_| s.pick(None)).collect();
        for i in 0..4u8 {
            assert_eq!(v.iter().filter(|&&p| p == i).count(), 2, "{v:?}");
        }
        // a retransmission avoids the path it was lost on
        for _ in 0..8 {
            assert_ne!(s.pick(Some(2)), 2);
        }
    }

    #[test]
    fn single_sticks_to_the_first_up_path_and_fails_over() {
        let mut s = set(3, SprayPolicy::Single);
        assert!((0..5).all(|_| s.pick(None) == 0));
        s.on_send(0, 0);
        assert!(
            s.check(3 * 16_000_000).is_empty(),
            "no path delivered: the peer stalls, not the path"
        );
        s.on_send(1, 0);
        s.on_delivered(1, 1_000);
        let down = s.check(3 * 16_000_000);
        assert_eq!(down.as_slice(), &[0]);
        assert!((0..5).all(|_| s.pick(None) == 1));
    }

    #[test]
    fn weighted_prefers_the_path_that_delivers_faster() {
        // 20 packets in flight; path 0 delivers three packets for every one of path 1, and its
        // RTT samples are a third of path 1's
        let mut s = set(2, SprayPolicy::Weighted);
        let mut n = [0u32; 2];
        for t in 0..4000u64 {
            while s.stats().iter().map(|p| p.inflight).sum::<u32>() < 20 {
                let p = s.pick(None);
                n[p as usize] += 1;
                s.on_send(p, t);
            }
            let i = if t % 4 == 3 { 1 } else { 0 };
            if s.stats()[i].inflight > 0 {
                s.on_delivered(i as u8, t);
                s.on_rtt(i as u8, [100, 300][i], t);
            }
        }
        assert!(n[0] > 2 * n[1], "the 3x faster path carries most: {n:?}");
        // a path whose estimate went stale is tried again
        let mut st = set(2, SprayPolicy::Weighted);
        st.on_rtt(0, 100, 0);
        st.on_rtt(1, 10_000, 0);
        assert_eq!(st.pick(None), 0);
        st.on_rtt(0, 100, 1_000_000);
        assert_eq!(
            st.pick(None),
            1,
            "path 1's sample is 100 of its RTTs old (over 16 per path)"
        );
        // losses push traffic away too
        let mut l = set(2, SprayPolicy::Weighted);
        for _ in 0..64 {
            l.on_send(1, 0);
            l.on_lost(1);
        }
        assert!((0..20).all(|_| l.pick(None) == 0));
    }

    #[test]
    fn the_host_delay_is_added_to_every_rto() {
        let mut s = PathSet::new(2, SprayPolicy::RoundRobin, PathParams::default());
        s.on_send(0, 1_000);
        s.on_rtt(0, 50_000, 51_000);
        let (r0, r1) = (s.rto(0), s.rto(1));
        s.set_host_delay(4_000_000);
        assert_eq!((s.rto(0), s.rto(1)), (r0 + 4_000_000, r1 + 4_000_000));
        assert_eq!(s.host_delay(), 4_000_000);
    }

    #[test]
    fn a_silent_path_goes_down_within_three_rtos_and_a_probe_brings_it_back() {
        let mut s = measured(2);
        let rto = s.rto(1);
        assert_eq!(rto, PathParams::default().min_rto_ns, "RTO floor");
        s.on_send(0, 1_000_000);
        s.on_send(1, 1_000_000);
        s.on_delivered(0, 1_100_000);
        assert!(s.check(1_000_000 + 3 * rto - 1).is_empty());
        assert_eq!(s.probe_due(1_000_000 + 3 * rto - 1), Some(1), "a suspect is probed");
        assert_eq!(s.next_deadline(), Some(1_000_000 + 3 * rto));
        assert_eq!(s.check(1_000_000 + 3 * rto).as_slice(), &[1]);
        assert!(!s.is_up(1));
        assert!((0..4).all(|_| s.pick(None) == 0), "out of the rotation");
        // the last path up never goes down
        s.on_send(0, 2_000_000);
        assert!(s.check(u64::MAX / 2).is_empty());
        // probing
        let t = 1_000_000 + 3 * rto;
        assert_eq!(s.probe_due(t), None, "not before the probe interval");
        let p = PathParams::default().probe_interval_ns;
        assert_eq!(s.probe_due(t + p), Some(1));
        assert_eq!(s.probe_due(t + p), None, "once per interval");
        s.on_probe_reply(1, t + p + 100_000);
        assert!(s.is_up(1));
        let st = &s.stats()[1];
        // one probe while suspect, one while down
        assert_eq!((st.downs, st.ups, st.probes_sent, st.probes_answered), (1, 1, 2, 1));
    }

    #[test]
    fn with_every_path_silent_no_deadline_passes_unanswered() {
        // a partition takes both paths: nothing is delivered after the sends. Neither path may
        // go down (no other path delivered since) nor be probed as a suspect, so no time at
        // which that would happen is a deadline: a core asked for a passed time again and
        // again spins (the whole-stack simulator found a core doing so through a partition)
        let mut s = measured(2);
        let rto = s.rto(0);
        let last = s.last_delivery();
        s.on_send(0, last + 1_000);
        s.on_send(1, last + 1_000);
        let late = last + 1_000 + 10 * rto;
        // what the QP does when its deadline comes: check, then send the probes that are due
        assert!(s.check(late).is_empty(), "nothing delivered since: no path goes down");
        while s.probe_due(late).is_some() {}
        assert!(s.next_deadline().is_none_or(|d| d > late), "{:?}", s.next_deadline());
        // a delivery on path 0 makes path 1's overdue down time a deadline again, and it goes
        s.on_delivered(0, late);
        assert!(s.next_deadline().is_some_and(|d| d <= late));
        assert_eq!(s.check(late).as_slice(), &[1]);
    }

    #[test]
    fn a_retransmission_avoids_a_path_silent_for_longer_than_its_rto() {
        // a cut link takes several paths at once: before they are declared down, a packet lost
        // on one of them must not be resent on another of them
        let mut s = measured(3);
        let rto = s.rto(0);
        // paths 1 and 2 go silent at 1 ms; path 0 keeps delivering
        s.on_send(1, 1_000_000);
        s.on_send(2, 1_000_000);
        s.on_send(0, 1_000_000 + rto);
        s.on_delivered(0, 1_000_000 + rto + 100_000);
        assert!(s.is_up(1) && s.is_up(2), "not yet down");
        // a packet lost on path 1: its resend goes to path 0, the one that delivers
        assert!((0..6).all(|_| s.pick(Some(1)) == 0));
        assert!((0..6).all(|_| s.pick(Some(2)) == 0));
        // after a timeout with one packet in flight the other paths are idle: the resend goes
        // where something was delivered lately, not to an idle path that may be cut as well
        let mut idle = measured(4);
        idle.on_send(2, 50_000_000);
        idle.on_delivered(2, 50_100_000);
        idle.on_send(1, 50_200_000);
        assert!((0..6).all(|_| idle.pick(Some(1)) == 2));
        // within its RTO a path is not suspect: resends are spread as before
        let mut fresh = set(3, SprayPolicy::RoundRobin);
        for i in 0..3u8 {
            fresh.on_send(i, 0);
        }
        let picks: Vec<u8> = (0..4).map(|_| fresh.pick(Some(1))).collect();
        assert!(picks.contains(&2) && picks.contains(&0), "{picks:?}");
    }

    #[test]
    fn a_suspect_path_gets_no_new_packets_is_probed_and_an_answer_clears_it() {
        let mut s = measured(3);
        let rto = s.rto(1);
        // path 1 goes silent at 1 ms; paths 0 and 2 deliver
        s.on_send(1, 1_000_000);
        for i in [0, 2] {
            s.on_send(i, 1_000_000 + rto / 4);
            s.on_delivered(i, 1_000_000 + rto / 2);
        }
        assert_eq!(s.next_deadline(), Some(1_000_000 + rto + 1), "when it turns suspect");
        assert_eq!(s.probe_due(1_000_000 + rto), None, "not silent within its RTO");
        let t = 1_000_000 + rto + 1;
        assert_eq!(s.probe_due(t), Some(1), "probed as soon as it is silent");
        assert_eq!(s.probe_due(t), None, "once per RTO");
        assert!(s.is_up(1), "suspect, not down");
        assert!((0..8).all(|_| s.pick(None) != 1), "no new packets while suspect");
        // the answer: the path works, it only lost a packet (congestion, reordering)
        s.on_probe_reply(1, t + 100_000);
        assert!(!s.is_silent(1));
        let picks: Vec<u8> = (0..6).map(|_| s.pick(None)).collect();
        assert!(picks.contains(&1), "back in the rotation at once: {picks:?}");
        assert_eq!(s.stats()[1].downs, 0);
        // without spraying there is no suspicion: the policy decides alone
        let mut one = set(2, SprayPolicy::Single);
        one.on_send(0, 0);
        one.on_delivered(1, 10);
        assert_eq!(one.probe_due(u64::MAX / 4), None);
        assert_eq!(one.pick(None), 0);
    }

    #[test]
    fn a_path_moves_to_a_spare_port_on_timeouts_only_while_every_path_is_silent() {
        // both paths delivered at 100 us, nothing since
        let mut s = measured(2);
        // no spare: never moves
        assert!(!s.on_timeout(0, 1_000_000, 2_000_000));
        s.set_ports(4);
        assert_eq!((s.port(0), s.port(1)), (0, 1));
        assert!(s.on_timeout(0, 1_000_000, 2_000_000));
        assert_eq!(s.port(0), 2, "the first port no path uses");
        // a packet sent before the move timing out says nothing about the new port
        assert!(!s.on_timeout(0, 1_500_000, 2_500_000));
        assert!(s.on_timeout(0, 2_100_000, 4_000_000));
        assert_eq!(s.port(0), 3);
        // round robin over the free ports: port 0 is free again
        assert!(s.on_timeout(1, 1_000_000, 4_000_000));
        assert_eq!(s.port(1), 0);
        assert_eq!(s.repaths(), 3);
        // path 0 delivers: path 1's loss is a partial cut, and path 1 keeps its port through
        // its timeout, going down, and its probes, so it comes back where its link does
        s.on_send(1, 5_000_000);
        s.on_send(0, 5_000_000);
        s.on_delivered(0, 5_100_000);
        assert!(!s.on_timeout(1, 5_000_000, 7_000_000));
        let down = s.check(5_000_000 + 3 * s.rto(1) + 1);
        assert_eq!(&down[..], &[1]);
        let t = 100_000_000;
        assert_eq!(s.probe_due(t), Some(1));
        assert_eq!(s.probe_due(t + s.params().probe_interval_ns), Some(1));
        assert_eq!(s.port(1), 0);
        s.on_probe_reply(1, t + 20_000_000);
        assert!(s.is_up(1));
        let stats = s.stats();
        assert_eq!((stats[0].port, stats[1].port), (3, 0));
        assert_eq!(stats[0].repaths + stats[1].repaths, 3);
        assert!(s.ports_distinct());
    }

    #[test]
    fn policies_parse() {
        assert_eq!("weighted".parse::<SprayPolicy>(), Ok(SprayPolicy::Weighted));
        assert_eq!("rr".parse::<SprayPolicy>(), Ok(SprayPolicy::RoundRobin));
        assert!("ecmp"
            .parse::<SprayPolicy>()
            .unwrap_err()
            .contains("single, round-robin, weighted"));
    }
}
