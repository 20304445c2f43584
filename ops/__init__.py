"""Operations: the launcher and test scripts, the Docker files and the benchmarks."""
