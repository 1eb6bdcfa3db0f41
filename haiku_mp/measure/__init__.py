"""The lab's kit: the one clock, the derived configs, the machine a figure
ran on, ratios within a run, and the bar charts."""
