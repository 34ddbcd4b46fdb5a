//! The parameters of every algorithm, as one serde structure: the `[cc.*]` tables of a context's
//! TOML config, or `--cc-param ALG.FIELD=VALUE` on the command line. Rates take a number of
//! bytes per second or a string with a unit (`"10gbit"`, `"500mbit"`, `"1.25GB/s"`).

/// Parameters of all algorithms (defaults from the papers, see each algorithm's module).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CcParams {
    /// `[cc.dcqcn]`.
    pub dcqcn: DcqcnParams,
    /// `[cc.timely]`.
    pub timely: TimelyParams,
    /// `[cc.hpcc]`.
    pub hpcc: HpccParams,
    /// `[cc.swift]`.
    pub swift: SwiftParams,
    /// `[cc.homa]`.
    pub homa: HomaParams,
}

impl CcParams {
    /// Applies `ALG.FIELD=VALUE` overrides (e.g. `dcqcn.g=0.0078125`, `hpcc.eta=0.98`,
    /// `timely.line_rate=10gbit`); the error names the bad field.
    pub fn with_overrides(&self, overrides: &[String]) -> Result<CcParams, String> {
        let mut doc: toml::Table =
            toml::Table::try_from(self).map_err(|e| format!("cc parameters: cannot serialize: {e}"))?;
        for o in overrides {
            let (key, value) = o
                .split_once('=')
                .ok_or_else(|| format!("cc parameter {o:?}: expected ALG.FIELD=VALUE"))?;
            let (alg, field) = key
                .trim()
                .split_once('.')
                .ok_or_else(|| format!("cc parameter {key:?}: expected ALG.FIELD"))?;
            let table = doc
                .get_mut(alg)
                .and_then(|t| t.as_table_mut())
                .ok_or_else(|| format!("cc parameter {key:?}: unknown algorithm {alg:?}"))?;
            if !table.contains_key(field) {
                return Err(format!("cc parameter {key:?}: {alg} has no field {field:?}"));
            }
            let v = value.trim();
            // numbers and booleans as TOML values, anything else (a rate with a unit) as a string
            let parsed: toml::Value = toml::from_str::<toml::Table>(&format!("v = {v}"))
                .ok()
                .and_then(|mut t| t.remove("v"))
                .unwrap_or_else(|| toml::Value::String(v.to_string()));
            table.insert(field.to_string(), parsed);
        }
        let p: CcParams = toml::Value::Table(doc)
            .try_into()
            .map_err(|e: toml::de::Error| format!("cc parameters: {}", e.message()))?;
        p.validate()?;
        Ok(p)
    }

    /// Checks every algorithm's parameters; the error names the field.
    /// Checks the values; the error names the bad field.
    pub fn validate(&self) -> Result<(), String> {
        self.dcqcn.validate().map_err(|e| format!("dcqcn.{e}"))?;
        self.timely.validate().map_err(|e| format!("timely.{e}"))?;
        self.hpcc.validate().map_err(|e| format!("hpcc.{e}"))?;
        self.swift.validate().map_err(|e| format!("swift.{e}"))?;
        self.homa.validate().map_err(|e| format!("homa.{e}"))?;
        Ok(())
    }

    /// Sets the line rate (bytes per second) of every algorithm that has one, scaling the
    /// rate steps and floors (DCQCN's R_AI, R_HAI and R_min, TIMELY's delta and floor, HPCC's
    /// W_AI rate) by the same factor, so they keep the defaults' proportions to the line rate.
    pub fn set_line_rate(&mut self, bytes_per_sec: u64) {
        let scale =
            |v: &mut u64, old: u64| *v = ((*v as u128 * bytes_per_sec as u128) / old.max(1) as u128).max(1) as u64;
        let d = &mut self.dcqcn;
        let old = d.line_rate;
        scale(&mut d.rate_ai, old);
        scale(&mut d.rate_hai, old);
        scale(&mut d.min_rate, old);
        d.line_rate = bytes_per_sec;
        let t = &mut self.timely;
        let old = t.line_rate;
        scale(&mut t.delta, old);
        scale(&mut t.min_rate, old);
        t.line_rate = bytes_per_sec;
        let h = &mut self.hpcc;
        let old = h.line_rate;
        scale(&mut h.rate_ai, old);
        h.line_rate = bytes_per_sec;
        self.swift.line_rate = bytes_per_sec;
    }
}

// ---- each algorithm's parameters (its module documents the algorithm) ----

/// DCQCN parameters (shared by the QPs that use them).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DcqcnParams {
    /// Line rate C, bytes per second.
    #[serde(with = "rate")]
    pub line_rate: u64,
    /// Floor of the rate, bytes per second.
    #[serde(with = "rate")]
    pub min_rate: u64,
    /// Additive increase step R_AI and hyper increase step R_HAI, bytes per second.
    #[serde(with = "rate")]
    pub rate_ai: u64,
    /// Hyper increase step R_HAI, bytes per second.
    #[serde(with = "rate")]
    pub rate_hai: u64,
    /// alpha gain g.
    pub g: f64,
    /// alpha update period K (ns) and rate increase timer T (ns).
    pub alpha_period_ns: u64,
    /// Rate increase timer T (ns).
    pub rate_timer_ns: u64,
    /// Byte counter B.
    pub byte_counter: u64,
    /// Fast-recovery stages F.
    pub fast_recovery: u32,
    /// Receiver: at most one CNP per this interval (ns).
    pub cnp_interval_ns: u64,
}

impl Default for DcqcnParams {
    fn default() -> Self {
        let gbit = 1_000_000_000 / 8;
        DcqcnParams {
            line_rate: 40 * gbit,
            min_rate: gbit / 10,
            rate_ai: 40 * gbit / 1000,
            rate_hai: 400 * gbit / 1000,
            g: 1.0 / 256.0,
            alpha_period_ns: 55_000,
            rate_timer_ns: 55_000,
            byte_counter: 10 << 20,
            fast_recovery: 5,
            cnp_interval_ns: 50_000,
        }
    }
}

impl DcqcnParams {
    /// Checks the values; the error names the bad field.
    pub fn validate(&self) -> Result<(), String> {
        if self.min_rate > self.line_rate {
            return Err("min_rate: above line_rate".into());
        }
        if !(self.g > 0.0 && self.g <= 1.0) {
            return Err(format!("g: {} not in (0, 1]", self.g));
        }
        if self.alpha_period_ns == 0 || self.rate_timer_ns == 0 || self.byte_counter == 0 {
            return Err("alpha_period_ns, rate_timer_ns, byte_counter: must be > 0".into());
        }
        Ok(())
    }
}

/// TIMELY parameters.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimelyParams {
    /// Line rate C and floor, bytes per second.
    #[serde(with = "rate")]
    pub line_rate: u64,
    /// Rate floor, bytes per second.
    #[serde(with = "rate")]
    pub min_rate: u64,
    /// EWMA weight of a new RTT difference.
    pub ewma: f64,
    /// Multiplicative decrease factor.
    pub beta: f64,
    /// Below this RTT the rate always increases.
    pub t_low_ns: u64,
    /// Above this RTT the rate always decreases.
    pub t_high_ns: u64,
    /// Minimum RTT: the gradient's normaliser and the update interval.
    pub min_rtt_ns: u64,
    /// Additive step, bytes per second.
    #[serde(with = "rate")]
    pub delta: u64,
    /// Consecutive non-positive gradients before hyper-active increase (N = 5 steps).
    pub hai_thresh: u32,
}

impl Default for TimelyParams {
    fn default() -> Self {
        let gbit = 1_000_000_000 / 8;
        let line = 40 * gbit;
        TimelyParams {
            line_rate: line,
            min_rate: gbit / 10,
            ewma: 0.02,
            beta: 0.8,
            t_low_ns: 50_000,
            t_high_ns: 500_000,
            min_rtt_ns: 20_000,
            // 10 Mbit/s per 10 Gbit/s of line rate
            delta: line / 1000,
            hai_thresh: 5,
        }
    }
}

impl TimelyParams {
    /// Checks the values; the error names the bad field.
    pub fn validate(&self) -> Result<(), String> {
        if self.min_rate > self.line_rate {
            return Err("min_rate: above line_rate".into());
        }
        if !(self.ewma > 0.0 && self.ewma <= 1.0) {
            return Err(format!("ewma: {} not in (0, 1]", self.ewma));
        }
        if !(self.beta > 0.0 && self.beta < 1.0) {
            return Err(format!("beta: {} not in (0, 1)", self.beta));
        }
        if self.min_rtt_ns == 0 || self.t_low_ns >= self.t_high_ns {
            return Err("min_rtt_ns: must be > 0, and t_low_ns below t_high_ns".into());
        }
        Ok(())
    }
}

/// HPCC parameters.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HpccParams {
    /// Line rate C of the host, bytes per second.
    #[serde(with = "rate")]
    pub line_rate: u64,
    /// Base RTT T of the network in nanoseconds (W_init = C × T).
    pub base_rtt_ns: u64,
    /// Target utilisation eta.
    pub eta: f64,
    /// Additive-increase stages before a multiplicative adjustment (maxStage).
    pub max_stage: u32,
    /// Additive increase as a rate: W_AI = rate_ai × T.
    #[serde(with = "rate")]
    pub rate_ai: u64,
}

impl Default for HpccParams {
    fn default() -> Self {
        HpccParams {
            line_rate: 100_000_000_000 / 8,
            base_rtt_ns: 10_000,
            eta: 0.95,
            max_stage: 5,
            rate_ai: 50_000_000 / 8,
        }
    }
}

impl HpccParams {
    /// Checks the values; the error names the bad field.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.eta > 0.0 && self.eta <= 1.0) {
            return Err(format!("eta: {} not in (0, 1]", self.eta));
        }
        if self.base_rtt_ns == 0 {
            return Err("base_rtt_ns: must be > 0".into());
        }
        Ok(())
    }
}

/// Swift parameters (windows in packets, delays in nanoseconds).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SwiftParams {
    /// Line rate, bytes per second (caps the pacing rate).
    #[serde(with = "rate")]
    pub line_rate: u64,
    /// Base target delay (fabric and endpoint, without the per-hop share).
    pub base_target_ns: u64,
    /// Target added per hop, and the hops assumed on the path.
    pub per_hop_ns: u64,
    /// Hops assumed on the path.
    pub hops: u32,
    /// Additive increment (packets per window), decrease factor and largest cut.
    pub ai: f64,
    /// Multiplicative decrease factor.
    pub beta: f64,
    /// Largest multiplicative decrease per step.
    pub max_mdf: f64,
    /// Smallest window (packets; below 1 the flow is paced).
    pub min_cwnd: f64,
    /// Largest window (packets).
    pub max_cwnd: f64,
    /// Flow scaling: extra target up to `fs_range_ns` for windows between these bounds.
    pub fs_range_ns: u64,
    /// Window at which flow scaling adds its whole range.
    pub fs_min_cwnd: f64,
    /// Window at which flow scaling adds nothing.
    pub fs_max_cwnd: f64,
    /// Consecutive timeouts that reset the window to the minimum.
    pub retx_reset: u32,
    /// Initial window (packets).
    pub init_cwnd: f64,
}

impl Default for SwiftParams {
    fn default() -> Self {
        SwiftParams {
            line_rate: 100_000_000_000 / 8,
            base_target_ns: 25_000,
            per_hop_ns: 1_000,
            hops: 1,
            ai: 1.0,
            beta: 0.8,
            max_mdf: 0.5,
            min_cwnd: 0.01,
            max_cwnd: 256.0,
            fs_range_ns: 100_000,
            fs_min_cwnd: 0.1,
            fs_max_cwnd: 256.0,
            retx_reset: 3,
            init_cwnd: 12.0,
        }
    }
}

impl SwiftParams {
    /// Checks the values; the error names the bad field.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.min_cwnd > 0.0 && self.min_cwnd <= self.max_cwnd) {
            return Err("min_cwnd: must be > 0 and at most max_cwnd".into());
        }
        if !(self.beta > 0.0 && self.beta <= 1.0 && self.max_mdf > 0.0 && self.max_mdf < 1.0) {
            return Err("beta, max_mdf: beta in (0, 1], max_mdf in (0, 1)".into());
        }
        if !(self.fs_min_cwnd > 0.0 && self.fs_min_cwnd < self.fs_max_cwnd) {
            return Err("fs_min_cwnd: must be > 0 and below fs_max_cwnd".into());
        }
        Ok(())
    }
}

/// Homa parameters.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HomaParams {
    /// Unscheduled bytes per message and how far ahead a grant reaches (one BDP).
    pub rtt_bytes: u64,
    /// Messages granted at once per receiver (the overcommit degree k).
    pub overcommit: u32,
    /// How often a receiver QP that was not granted re-checks its rank, ns.
    pub grant_timer_ns: u64,
}

impl Default for HomaParams {
    fn default() -> Self {
        HomaParams {
            rtt_bytes: 40_000,
            overcommit: 8,
            grant_timer_ns: 10_000,
        }
    }
}

impl HomaParams {
    /// Checks the values; the error names the bad field.
    pub fn validate(&self) -> Result<(), String> {
        if self.rtt_bytes == 0 || self.overcommit == 0 || self.grant_timer_ns == 0 {
            return Err("rtt_bytes, overcommit, grant_timer_ns: must be > 0".into());
        }
        Ok(())
    }
}

/// Parses a rate: bytes per second as a number, or a number with a unit (`bit`, `kbit`,
/// `mbit`, `gbit`, `B/s`, `KB/s`, `MB/s`, `GB/s`; decimal prefixes).
pub fn parse_rate(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase().replace(' ', "");
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a rate"))?;
    let mult = match unit {
        "" | "b/s" | "bps" => 1.0,
        "bit" | "bit/s" => 1.0 / 8.0,
        "kbit" | "kbit/s" => 1e3 / 8.0,
        "mbit" | "mbit/s" => 1e6 / 8.0,
        "gbit" | "gbit/s" => 1e9 / 8.0,
        "kb/s" => 1e3,
        "mb/s" => 1e6,
        "gb/s" => 1e9,
        _ => {
            return Err(format!(
                "{s:?}: unknown rate unit {unit:?} (use bit, kbit, mbit, gbit, B/s, MB/s, GB/s)"
            ))
        }
    };
    let v = n * mult;
    if !v.is_finite() || v < 1.0 {
        return Err(format!("{s:?}: a rate must be at least 1 byte per second"));
    }
    Ok(v as u64)
}

/// Serde adapter for rate fields: a number of bytes per second or a string with a unit.
pub mod rate {
    use serde::{Deserialize, Deserializer, Serializer};

    /// As a number of bytes per second.
    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(*v)
    }

    /// From a number, or a string with a unit ([`super::parse_rate`]).
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum R {
            N(u64),
            F(f64),
            S(String),
        }
        match R::deserialize(d)? {
            R::N(n) => Ok(n),
            R::F(f) if f >= 1.0 => Ok(f as u64),
            R::F(f) => Err(serde::de::Error::custom(format!("rate {f} below 1 byte per second"))),
            R::S(s) => super::parse_rate(&s).map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_with_units() {
        assert_eq!(parse_rate("10gbit").unwrap(), 1_250_000_000);
        assert_eq!(parse_rate("500 Mbit").unwrap(), 62_500_000);
        assert_eq!(parse_rate("1.5GB/s").unwrap(), 1_500_000_000);
        assert_eq!(parse_rate("4096").unwrap(), 4096);
        assert!(parse_rate("fast").is_err());
        assert!(parse_rate("10 furlongs").unwrap_err().contains("unit"));
    }

    #[test]
    fn overrides_name_the_bad_field() {
        let p = CcParams::default()
            .with_overrides(&["dcqcn.g=0.0078125".into(), "hpcc.line_rate=25gbit".into()])
            .unwrap();
        assert_eq!(p.dcqcn.g, 0.0078125);
        assert_eq!(p.hpcc.line_rate, 25_000_000_000 / 8);
        let e = CcParams::default()
            .with_overrides(&["dcqcn.gain=1".into()])
            .unwrap_err();
        assert!(e.contains("gain"), "{e}");
        let e = CcParams::default().with_overrides(&["reno.g=1".into()]).unwrap_err();
        assert!(e.contains("reno"), "{e}");
        let e = CcParams::default().with_overrides(&["hpcc.eta=7".into()]).unwrap_err();
        assert!(e.contains("hpcc.eta"), "{e}");
    }

    #[test]
    fn line_rate_scales_the_rate_steps() {
        let mut p = CcParams::default();
        let d = p.dcqcn.clone();
        p.set_line_rate(d.line_rate / 200);
        assert_eq!(p.dcqcn.rate_ai, d.rate_ai / 200);
        assert_eq!(p.dcqcn.min_rate, d.min_rate / 200);
        assert_eq!(p.timely.line_rate, d.line_rate / 200);
    }

    #[test]
    fn toml_tables_parse() {
        let p: CcParams = toml::from_str("[swift]\nbase_target_ns = 30000\n[homa]\nrtt_bytes = 20000\n").unwrap();
        assert_eq!(p.swift.base_target_ns, 30_000);
        assert_eq!(p.homa.rtt_bytes, 20_000);
        assert!(toml::from_str::<CcParams>("[swift]\nbogus = 1\n").is_err());
    }
}
