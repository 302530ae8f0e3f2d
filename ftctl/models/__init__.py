"""Model resolution (paths, hub ids, built-in aliases) and loading."""
