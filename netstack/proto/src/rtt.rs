//! Round-trip time estimation: the one estimator RC's requester, the multipath paths and the
//! Solar client share (RFC 6298 section 2).

/// Smoothed RTT and RTT variation in nanoseconds, per RFC 6298 section 2: the first sample R
/// sets SRTT = R and RTTVAR = R/2; later ones RTTVAR = 3/4 RTTVAR + 1/4 |SRTT - R|, then
/// SRTT = 7/8 SRTT + 1/8 R (integer arithmetic). An SRTT of 0 means no sample yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct RttEstimator {
    srtt_ns: u64,
    rttvar_ns: u64,
}

impl RttEstimator {
    /// Folds in one RTT measurement.
    pub(crate) fn sample(&mut self, rtt_ns: u64) {
        if self.srtt_ns == 0 {
            self.srtt_ns = rtt_ns;
            self.rttvar_ns = rtt_ns / 2;
        } else {
            let err = self.srtt_ns.abs_diff(rtt_ns);
            self.rttvar_ns = (3 * self.rttvar_ns + err) / 4;
            self.srtt_ns = (7 * self.srtt_ns + rtt_ns) / 8;
        }
    }

    /// The smoothed RTT (0 before the first sample).
    pub(crate) fn srtt_ns(&self) -> u64 {
        self.srtt_ns
    }

    /// The RTT variation (0 before the first sample).
    pub(crate) fn rttvar_ns(&self) -> u64 {
        self.rttvar_ns
    }

    /// The retransmission timeout SRTT + 4 RTTVAR (RFC 6298 section 2.3, K = 4, no clock
    /// granularity term), within `min..=max`; `initial` before the first sample (section 2.1).
    pub(crate) fn rto(&self, initial: u64, min: u64, max: u64) -> u64 {
        if self.srtt_ns == 0 {
            return initial;
        }
        (self.srtt_ns + 4 * self.rttvar_ns).clamp(min, max)
    }
}

#[cfg(test)]
mod tests {
    use super::RttEstimator;

    #[test]
    fn follows_rfc_6298() {
        let mut r = RttEstimator::default();
        assert_eq!(r.rto(1_000, 10, 100_000), 1_000, "initial RTO before a sample");
        r.sample(800);
        assert_eq!((r.srtt_ns(), r.rttvar_ns()), (800, 400));
        assert_eq!(r.rto(1_000, 10, 100_000), 800 + 1_600);
        r.sample(1_600);
        // RTTVAR from the old SRTT: 3/4 400 + 1/4 800; then SRTT = 7/8 800 + 1/8 1600
        assert_eq!((r.srtt_ns(), r.rttvar_ns()), (900, 500));
        assert_eq!(r.rto(1_000, 10, 2_000), 2_000, "clamped to the maximum");
        assert_eq!(r.rto(1_000, 5_000, 9_000), 5_000, "and to the minimum");
    }
}
