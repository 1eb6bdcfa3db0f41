"""What the devices report of their memory."""

from typing import Optional

import jax


def peak_memory_bytes() -> Optional[int]:
  """The largest peak bytes in use over local devices, where reported."""
  peaks = []
  for device in jax.local_devices():
    stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
    if stats and 'peak_bytes_in_use' in stats:
      peaks.append(int(stats['peak_bytes_in_use']))
  return max(peaks) if peaks else None
