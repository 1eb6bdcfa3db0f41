"""Prints the machine the commands run on here, as their console's
`Machine:` line: the CPU, its cores and the allocator setting in force.

python -m launch.machine
"""

from haiku_mp.lab import hardware

if __name__ == '__main__':
  print(hardware.host_line())
