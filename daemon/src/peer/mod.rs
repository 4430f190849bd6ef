//! Peers (issue 5, in progress): the parts of cluster-wide sharing that do not need the
//! network yet. [`ring`] gives every block an owner among the healthy peers by
//! rendezvous hashing; [`membership`] keeps the peer list (a static list, or a DNS name
//! re-resolved periodically, as a Kubernetes headless Service gives) and each peer's
//! health. The gRPC service and the fill path's peer source build on these.

pub mod membership;
pub mod ring;
