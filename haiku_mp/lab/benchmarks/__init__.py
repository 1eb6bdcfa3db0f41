"""`launch.benchmark`: what a compiled train step, the input pipeline and the
training loop cost, as ratios between variants measured in one run."""
