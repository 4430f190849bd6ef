//! Trust suite: config (see main.rs).
