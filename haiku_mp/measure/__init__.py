"""The lab's kit: the one clock, the derived configs, the machine a figure
ran on, ratios within a run, what a measurement starts from (`run_inputs`:
a run's config, checkpoint and batches), and the house style of every plot
(`run_plots`: a run's curves, `charts`: the bar charts)."""
