"""The base below every layer, free of MPI: errors, settings and their
validation, the array bridge to torch / jax / cupy, dtypes and half-precision
casts, pytrees, RowSparse, the shard boundary and a wire dtype's arena."""
