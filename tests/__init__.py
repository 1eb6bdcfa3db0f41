"""The test package. Importing it (every test module does, through
`tests.helpers` or `tests.devices`) gives JAX eight virtual CPU devices, so a
test module runs alone as well as under pytest. XLA reads the flag when JAX
first creates its CPU backend, not when jax is imported."""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
