//! Progress of long runs on stderr (indicatif): a bar over a benchmark's measured runs, with
//! the run in progress and the time left, drawn only when stderr is a terminal. Results stay
//! on stdout; lines printed through [`Progress::println`] and [`Progress::suspend`] appear
//! above the bar (and plainly in a log).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::time::Duration;

/// A bar of `runs` measured runs; cleared when dropped.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A bar named `what` over `runs` runs.
    pub fn new(what: &str, runs: u64) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(runs), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template(
            "{prefix} [{elapsed_precise}] {bar:30} {pos}/{len} runs, about {eta} left: {msg}",
        ) {
            bar.set_style(style);
        }
        bar.set_prefix(what.to_string());
        bar.enable_steady_tick(Duration::from_millis(250));
        Progress { bar }
    }

    /// Names the run in progress.
    pub fn start(&self, run: impl Into<String>) {
        self.bar.set_message(run.into());
    }

    /// One run finished.
    pub fn finished_one(&self) {
        self.bar.inc(1);
    }

    /// Prints `line` on stderr above the bar.
    pub fn println(&self, line: impl AsRef<str>) {
        self.bar.suspend(|| eprintln!("{}", line.as_ref()));
    }

    /// Runs `f` (which prints results) with the bar taken off the terminal.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.bar.suspend(f)
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}
