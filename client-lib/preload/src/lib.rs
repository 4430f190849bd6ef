//! `libshardcache_preload.so`: see docs/PYTHON.md (being written).
