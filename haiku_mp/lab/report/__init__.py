"""`launch.lab report`: the seeds' questions answered for one machine, as
JSON, plots and one report.md."""
