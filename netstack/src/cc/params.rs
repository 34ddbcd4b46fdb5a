//! The parameters of every algorithm, as one serde structure: the `[cc.*]` tables of a context's
//! TOML config, or `--cc-param ALG.FIELD=VALUE` on the command line. Rates take a number of
//! bytes per second or a string with a unit (`"10gbit"`, `"500mbit"`, `"1.25GB/s"`).

use super::{dcqcn, homa, hpcc, swift, timely};
use std::sync::Arc;

/// Parameters of all algorithms (defaults from the papers, see each algorithm's module).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CcParams {
    pub dcqcn: dcqcn::DcqcnParams,
    pub timely: timely::TimelyParams,
    pub hpcc: hpcc::HpccParams,
    pub swift: swift::SwiftParams,
    pub homa: homa::HomaParams,
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

/// What the QPs of one host share: the parameters and Homa's receiver scheduler.
#[derive(Debug)]
pub struct CcEnv {
    pub params: SharedParams,
    pub homa: Arc<homa::HomaScheduler>,
}

/// The parameters behind `Arc`s, so each QP's context holds a pointer rather than a copy.
#[derive(Debug, Clone)]
pub struct SharedParams {
    pub dcqcn: Arc<dcqcn::DcqcnParams>,
    pub timely: Arc<timely::TimelyParams>,
    pub hpcc: Arc<hpcc::HpccParams>,
    pub swift: Arc<swift::SwiftParams>,
    pub homa: Arc<homa::HomaParams>,
}

impl CcEnv {
    pub fn new(p: &CcParams) -> Arc<CcEnv> {
        Arc::new(CcEnv {
            params: SharedParams {
                dcqcn: Arc::new(p.dcqcn.clone()),
                timely: Arc::new(p.timely.clone()),
                hpcc: Arc::new(p.hpcc.clone()),
                swift: Arc::new(p.swift.clone()),
                homa: Arc::new(p.homa.clone()),
            },
            homa: Arc::new(homa::HomaScheduler::default()),
        })
    }

    /// The defaults.
    pub fn default_env() -> Arc<CcEnv> {
        CcEnv::new(&CcParams::default())
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

    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(*v)
    }

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
