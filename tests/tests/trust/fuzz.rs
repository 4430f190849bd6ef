//! Trust suite: fuzz (see main.rs).
