//! The conformance suite: one set of checks run against any device plugin.
