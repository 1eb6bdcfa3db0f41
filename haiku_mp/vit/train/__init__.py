"""A run assembled from a config and trained: `experiment` builds its
parts, `loop` trains and evaluates, `checkpoint`, `metrics`, `run_dir`,
`interruption` and `in_flight` keep it safe and visible. Imported by its
modules' names; nothing here is public API (the package's top level is)."""
