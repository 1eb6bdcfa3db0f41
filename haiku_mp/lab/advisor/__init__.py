"""The precision advisor's driver: the trainer's model and batches measured
with `haiku_mp.advisor`, and the files `launch.lab advise` writes."""
