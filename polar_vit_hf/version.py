"""The package version: its one home (setup.cfg reads it, ``polar_vit_hf.__version__`` re-exports it)."""

__version__ = "0.2.0"
