//! Shared code of the flexns command-line clients and benchmarks.

#![warn(unreachable_pub, missing_docs)]

pub mod bench;
pub mod blk;
pub mod blkbench;
pub mod ccsim;
pub mod demo;
pub mod kvbench;
pub mod netns;
pub mod perf;
pub mod plot;
pub mod procs;
pub mod progress;
pub mod suite;
pub mod ycsb;
