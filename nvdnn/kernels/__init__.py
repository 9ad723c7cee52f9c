"""Kernel families: each module turns a request into KernelSpecs, launch geometry and presets."""
