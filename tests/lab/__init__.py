"""The lab wing's tests."""
