//! Trust suite: paths (see main.rs).
