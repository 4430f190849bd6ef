//! The `shardcache` Python package's native module (being written).
