"""Pure numpy/scipy/numba kernels: nothing here imports pyspark."""
