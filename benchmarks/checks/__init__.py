"""The benchmark programs' own checks: each run small against real servers. They take
minutes, so ``make bench`` runs them (before the benchmarks), not the test suite."""
