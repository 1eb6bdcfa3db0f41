"""The commands wing's tests."""
