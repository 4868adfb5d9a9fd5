"""Pipeline-parallel training built on `pallasopt.optim`."""
