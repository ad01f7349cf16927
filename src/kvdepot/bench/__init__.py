"""Benchmarks run by ``kvdepot bench …``. Each prints measured figures next to a ceiling measured
in the same run (never a remembered number), so ratios stay honest on noisy shared machines."""
