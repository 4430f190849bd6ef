//! The fault and attack suite (issue 12): every case an outside review tried as an
//! attacker or as a bad day in a data centre, kept as a test against the real daemon.
//!
//! One module per theme; each test names the promise it holds (docs/SEMANTICS.md gives
//! the bound and points back here). Tests that need a second uid run only as root and
//! say so when they skip; tests that hang something bound their own run time.

mod config;
mod floods;
mod fuzz;
mod hung_root;
mod paths;
mod peers_auth;
mod registration;
mod restart;
mod stalls;
