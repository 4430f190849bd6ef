//! Trust suite: floods (see main.rs).
