//! Trust suite: registration (see main.rs).
