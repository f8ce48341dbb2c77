//! Scheduler benches (placeholder replaced below).
fn main() {}
