"""Other engines run beside moeflow in the benchmarks, in our process (see each module for what it runs)."""
