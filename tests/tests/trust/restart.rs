//! Trust suite: restart (see main.rs).
