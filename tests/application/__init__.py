"""The application wing's tests."""
