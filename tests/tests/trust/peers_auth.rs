//! Trust suite: peers_auth (see main.rs).
