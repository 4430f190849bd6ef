//! Trust suite: stalls (see main.rs).
