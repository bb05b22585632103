"""What a study asks: the config, the matrix of cells, SLOs, topologies and the trace schema."""
