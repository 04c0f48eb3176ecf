"""Speed and memory benchmarks (not tests): ratios against the non-private run of the same model."""
