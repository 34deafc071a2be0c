"""C stand-ins for the CUDA driver and the HIP runtime, compiled at test time (see build.py)."""
