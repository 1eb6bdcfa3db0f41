"""A run assembled from its settings and trained: `experiment` builds its
parts (after `checks`), `loop` trains and evaluates the `session` it opens,
`in_flight`, `checkpoint`, `interruption` and `run_dir` keep it safe and
recorded, `console` and `overview` keep it visible. Imported by its modules'
names; nothing here is public API (the package's top level is)."""
