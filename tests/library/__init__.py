"""The library wing's tests."""
