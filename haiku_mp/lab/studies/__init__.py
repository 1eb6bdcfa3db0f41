"""The lab's studies of the seeds' questions and the new formats', one per file:
`python -m launch.lab <study>` runs one and writes its JSON and plots."""
