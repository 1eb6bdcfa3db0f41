"""The lab: what lower precision buys, measured on the ViT application.
Its kit lives here (`timing`: the one clock; `variants`: the derived
configs; `machine`: what a figure ran on; `compare`: ratios within a run;
`isolated`: a step timed in a fresh process; `run_inputs`: what a
measurement starts from; `run_plots` and `charts`: the house style of every
plot); the benchmarks, studies, reports and the advisor's driver are its
folders. `launch.lab` and `launch.benchmark` run it; it needs the `lab`
extra."""
