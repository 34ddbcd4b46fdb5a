//! `ccsim`: the congestion-control experiments on the deterministic network simulator. Each
//! experiment runs the selected algorithms and writes `OUT/<experiment>.json` and
//! `OUT/<experiment>.png`, and prints one JSON line per algorithm.

use anyhow::Context;
use clap::{Parser, Subcommand};
use clients::ccsim::{self, Scale};
use netstack::cc::CcKind;
use std::path::PathBuf;

#[derive(Parser)]
#[command(about = "Congestion-control experiments on the flexns network simulator")]
struct Cli {
    #[command(subcommand)]
    exp: Exp,
    /// Where the JSON and PNG files go.
    #[arg(long, global = true, default_value = "target/ccsim")]
    out: PathBuf,
    /// Algorithms to run, comma-separated (none, dcqcn, timely, hpcc, swift, homa).
    #[arg(
        long,
        global = true,
        value_delimiter = ',',
        default_value = "none,dcqcn,timely,hpcc,swift,homa"
    )]
    cc: Vec<CcKind>,
    /// Shorter runs (smoke tests).
    #[arg(long, global = true)]
    quick: bool,
    #[arg(long, global = true, default_value_t = 1)]
    seed: u64,
}

#[derive(Subcommand, Clone, Copy)]
enum Exp {
    /// (a) 2 senders × 5 flows into one receiver: per-flow rate and queue over time.
    Fairness,
    /// (b) queue drain time versus added control-loop delay.
    LoopDelay,
    /// (c) FCT slowdown by flow size, WebSearch at 30 % and 50 % load on a leaf-spine.
    Fct,
    /// (d) N-to-1 incast.
    Incast,
    /// All four.
    All,
}

fn main() -> std::process::ExitCode {
    clients::bench::exit("ccsim", run())
}

fn run() -> anyhow::Result<()> {
    clients::bench::init_cli();
    let cli = Cli::parse();
    std::fs::create_dir_all(&cli.out).with_context(|| format!("creating {}", cli.out.display()))?;
    let s = Scale {
        quick: cli.quick,
        seed: cli.seed,
    };
    let exps = match cli.exp {
        Exp::All => vec![Exp::Fairness, Exp::LoopDelay, Exp::Fct, Exp::Incast],
        e => vec![e],
    };
    for e in exps {
        let t0 = std::time::Instant::now();
        let (name, (json, panels), cols) = match e {
            Exp::Fairness => ("fairness", ccsim::fairness(&cli.cc, s), 2),
            Exp::LoopDelay => ("loop-delay", ccsim::loop_delay(&cli.cc, s), 1),
            Exp::Fct => ("fct", ccsim::fct(&cli.cc, s), 2),
            Exp::Incast => ("incast", ccsim::incast(&cli.cc, s), 1),
            Exp::All => unreachable!(),
        };
        let jpath = cli.out.join(format!("{name}.json"));
        std::fs::write(&jpath, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing {}", jpath.display()))?;
        let ppath = cli.out.join(format!("{name}.png"));
        clients::plot::draw(&ppath, &panels, cols, &format!("ccsim {name}"))?;
        for r in json["results"].as_array().into_iter().flatten() {
            println!("{}", summary(name, r));
        }
        for l in json["loads"].as_array().into_iter().flatten() {
            for r in l["results"].as_array().into_iter().flatten() {
                let mut r = summary(name, r);
                r["load"] = l["load"].clone();
                println!("{r}");
            }
        }
        eprintln!(
            "{name}: {} and {} in {:.1} s",
            jpath.display(),
            ppath.display(),
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// The result without its time series (one line per algorithm).
fn summary(exp: &str, r: &serde_json::Value) -> serde_json::Value {
    let mut r = r.clone();
    if let Some(o) = r.as_object_mut() {
        o.remove("flows");
        o.remove("queue_kb");
        o.remove("buckets");
        o.insert("experiment".into(), exp.into());
    }
    r
}
