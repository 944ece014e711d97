"""Tools built on the package: the optimization ladders and the GPU case table."""
