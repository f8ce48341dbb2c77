//! Start-up progress on standard error: a progress bar on a terminal, log lines otherwise (a
//! line when a phase begins, one every few seconds while it runs, one with its time when it
//! ends), so that loading gigabytes of weights never looks like a hang.

use std::io::IsTerminal as _;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use iris_core::profile::{ProgressSink, StartupPhase, StartupProgress};

/// Time between two log lines of a running phase.
const LOG_EVERY: Duration = Duration::from_secs(5);

/// The display [`StartupProgress`] for this process's standard error.
pub fn startup_progress() -> ProgressSink {
    let display = if std::io::stderr().is_terminal() {
        Display::Bar(Mutex::new(None))
    } else {
        Display::Lines(Mutex::new(LineState::default()))
    };
    ProgressSink(Arc::new(display))
}

enum Display {
    Bar(Mutex<Option<ProgressBar>>),
    Lines(Mutex<LineState>),
}

#[derive(Default)]
struct LineState {
    what: String,
    total: u64,
    last_line: Option<Instant>,
}

impl StartupProgress for Display {
    fn begin(&self, phase: StartupPhase, what: &str, total: u64) {
        match self {
            Display::Bar(bar) => {
                let template = match phase.unit() {
                    "bytes" => "{msg} [{bar:30}] {bytes}/{total_bytes} {elapsed}",
                    "steps" => "{msg} [{bar:30}] {pos}/{len} steps {elapsed}",
                    _ => "{msg} [{bar:30}] {pos}/{len} layers {elapsed}",
                };
                let style = ProgressStyle::with_template(template)
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> ");
                let new = ProgressBar::new(total)
                    .with_style(style)
                    .with_message(format!("iris: {}: {what}", name(phase)));
                new.enable_steady_tick(Duration::from_millis(250));
                *lock(bar) = Some(new);
            }
            Display::Lines(state) => {
                eprintln!("iris: {}: {what} ({})", name(phase), amount(phase, total));
                *lock(state) = LineState {
                    what: what.to_owned(),
                    total,
                    last_line: Some(Instant::now()),
                };
            }
        }
    }

    fn advance(&self, phase: StartupPhase, done: u64) {
        match self {
            Display::Bar(bar) => {
                if let Some(bar) = lock(bar).as_ref() {
                    bar.set_position(done);
                }
            }
            Display::Lines(state) => {
                let mut state = lock(state);
                if state.last_line.is_some_and(|at| at.elapsed() >= LOG_EVERY) {
                    eprintln!(
                        "iris: {}: {} of {}",
                        name(phase),
                        amount(phase, done),
                        amount(phase, state.total)
                    );
                    state.last_line = Some(Instant::now());
                }
            }
        }
    }

    fn finish(&self, phase: StartupPhase, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        match self {
            Display::Bar(bar) => {
                if let Some(bar) = lock(bar).take() {
                    let total = bar.length().unwrap_or(0);
                    bar.finish_and_clear();
                    eprintln!(
                        "iris: {}: {} in {secs:.1} s",
                        name(phase),
                        amount(phase, total)
                    );
                }
            }
            Display::Lines(state) => {
                let state = lock(state);
                eprintln!(
                    "iris: {}: {} done in {secs:.1} s ({})",
                    name(phase),
                    state.what,
                    amount(phase, state.total)
                );
            }
        }
    }
}

/// The phase as the lines name it.
fn name(phase: StartupPhase) -> &'static str {
    match phase {
        StartupPhase::ReadWeights => "loading weights",
        StartupPhase::UploadWeights => "uploading weights",
        StartupPhase::Profile => "profiling",
        StartupPhase::WarmUp => "warming up",
        _ => "starting",
    }
}

/// `count` in the phase's unit, bytes in MiB.
fn amount(phase: StartupPhase, count: u64) -> String {
    match phase.unit() {
        "bytes" => format!("{:.1} MiB", count as f64 / 1_048_576.0),
        unit => format!("{count} {unit}"),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while drawing leaves the state usable; progress must not stop start-up.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
