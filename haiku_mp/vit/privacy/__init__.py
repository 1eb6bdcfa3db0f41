"""DP-SGD on JAX Privacy, with its precision rules (`dp_sgd`)."""
