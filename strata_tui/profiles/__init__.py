"""Profiles: the TOML files that say how to launch an engine (Strata or another kind) and how the app behaves;
their validation, the store that edits them in place, and the file operations under it."""
