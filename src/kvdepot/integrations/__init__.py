"""Engine adapters. Nothing in kvdepot's core imports from here; each engine lives in its own subpackage."""
